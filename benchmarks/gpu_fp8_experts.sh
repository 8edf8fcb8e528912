#!/usr/bin/env bash
# One device call for FP8 experts (model.moe_fp8 rowwise under --fp8-format), one H100/H200, about
# 3-4 minutes: the GPU checks (tests/gpu/test_fp8_experts_gpu.py: the Triton casts bit-equal to the
# reference, torch._scaled_grouped_mm and the _scaled_mm loop against float64 at B4's shapes, the
# autograd function against the reference path), then B4's expert GEMMs in FP8 against bf16
# (b4_fp8_grouped_gemm.py), then B4b in bf16, with FP8 linears and experts, and with FP8 linears only
# (b4b_fp8_experts.py). Each part has its own time limit (at most 90 + 45 + 280 s; B4b sides 90 s
# each, start-up included) and writes its file as soon as it ends.
# Usage on the GPU machine: bash benchmarks/gpu_fp8_experts.sh [OUT_DIR] [B4b sides]
#   (sides bf16_4mb,fp8_4mb,fp8_linears_4mb: four micro batches a step, the weight casts shared)
set -uo pipefail
out="${1:-${OUT:-/tmp/meshtron-gpu}}"
sides="${2:-bf16,fp8,fp8_linears}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  git rev-parse --short HEAD 2>/dev/null; date -u; } | tee "$out/gpu.txt"
timeout "${TEST_LIMIT:-90}" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_fp8_experts_gpu.py 2>&1 \
  | grep -v "^$" | tail -40 | tee "$out/fp8_experts_checks.txt"
timeout "${GEMM_LIMIT:-45}" python3 benchmarks/b4_fp8_grouped_gemm.py --steps 20 --warmup 5 2>&1 | tee "$out/b4_fp8_grouped_gemm.txt"
cd benchmarks && timeout "${B4B_LIMIT:-280}" python3 b4b_fp8_experts.py --steps 6 --warmup 3 --sides "$sides" --limit "${SIDE_LIMIT:-90}" \
  2>&1 | tee "$out/b4b_fp8_experts.txt"
