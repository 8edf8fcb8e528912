#!/usr/bin/env bash
# One device call: GPU tests, the default run on the GPU, then B1 (meshtron vs Hugging Face).
# Usage on the GPU machine: bash benchmarks/gpu_check.sh [OUT_DIR]
set -uo pipefail
out="${1:-${OUT:-/tmp/meshtron-gpu}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -15 | tee "$out/gpu_tests.txt"
(cd "$(mktemp -d)" && /usr/bin/time -v python3 -m meshtron train --data-cache-path "$PWD/cache" --save "$PWD/ckpt" 2>&1 | grep -E "iteration +(10|100|200|300)/|validation|sample|model:|saved|Elapsed") | tee "$out/default_run.txt"
python3 benchmarks/b1_llama.py --steps 10 --warmup 3 2>"$out/b1_stderr.txt" | tee "$out/b1.txt"
