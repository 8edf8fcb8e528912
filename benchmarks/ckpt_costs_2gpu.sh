#!/usr/bin/env bash
# Issue 9's checkpoint costs on 2 GPUs at the B3 shape (Llama-3-8B layers x 8 + 128 K vocabulary,
# seq 8192, fp32 masters): dp2 with the distributed optimizer, then tp2 + sp. Usage on the GPU
# machine: bash benchmarks/ckpt_costs_2gpu.sh OUT
set -uo pipefail
out="$1"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
free -g | tee -a "$out/gpu.txt"
cd benchmarks
for layout in "--use-distributed-optimizer" "--tp 2 --sequence-parallel"; do
  name=$(echo "$layout" | tr -d ' -' | cut -c1-12)
  # shellcheck disable=SC2086
  python3 -m torch.distributed.run --standalone --nproc-per-node 2 train_bench.py --steps 3 --warmup 2 --checkpoint /tmp/ckb2 -- \
    --preset llama3-8b --num-layers 8 --seq-length 8192 --micro-batch-size 1 --global-batch-size 8 --bf16 $layout \
    2>"$out/$name.stderr" | tee "$out/$name.json"
done
