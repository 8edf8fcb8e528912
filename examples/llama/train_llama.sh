#!/usr/bin/env bash
# Llama 2 / 3 / 3.1 pretraining with the knobs of the ROCm Megatron-LM example scripts, given as
# environment variables or as KEY=VALUE arguments (as those scripts take them):
#
#   bash examples/llama/train_llama3.sh MODEL_SIZE=8 TP=2 MBS=2 BS=128 SEQ_LENGTH=8192
#   DRY_RUN=1 ... prints the command instead of running it.
#
# Knobs [defaults]: MODEL [llama3] (llama2 | llama3 | llama3.1), MODEL_SIZE [8] (7, 13, 70 for llama2;
# 8, 70 for llama3; 8, 70, 405 for llama3.1), NNODES [1], NODE_RANK [0], MASTER_ADDR [localhost],
# MASTER_PORT [29500], GPUS_PER_NODE [all visible], TP [1], PP [1], CP [1], MBS [2], BS [8 x data-parallel
# ranks], SEQ_LENGTH [preset's], TOTAL_ITERS [20], LR [3e-4], DATA_PATH (set: real data from this
# `meshtron preprocess` prefix; unset: mock data), TOKENIZER_TYPE [HuggingFaceTokenizer], TOKENIZER_MODEL
# (needed with DATA_PATH), DATA_CACHE_PATH (index cache; on several nodes a directory all of them see),
# TE_FP8 [0] (1: FP8 hybrid linear layers), FSDP [0] (1: PyTorch FSDP2; forces TP=1 and no sequence
# parallelism, as ROCm's scripts do), RECOMPUTE [0] (1: full recompute of every layer, Megatron's block
# method), USE_FLASH_ATTN [0] (1: flash attention; 0: the fastest fused kernel, cuDNN first),
# ENABLE_PROFILING [0] (1: PyTorch profiler trace of iterations PROFILE_STEP_START [3] to
# PROFILE_STEP_END [5] in LOG_DIR/profile), GEMM_TUNING [0], COMPILE [0], SAVE, LOAD, EXP_NAME [perf],
# LOG_DIR [experiment/<layout>/<time>] (TensorBoard events: `meshtron plot LOG_DIR`), TEE_OUTPUT [1]
# (1: output to the terminal and LOG_DIR/output_EXP_NAME.log; 0: only to the log), EXTRA (more flags).
#
# Where the defaults differ from ROCm's (MODEL_SIZE 70, TP 8, MBS 1, BS 8, TOTAL_ITERS 12, GEMM_TUNING 1,
# USE_FLASH_ATTN 1 in train_llama2.sh): they fit one 8-GPU node without tuning; set the knobs to get ROCm's.
set -euo pipefail

# shellcheck source=../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"
read_knobs "$@"

MODEL=${MODEL:-llama3}
MODEL_SIZE=${MODEL_SIZE:-8}
case "$MODEL-$MODEL_SIZE" in
  llama2-7|llama2-13|llama2-70|llama3-8|llama3-70|llama3.1-8|llama3.1-70|llama3.1-405) PRESET="$MODEL-${MODEL_SIZE}b" ;;
  *) echo "train_llama.sh: no preset for MODEL=$MODEL MODEL_SIZE=$MODEL_SIZE (llama2: 7 13 70; llama3: 8 70; llama3.1: 8 70 405)" >&2; exit 2 ;;
esac

TP=${TP:-1}; PP=${PP:-1}; CP=${CP:-1}
SEQ_PARALLEL=1
if [ "${FSDP:-0}" = 1 ]; then
  if [ "$TP" -gt 1 ]; then
    echo "FSDP and TP do not combine; resetting TP=$TP to TP=1" >&2
    TP=1
  fi
  SEQ_PARALLEL=0
fi
WORLD=$((NNODES * GPUS_PER_NODE))
DP=$((WORLD / (TP * PP * CP)))
MBS=${MBS:-2}
BS=${BS:-$((8 * DP))}
TOTAL_ITERS=${TOTAL_ITERS:-20}
EXP_NAME=${EXP_NAME:-perf}
LOG_DIR=${LOG_DIR:-experiment/${NNODES}nodes_${PRESET}_mbs${MBS}_bs${BS}_tp${TP}_pp${PP}_cp${CP}_iter${TOTAL_ITERS}/$(date +%Y-%m-%d_%H-%M-%S)}
TRAIN_LOG="$LOG_DIR/output_${EXP_NAME}.log"

args=(train --preset "$PRESET" --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
      --context-parallel-size "$CP" --micro-batch-size "$MBS" --global-batch-size "$BS"
      --train-iters "$TOTAL_ITERS" --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}" --lr-warmup-iters "${WARMUP_ITERS:-2}"
      --bf16 --log-interval "${LOG_INTERVAL:-1}" --eval-interval "${EVAL_INTERVAL:-0}" --tensorboard-dir "$LOG_DIR")
[ -n "${SEQ_LENGTH:-}" ] && args+=(--seq-length "$SEQ_LENGTH")
if [ -n "${DATA_PATH:-}" ]; then
  args+=(--data-path $DATA_PATH --tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}"
         --tokenizer-model "${TOKENIZER_MODEL:?DATA_PATH is set: set TOKENIZER_MODEL to the tokenizer it was made with}")
else
  args+=(--mock-data)
  [ -n "${TOKENIZER_MODEL:-}" ] && args+=(--tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}" --tokenizer-model "$TOKENIZER_MODEL")
fi
[ -n "${DATA_CACHE_PATH:-}" ] && args+=(--data-cache-path "$DATA_CACHE_PATH")
[ "$TP" -gt 1 ] && [ "$SEQ_PARALLEL" = 1 ] && args+=(--sequence-parallel)
if [ "${FSDP:-0}" = 1 ]; then args+=(--fsdp); elif [ "$DP" -gt 1 ]; then args+=(--use-distributed-optimizer); fi
if [ "${USE_FLASH_ATTN:-0}" = 1 ]; then args+=(--use-flash-attn); else args+=(--attention-backend fused); fi
[ "${TE_FP8:-0}" = 1 ] && args+=(--fp8-format hybrid)
if [ "${RECOMPUTE:-0}" = 1 ]; then
  NUM_LAYERS=$(python3 -c "from meshtron.presets import preset_fields; print(preset_fields('$PRESET')['model.num_layers'])")
  args+=(--recompute-granularity full --recompute-method block --recompute-num-layers "$NUM_LAYERS")
fi
[ "${ENABLE_PROFILING:-0}" = 1 ] && args+=(--profile --profile-step-start "${PROFILE_STEP_START:-3}" --profile-step-end "${PROFILE_STEP_END:-5}")
[ "${GEMM_TUNING:-0}" = 1 ] && args+=(--gemm-tuning)
[ "${COMPILE:-0}" = 1 ] && args+=(--compile)
launch
