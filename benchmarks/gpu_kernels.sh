#!/usr/bin/env bash
# One device call for the speed layer: kernels vs references (bf16, fwd+bwd), SDPA backends at
# the B1 shape, then B1 with meshtron's fast path, its reference path and Hugging Face side by side.
# Usage on the GPU machine: bash benchmarks/gpu_kernels.sh [OUT_DIR]
set -uo pipefail
out="${1:-${OUT:-/tmp/meshtron-gpu}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Every side (Hugging Face too) with the caching allocator's expandable segments: the unfused
# reference path otherwise fails on fragmentation (a 7.8 GiB fp32 logits gradient) at 80 GB.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
date -u | tee -a "$out/gpu.txt"
python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu 2>&1 | grep -v "^$" | tail -40 | tee "$out/kernel_checks.txt"
python3 benchmarks/sdpa_backends.py 2>&1 | tee "$out/sdpa.txt"
python3 benchmarks/cross_entropy_fusion.py 2>&1 | tee "$out/cross_entropy_fusion.txt"
python3 benchmarks/b1_llama.py --steps 10 --warmup 3 --sides meshtron,meshtron-ref,hf --profile-dir "$out" \
  2>"$out/b1_stderr.txt" | tee "$out/b1.txt"
