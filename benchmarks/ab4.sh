#!/usr/bin/env bash
# A/B of the working tree ("new") against an older tree unpacked at OLD (`git archive <commit> meshtron
# benchmarks | tar -x -C OLD`), on one host of 4 GPUs, in lanes that run side by side; every
# comparison is made within one lane (same GPUs, same call), never across lanes:
#   GPU 0      B1 new (with Hugging Face), old, new; then B3 start-up (this tree's meta_build.py startup, each tree on PYTHONPATH) new, old
#   GPU 1      B4b (DeepSeek-V2-Lite x 4, MLA) new, old, new
#   GPUs 2,3   dp2 / tp2 + sp / pp2 1F1B at the B5 shape (8 layers, seq 8192), new then old
# then the GPU tests, their files spread over the 4 GPUs (the multi-GPU files get two).
# Usage on the GPU machine: bash benchmarks/ab4.sh OLD OUT
set -uo pipefail
old="$(cd "$1" && pwd)" out="$2" new="$PWD"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> "$out/gpu.txt"

b1() { (cd "$1" && PYTHONPATH="$1" python3 benchmarks/b1_llama.py --steps 10 --warmup 3 --sides "$2" 2>>"$out/lane0_stderr.txt") | sed "s|^|[$3] |"; }
startup() { (cd "$1" && PYTHONPATH="$1" python3 "$new/benchmarks/meta_build.py" startup 2>>"$out/lane0_stderr.txt") | sed "s|^|[$2] |"; }
lane0() {
  export CUDA_VISIBLE_DEVICES=0
  b1 "$new" meshtron,hf new; b1 "$old" meshtron old; b1 "$new" meshtron new
  startup "$new" new; startup "$old" old
}
b4b() {
  local common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  (cd "$1/benchmarks" && PYTHONPATH="$1" python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" 2>>"$out/lane1_stderr.txt") | sed "s|^|[$2] |"
}
lane1() { export CUDA_VISIBLE_DEVICES=1; b4b "$new" new; b4b "$old" old; b4b "$new" new; }
lane2() {
  export CUDA_VISIBLE_DEVICES=2,3
  local args=(--layouts dp2,tp2,pp2 --layers 8 --seq-length 8192 --global-batch 8 --steps 4 --warmup 2)
  for tree in "$new" "$old"; do
    (cd "$tree" && PYTHONPATH="$tree" python3 benchmarks/b5_scaling.py "${args[@]}" 2>>"$out/lane2_stderr.txt") | sed "s|^|[$([ "$tree" = "$new" ] && echo new || echo old)] |"
  done
}
lane0 > "$out/lane0_b1_b3.txt" 2>&1 &
lane1 > "$out/lane1_b4b.txt" 2>&1 &
lane2 > "$out/lane2_b5.txt" 2>&1 &
wait
tail -n 3 "$out"/lane*_stderr.txt > "$out/stderr_tails.txt" 2>/dev/null

# GPU tests: the multi-GPU files on GPUs 0,1; the rest round-robin on GPUs 2 and 3.
multi=(tests/gpu/test_feature_matrix_gpu.py tests/gpu/test_tp_overlap_gpu.py)
mapfile -t rest < <(ls tests/gpu/test_*_gpu.py | grep -v -e feature_matrix -e tp_overlap)
half=$(( (${#rest[@]} + 1) / 2 ))
run_tests() { CUDA_VISIBLE_DEVICES="$1" PYTHONPATH="$new" timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu "${@:3}" > "$out/gpu_tests_$2.txt" 2>&1; }
run_tests 0,1 multi "${multi[@]}" &
run_tests 2 a "${rest[@]:0:$half}" &
run_tests 3 b "${rest[@]:$half}" &
wait
for f in "$out"/gpu_tests_*.txt; do echo "== $f"; grep -E "passed|failed|error" "$f" | tail -5; done
