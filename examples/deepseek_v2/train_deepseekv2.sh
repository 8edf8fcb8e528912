#!/usr/bin/env bash
# DeepSeek-V2-Lite pretraining (the deepseek-v2-lite preset: multi-head latent attention, 64 routed
# experts top-6 + 2 shared, layer 0 dense) with the knobs of ROCm Megatron-LM's
# examples/deepseek_v2/train_deepseekv2.sh, given as environment variables or KEY=VALUE arguments:
#
#   bash examples/deepseek_v2/train_deepseekv2.sh PR=fp8 MBS=4 GBS=256 AC=full
#   DRY_RUN=1 ... prints the command instead of running it.
#
# Knobs [defaults, ROCm's]: PR [bf16] (bf16 | fp8: FP8 hybrid linear layers), MBS [4], GBS [256],
# SEQ_LEN [2048], PAD_LEN [2048] (accepted as --max-padding-length; pretraining packs documents, so
# nothing is padded), AC [sel] (none | sel: selective recompute | full: every layer, uniform),
# TRAIN_ITERS [50], GEMM_TUNING [0], MOCK_DATA [1] (0: real data from
# DATA_DIR/mmap_deepseekv2_datasets_text_document, a `meshtron preprocess` prefix, with the
# tokenizer.json in TOKENIZER_MODEL), DATA_DIR [/root/deepseek-datasets], DATA_CACHE_PATH (index
# cache; on several nodes a directory all of them see), TEE_OUTPUT [1] (1: output to the terminal and
# LOG_DIR/output_EXP_NAME.log; 0: only to the log), NNODES [1], NODE_RANK [0], MASTER_ADDR [localhost],
# MASTER_PORT [29500], GPUS_PER_NODE [all visible], TP [1], PP [1], EP [8: ROCm's expert parallelism,
# halved until it divides the data-parallel ranks], LR [1e-5], MIN_LR [1e-6], SAVE, LOAD,
# EXP_NAME [perf], LOG_DIR [experiment/<layout>/<time>], EXTRA (more flags).
#
# Not copied from ROCm's script: its MOE_LAYER_FREQ=1 (every layer MoE) and aux_loss 1e-2 balancing,
# --extra-vocab-size 2400 and --max-position-embeddings SEQ_LEN; the preset keeps DeepSeek-V2-Lite's
# real shape (dense layer 0, seq_aux_loss 1e-3, the 102400 vocabulary, YaRN positions) so Hugging Face
# weights load. Attention uses the fastest fused kernel for MLA's 192/128 head dims rather than
# --use-flash-attn. Set any of them through EXTRA.
set -euo pipefail

# shellcheck source=../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"
read_knobs "$@"

PRESET=deepseek-v2-lite
PR=${PR:-bf16}; AC=${AC:-sel}
case "$PR" in bf16|fp8) ;; *) echo "train_deepseekv2.sh: PR must be bf16 or fp8 (got '$PR')" >&2; exit 2 ;; esac
case "$AC" in none|sel|full) ;; *) echo "train_deepseekv2.sh: AC must be none, sel or full (got '$AC')" >&2; exit 2 ;; esac

TP=${TP:-1}; PP=${PP:-1}
WORLD=$((NNODES * GPUS_PER_NODE))
DP=$((WORLD / (TP * PP)))
if [ -z "${EP:-}" ]; then
  EP=8
  while [ "$EP" -gt 1 ] && [ $((DP % EP)) -ne 0 ]; do EP=$((EP / 2)); done
fi
MBS=${MBS:-4}; GBS=${GBS:-256}
SEQ_LEN=${SEQ_LEN:-2048}; PAD_LEN=${PAD_LEN:-2048}
TRAIN_ITERS=${TRAIN_ITERS:-50}
WARMUP_ITERS=2
EXP_NAME=${EXP_NAME:-perf}
LAYOUT=${NNODES}nodes_${PRESET}_${PR}_seq${SEQ_LEN}_tp${TP}pp${PP}ep${EP}_mbs${MBS}gbs${GBS}_ac_${AC}
LOG_DIR=${LOG_DIR:-experiment/$LAYOUT/$(date +%Y-%m-%d_%H-%M-%S)}
TRAIN_LOG="$LOG_DIR/output_${EXP_NAME}.log"

args=(train --preset "$PRESET" --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
      --expert-model-parallel-size "$EP" --micro-batch-size "$MBS" --global-batch-size "$GBS"
      --seq-length "$SEQ_LEN" --max-padding-length "$PAD_LEN" --train-iters "$TRAIN_ITERS"
      --lr "${LR:-1e-5}" --min-lr "${MIN_LR:-1e-6}" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
      --lr-decay-iters $((TRAIN_ITERS > WARMUP_ITERS ? TRAIN_ITERS - WARMUP_ITERS : TRAIN_ITERS))
      --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.008
      --bf16 --eod-mask-loss --log-interval 1 --eval-interval 0 --tensorboard-dir "$LOG_DIR")
[ "$PR" = fp8 ] && args+=(--fp8-format hybrid)
case "$AC" in
  sel) args+=(--recompute-activations) ;;
  full)
    NUM_LAYERS=$(python3 -c "from meshtron.presets import preset_fields; print(preset_fields('$PRESET')['model.num_layers'])")
    args+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers "$((NUM_LAYERS / PP))") ;;
esac
if [ "${MOCK_DATA:-1}" = 1 ]; then
  args+=(--mock-data)
else
  args+=(--data-path "${DATA_DIR:-/root/deepseek-datasets}/mmap_deepseekv2_datasets_text_document" --tokenizer-type DeepSeekV2Tokenizer
         --tokenizer-model "${TOKENIZER_MODEL:?MOCK_DATA=0: set TOKENIZER_MODEL to the DeepSeek-V2-Lite tokenizer.json (or its folder)}")
fi
[ -n "${DATA_CACHE_PATH:-}" ] && args+=(--data-cache-path "$DATA_CACHE_PATH")
[ "$TP" -gt 1 ] && args+=(--sequence-parallel)
[ "$DP" -gt 1 ] && args+=(--use-distributed-optimizer)
[ "${GEMM_TUNING:-0}" = 1 ] && args+=(--gemm-tuning)
launch
