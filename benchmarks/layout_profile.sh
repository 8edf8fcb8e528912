#!/usr/bin/env bash
# Where one layout's step time goes, for layouts the planner mispredicts: each layout (one argument of
# meshtron train flags) trains DeepSeek-V2-Lite x LAYERS (27, layer 0 dense) at seq 4096, global batch 8,
# on all of this machine's GPUs for 6 steps; rank 0 records iteration 4's trace (--profile), and
# kernel_sums.py splits it by kernel family (NCCL, GEMM, attention, Triton, elementwise) with the time
# each family ran alone. Prints each layout's tokens/s per GPU (median of steps 3-6) and its peak memory.
# Usage on the GPU machine: bash benchmarks/layout_profile.sh OUT "flags of layout 1" "flags of layout 2" ...
set -uo pipefail
out="$1"; shift
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
layers="${LAYERS:-27}" gpus="${GPUS:-$(nvidia-smi -L | wc -l)}"
base=(--model.preset deepseek-v2-lite --num-layers "$layers" --moe-layer-freq "([0]+[1]*$((layers - 1)))" --seq-length 4096
      --global-batch-size 8 --bf16 --mock-data --train-iters 6 --log-interval 1 --eval-interval 0
      --profile --profile-step-start 4 --profile-step-end 5)
n=0
for layout in "$@"; do
  n=$((n + 1))
  name="layout$n"
  # shellcheck disable=SC2086
  timeout "${LAYOUT_LIMIT:-150}" python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" -m meshtron train "${base[@]}" \
    $layout --tensorboard-dir "$out/$name" > "$out/$name.log" 2>&1
  echo "== $name: $layout (exit $?)"
  grep -o "tokens/s/device [0-9,]*" "$out/$name.log" | sed -n '3,6p' | tr -d , | awk '{print $2}' | sort -n | awk '{a[NR]=$1} END {if (NR) print "tokens/s/GPU median", a[int((NR+1)/2)]}'
  grep -o "mem [0-9.]* GiB" "$out/$name.log" | tail -1
  grep -m3 -E "Error|error:" "$out/$name.log"
  for trace in "$out/$name"/profile/*.json; do
    [ -f "$trace" ] && python3 benchmarks/kernel_sums.py "$trace" && gzip "$trace"
  done
done
