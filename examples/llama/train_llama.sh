#!/usr/bin/env bash
# Llama 2 / 3 / 3.1 pretraining with the environment knobs of the ROCm Megatron-LM example scripts.
#
#   MODEL=llama3 MODEL_SIZE=8 TP=2 MBS=2 BS=128 SEQ_LENGTH=8192 bash examples/llama/train_llama.sh
#   DRY_RUN=1 ... prints the command instead of running it.
#
# Knobs (defaults in brackets): MODEL [llama3] (llama2 | llama3 | llama3.1), MODEL_SIZE [8] (7, 13, 70 for
# llama2; 8, 70 for llama3; 8, 70, 405 for llama3.1), NNODES [1], NODE_RANK [0], MASTER_ADDR [localhost],
# MASTER_PORT [29500], GPUS_PER_NODE [all visible], TP [1], PP [1], CP [1], MBS [2], BS [8 x data-parallel
# ranks], SEQ_LENGTH [preset's], TOTAL_ITERS [20], MOCK_DATA [1], DATA_PATH, TOKENIZER_TYPE, TOKENIZER_MODEL,
# TE_FP8 [0] (1: FP8 hybrid linear layers), FSDP [0], RECOMPUTE [0] (1: full recompute), GEMM_TUNING [0],
# COMPILE [0], SAVE, LOAD, LR [3e-4], EXTRA (more meshtron flags).
set -euo pipefail

MODEL=${MODEL:-llama3}
MODEL_SIZE=${MODEL_SIZE:-8}
case "$MODEL-$MODEL_SIZE" in
  llama2-7|llama2-13|llama2-70|llama3-8|llama3-70|llama3.1-8|llama3.1-70|llama3.1-405) PRESET="$MODEL-${MODEL_SIZE}b" ;;
  *) echo "train_llama.sh: no preset for MODEL=$MODEL MODEL_SIZE=$MODEL_SIZE (llama2: 7 13 70; llama3: 8 70; llama3.1: 8 70 405)" >&2; exit 2 ;;
esac

if [ -z "${GPUS_PER_NODE:-}" ]; then
  GPUS_PER_NODE=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
NNODES=${NNODES:-1}
TP=${TP:-1}; PP=${PP:-1}; CP=${CP:-1}
WORLD=$((NNODES * GPUS_PER_NODE))
DP=$((WORLD / (TP * PP * CP)))
MBS=${MBS:-2}
BS=${BS:-$((8 * DP))}

args=(train --preset "$PRESET" --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
      --context-parallel-size "$CP" --micro-batch-size "$MBS" --global-batch-size "$BS"
      --train-iters "${TOTAL_ITERS:-20}" --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}" --lr-warmup-iters "${WARMUP_ITERS:-2}"
      --bf16 --log-interval "${LOG_INTERVAL:-1}" --eval-interval "${EVAL_INTERVAL:-0}")
[ -n "${SEQ_LENGTH:-}" ] && args+=(--seq-length "$SEQ_LENGTH")
if [ "${MOCK_DATA:-1}" = 1 ]; then
  args+=(--mock-data)
else
  args+=(--data-path ${DATA_PATH:?set DATA_PATH (a prefix from meshtron preprocess) or MOCK_DATA=1}
         --tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}" --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}")
fi
[ "$TP" -gt 1 ] && args+=(--sequence-parallel)
if [ "${FSDP:-0}" = 1 ]; then args+=(--fsdp); elif [ "$DP" -gt 1 ]; then args+=(--use-distributed-optimizer); fi
[ "${TE_FP8:-0}" = 1 ] && args+=(--fp8-format hybrid)
[ "${RECOMPUTE:-0}" = 1 ] && args+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
[ "${GEMM_TUNING:-0}" = 1 ] && args+=(--gemm-tuning)
[ "${COMPILE:-0}" = 1 ] && args+=(--compile)
[ -n "${SAVE:-}" ] && args+=(--save "$SAVE")
[ -n "${LOAD:-}" ] && args+=(--load "$LOAD")
# shellcheck disable=SC2206
[ -n "${EXTRA:-}" ] && args+=($EXTRA)

cmd=(torchrun --nnodes "$NNODES" --node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-localhost}"
     --master-port "${MASTER_PORT:-29500}" --nproc-per-node "$GPUS_PER_NODE" -m meshtron "${args[@]}")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi
