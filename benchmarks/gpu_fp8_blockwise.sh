#!/usr/bin/env bash
# One device call for the blockwise FP8 recipe (--fp8-recipe blockwise): its GPU checks
# (tests/gpu/test_fp8_blockwise_gpu.py: the cast kernel bit-equal to the reference, each GEMM path
# and the linear against float64, the GEMMs' speed at B3's shapes beside bf16 and per-tensor FP8),
# then B3 through the training loop in bf16, FP8 delayed (hybrid: issue 31's FP8 figure) and FP8
# blockwise (e4m3). About 4 minutes on one H100.
# Usage on the GPU machine: bash benchmarks/gpu_fp8_blockwise.sh [OUT_DIR] [B3 sides]
set -uo pipefail
out="${1:-${OUT:-/tmp/meshtron-gpu}}"
sides="${2:-bf16,delayed,blockwise}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  date -u; } | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_fp8_blockwise_gpu.py 2>&1 \
  | grep -v "^$" | tail -60 | tee "$out/blockwise_checks.txt"
timeout 420 python3 benchmarks/b3_fp8_recipes.py --steps 6 --warmup 3 --sides "$sides" 2>&1 | tee "$out/b3_fp8_recipes.txt"
