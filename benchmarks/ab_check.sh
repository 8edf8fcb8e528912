#!/usr/bin/env bash
# A/B on one GPU machine, in one command: the working tree ("new") against an older commit's tree
# unpacked at OLD (e.g. `git archive <commit> | tar -x -C old_tree`), so a refactor's cost is measured
# side by side, not remembered. Usage on the GPU machine:
#   bash benchmarks/ab_check.sh b1 OLD OUT   GPU tests, then B1 new (meshtron + Hugging Face) and old (meshtron)
#   bash benchmarks/ab_check.sh b5 OLD OUT   dp2 / tp2 + sp / pp2 1F1B on 2 GPUs, new then old (B5 shape, 8 layers)
set -uo pipefail
which="$1" old="$(cd "$2" && pwd)" out="$3"
mkdir -p "$out"
new="$PWD"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu_$which.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu_$which.txt"
if [ "$which" = b1 ]; then
  PYTHONPATH="$new" python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -15 | tee "$out/gpu_tests.txt"
  PYTHONPATH="$new" python3 benchmarks/b1_llama.py --steps 10 --warmup 3 --sides meshtron,hf 2>"$out/b1_new_stderr.txt" | tee "$out/b1_new.txt"
  (cd "$old" && PYTHONPATH="$old" python3 benchmarks/b1_llama.py --steps 10 --warmup 3 --sides meshtron 2>"$out/b1_old_stderr.txt" | tee "$out/b1_old.txt")
else
  args=(--layouts dp2,tp2,pp2 --layers 8 --seq-length 8192 --global-batch 8 --steps 4 --warmup 2)
  PYTHONPATH="$new" python3 benchmarks/b5_scaling.py "${args[@]}" 2>"$out/b5_new_stderr.txt" | tee "$out/b5_new.txt"
  (cd "$old" && PYTHONPATH="$old" python3 benchmarks/b5_scaling.py "${args[@]}" 2>"$out/b5_old_stderr.txt" | tee "$out/b5_old.txt")
fi
