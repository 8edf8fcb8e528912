# Shared by the example launch scripts (sourced, not run): KEY=VALUE arguments as the ROCm scripts
# take them, the GPU count, and the torchrun launch with DRY_RUN and TEE_OUTPUT.

# read_knobs "$@": each KEY=VALUE argument exported like an environment variable.
read_knobs() {
  for ARGUMENT in "$@"; do
    case "$ARGUMENT" in
      *=*) export "${ARGUMENT%%=*}=${ARGUMENT#*=}" ;;
      *) echo "$(basename "$0"): arguments are KEY=VALUE knobs (got '$ARGUMENT'); meshtron flags go in EXTRA" >&2; exit 2 ;;
    esac
  done
  if [ -z "${GPUS_PER_NODE:-}" ]; then
    GPUS_PER_NODE=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
  fi
  NNODES=${NNODES:-1}
}

# launch: torchrun over NNODES x GPUS_PER_NODE with the meshtron arguments in the array `args`;
# DRY_RUN=1 prints the command; TEE_OUTPUT (default 1) sends output to the terminal and TRAIN_LOG, 0 to TRAIN_LOG only.
launch() {
  [ -n "${SAVE:-}" ] && args+=(--save "$SAVE")
  [ -n "${LOAD:-}" ] && args+=(--load "$LOAD")
  # shellcheck disable=SC2206
  [ -n "${EXTRA:-}" ] && args+=($EXTRA)
  local cmd=(torchrun --nnodes "$NNODES" --node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-localhost}"
             --master-port "${MASTER_PORT:-29500}" --nproc-per-node "$GPUS_PER_NODE" -m meshtron "${args[@]}")
  if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${cmd[@]}"; echo
    echo "# output: $([ "${TEE_OUTPUT:-1}" = 1 ] && echo "terminal and $TRAIN_LOG" || echo "$TRAIN_LOG only")" >&2
    exit 0
  fi
  mkdir -p "$LOG_DIR"
  if [ "${TEE_OUTPUT:-1}" = 1 ]; then
    "${cmd[@]}" 2>&1 | tee "$TRAIN_LOG"
    exit "${PIPESTATUS[0]}"
  fi
  exec "${cmd[@]}" > "$TRAIN_LOG" 2>&1
}
