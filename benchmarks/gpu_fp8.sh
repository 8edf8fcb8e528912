#!/usr/bin/env bash
# One device call for FP8, compile, recompute and the memory estimator: the FP8 GEMMs against their
# simulation, then B1-shape speed and memory side by side (B2 speed, B7, estimate vs measured),
# then B2's loss comparison on the embedded corpus. Each part has its own time limit and writes
# its file as soon as it ends, so a part that runs out of time does not lose the others.
# The compiled side runs last and alone: its compile time is the least predictable.
# Usage on the GPU machine: bash benchmarks/gpu_fp8.sh [OUT_DIR] [B1 sides] [B1 steps] [last B1 sides]
set -uo pipefail
out="${1:-${OUT:-/tmp/meshtron-gpu}}"
sides="${2:-meshtron,meshtron-fp8,meshtron-recompute}"
steps="${3:-6}"
last_sides="${4:-meshtron-fp8-compile}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
  date -u; } | tee "$out/gpu.txt"
timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_gpu.py tests/unit/test_fp8.py 2>&1 \
  | grep -v "^$" | tail -40 | tee "$out/fp8_checks.txt"
timeout "${B1_LIMIT:-80}" python3 benchmarks/b1_llama.py --steps "$steps" --warmup 3 --sides "$sides" \
  2>"$out/b1_stderr.txt" | tee "$out/b1.txt"
timeout "${B2_LIMIT:-60}" python3 benchmarks/b2_fp8_loss.py --steps 200 2>"$out/b2_stderr.txt" | tee "$out/b2_loss.txt"
python3 benchmarks/b1_llama.py --steps "$steps" --warmup 3 --sides "$last_sides" 2>"$out/b1_last_stderr.txt" | tee "$out/b1_last.txt"
