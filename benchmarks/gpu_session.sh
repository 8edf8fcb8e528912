#!/usr/bin/env bash
# One device call's worth of checks and benchmarks on one GPU. Usage: bash benchmarks/gpu_session.sh PART OUT
#   tests  every gpu-marked test (kernels vs references, compile in fresh processes, flex, staging), B4 grouped GEMM
#   moe    B4b: the DeepSeek-V2-Lite shape x 4 layers (MLA), grouped GEMM backends and optimizer paths
#   b1     B1 A/B: this tree (fused and reference optimizer) and Hugging Face, and OLD's tree (arg 3)
#   b8     B8: BERT-large and T5-base against Hugging Face, one table
#   probe  GPU tests of T5/estimate/grouped GEMM, B4 layer split and tile sweep, BERT-large profiled against HF
#   round2 the failed GPU tests again, BERT against HF, the B4 tile sweep and the layer profiled
#   x2     (2 GPUs) tp2 overlap backends against dp2; DeepSeek-V2-Lite x 4 layers dp2 vs ep2; the deepest ep2 that fits
#   final1 FP8 / MoE dispatch / estimate / grouped GEMM GPU tests, B4 layer, B4b, B1 against the FP8 recipes
#   final2 B2's loss: bf16 against FP8 (delayed, then rowwise) over 200 steps of real text, three seeds
#   s3a    narrow-moment optimizer / permute / estimate GPU tests; B4b profiled, with bf16 moments, compiled; B4 router profile
#   s3b    fused router / expert wgrad / optimizer GPU tests; B4 layer; B4b with and without gradient-accumulation fusion; B1 with and without it
#   s3c    fused router GPU test; B4b (fusion on by default: against off, and with bf16 moments), profiled; B4 layer; B1 against HF
#   s3d    B4b profiled with its timeline (Chrome trace): where the GPU waits for the host
#   s3e    B4b and B1 (with HF) of this tree against OLD's tree (arg 3), each with its own harness
#   s3f    MoE / optimizer / compile GPU tests; B4 layer (back-to-back timing, both grouped GEMMs); B4b default and with bf16 moments
#   s3x2   (2 GPUs) tp overlap GPU test; tp2 layouts against dp2; DeepSeek-V2-Lite x 4 dp1/dp2/ep2; the fused router GPU test
#   s3tt   B4b against torchtitan 0.2.2 compiled in one call (peer script and wheels carried in .whl/)
#   s3g    MoE permute / router / fused-adamw GPU tests; B4 layer (torch grouped GEMM), profiled
#   s3i    MoE permute GPU test (dispatch timing); B4 layer (torch grouped GEMM), profiled
#   s4a    B4b: its host syncs (sync debug mode) and a profiled timeline of two steps, for host_waits.py
#   s4b    adamw / cross-entropy-sum GPU tests; the expert weight-gradient tile sweep into fp32; B4b profiled with its timeline; B1 against HF
#   s4c    MLA / cross-entropy-sum / adamw / compile GPU tests; B4b default and with bf16 moments, profiled; B1 against HF
#   s4d    adamw (incl. the one-pass norm) / MLA GPU tests; B4b against torchtitan 0.2.2 compiled in one call (.whl/ carried); B1 against HF
#   s4x2   (2 GPUs) tp2 + sp with symmetric-memory overlap against dp2, each step's timeline kept for host_waits.py / kernel sums
#   s4x2b  (2 GPUs) tp overlap GPU test; tp2 layouts against dp2 (dp2's and tp2ovsm's timelines kept); DeepSeek-V2-Lite x 4 dp1/dp2/ep2
#   s4f    adamw / MLA GPU tests; B4b against torchtitan in one call (.whl/ carried); B1 of this tree against OLD's (arg 3, carried), with HF
#   s4g    B1 of this tree and OLD's (arg 3, carried), each profiled: where the time went
#   s4h    B4 layer (torch grouped GEMM) profiled, with its timeline and host syncs
#   s4i    router GPU tests (fp32 gate on tensor cores); B4 layer (both grouped GEMMs); B4b default
#   s4j    fused expert weight-gradient GPU test; the "+=" wgrad tile sweep; B4b with 4 micro batches a step, this tree against OLD's (arg 3)
#   s4k    the final tree: the GPU tests this session touched; B4b and B1 (with HF)
#   s4l    the final tree's B4b (default and bf16 moments) against torchtitan 0.2.2 compiled in one call (.whl/ carried)
#   s5a    grouped GEMM / qk-layernorm / router GPU tests; the TMA candidates against the library's autotune tiles and torch._grouped_mm (all five GEMMs); B4 layer in rounds
#   s5x4   (4 GPUs) DeepSeek-V2-Lite x 4: dp2/ep2/etp2 on 2 of them, then dp4/ep4/ep2etp2/tp2ep2 (global batch 16)
#   s6a    grouped GEMM GPU tests (bf16/fp16: the TMA row kernel at B4's shapes); the TMA tiles sweep (forward, input grad); B4 layer on both grouped GEMMs; B4b on both
#   s6b    grouped GEMM GPU tests (the TMA weight gradient too); B4b of this tree against OLD's (arg 3, carried), and on the triton backend; B4 layer; the sweep with every TMA tile
#   s6c    the session's final tree: grouped GEMM / qk-layernorm / router / permute / estimate GPU tests; B4b this tree against OLD's (arg 3) and on triton; B4 layer on both
#   s6d    B1 this tree against OLD's (arg 3), with HF; OLMoE (2 layers, full-width q/k norms) and sinkhorn routing trained on the GPU
#   b1tune B1 eager / --compile / HF, then B1 with --gemm-tuning twice (the tuning run, then a run reading its file)
#   b8fuse BERT's eager fusions: their GPU kernel tests, each op fused vs unfused, then B8 BERT fused / unfused / HF
#   s7a    the GPU tests of paths merged or fixed since last run (BERT fusions, FP8 experts, MTP, MLA, qk-layernorm, T5, MoE); Muon's speed and loss (muon_check.py)
set -uo pipefail
part="$1" out="$2"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu_$part.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> "$out/gpu_$part.txt"
git rev-parse HEAD >> "$out/gpu_$part.txt" 2>/dev/null
case "$part" in
tests)
  MESHTRON_COMPILE_RUNS=2 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests > "$out/gpu_tests.txt" 2>&1
  tail -30 "$out/gpu_tests.txt"
  OUT="$out" python3 benchmarks/b4_grouped_gemm.py 2>&1 | tee "$out/b4.txt" | tail -20 ;;
moe)
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  for variant in "--model.moe_grouped_gemm torch" "--model.moe_grouped_gemm triton" "--model.moe_grouped_gemm torch --optimizer-impl reference"; do
    # shellcheck disable=SC2086
    (cd benchmarks && python3 train_bench.py --steps 6 --warmup 3 -- "${common[@]}" $variant 2>>"$out/b4b_stderr.txt") | sed "s|^|$variant: |" | tee -a "$out/b4b.txt"
  done ;;
b1)
  old="$(cd "$3" && pwd)"
  python3 benchmarks/b1_llama.py --steps 10 --warmup 3 --sides meshtron,meshtron-optref,hf 2>"$out/b1_new_stderr.txt" | tee "$out/b1_new.txt"
  (cd "$old" && PYTHONPATH="$old" python3 benchmarks/b1_llama.py --steps 10 --warmup 3 --sides meshtron 2>"$out/b1_old_stderr.txt" | tee "$out/b1_old.txt") ;;
b8)
  python3 benchmarks/b8_encoders.py --model both --steps 10 --warmup 3 2>"$out/b8_stderr.txt" | tee "$out/b8.txt" ;;
probe)
  python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_t5_gpu.py tests/gpu/test_estimate_gpu.py tests/gpu/test_grouped_gemm_gpu.py > "$out/gpu_tests_probe.txt" 2>&1
  tail -5 "$out/gpu_tests_probe.txt"
  for backend in torch triton; do python3 benchmarks/b4_moe_layer.py --grouped-gemm $backend 2>&1 | tee -a "$out/b4_layer.txt"; done
  python3 benchmarks/b4_grouped_sweep.py 2>&1 | tee "$out/b4_sweep.txt"
  python3 benchmarks/b8_encoders.py --model bert --steps 6 --warmup 3 --profile-dir "$out" 2>"$out/b8_stderr.txt" | tee "$out/b8_bert.txt" ;;
round2)
  python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_t5_gpu.py tests/gpu/test_estimate_gpu.py -k "relative or deepseek or mixtral" > "$out/gpu_tests_round2.txt" 2>&1
  tail -3 "$out/gpu_tests_round2.txt"
  python3 benchmarks/b8_encoders.py --model bert --steps 8 --warmup 3 --profile-dir "$out" 2>"$out/b8_stderr.txt" | tee "$out/b8_bert.txt"
  python3 benchmarks/b4_moe_layer.py --grouped-gemm torch --profile-dir "$out" 2>&1 | tee "$out/b4_layer.txt"
  python3 benchmarks/b4_moe_layer.py --grouped-gemm triton 2>&1 | tee -a "$out/b4_layer.txt"
  python3 benchmarks/b4_grouped_sweep.py 2>&1 | grep -v "OutOfResources\|CompilationError" | tee "$out/b4_sweep.txt" ;;
x2)
  timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_overlap_gpu.py > "$out/tp_overlap_gpu_test.txt" 2>&1; tail -2 "$out/tp_overlap_gpu_test.txt"
  python3 benchmarks/b5_scaling.py --layouts dp2,tp2,tp2ov,tp2ovsm --layers 8 --seq-length 8192 --global-batch 8 --steps 4 --warmup 2 2>"$out/b5_tp_stderr.txt" | tee "$out/b5_tp.txt"
  python3 benchmarks/b5_scaling.py --model deepseek-v2-lite --layers 4 --micro-batch-size 2 --seq-length 4096 --global-batch 8 --layouts dp1,dp2,ep2,ep2ag --steps 4 --warmup 2 2>"$out/b5_moe_stderr.txt" | tee "$out/b5_moe.txt"
  python3 benchmarks/b5_scaling.py --model deepseek-v2-lite --layers "${DEEPEST:-20}" --micro-batch-size 2 --seq-length 4096 --global-batch 8 --layouts ep2 --steps 3 --warmup 2 2>"$out/b5_deep_stderr.txt" | tee "$out/b5_deep.txt" ;;
final1)
  python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_gpu.py tests/gpu/test_moe_permute_gpu.py tests/gpu/test_grouped_gemm_gpu.py \
    tests/gpu/test_kernels_gpu.py "tests/gpu/test_estimate_gpu.py" > "$out/gpu_tests_final.txt" 2>&1
  grep -v "^$" "$out/gpu_tests_final.txt" | tail -12
  python3 benchmarks/b4_moe_layer.py --grouped-gemm torch 2>&1 | tee "$out/b4_layer.txt"
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  (cd benchmarks && python3 train_bench.py --steps 6 --warmup 3 -- "${common[@]}" 2>>"$out/b4b_stderr.txt") | tee "$out/b4b.txt"
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron,meshtron-fp8-delayed,meshtron-fp8-tensorwise,meshtron-fp8-rowwise,meshtron-fp8-delayed-compile 2>"$out/b1_fp8_stderr.txt" | tee "$out/b1_fp8.txt" ;;
final2)
  for recipe in delayed rowwise; do
    python3 benchmarks/b2_fp8_loss.py --steps 200 --seeds 1,2,3 --fp8-recipe $recipe 2>"$out/b2_${recipe}_stderr.txt" | tee "$out/b2_$recipe.txt"
  done ;;
s3a)
  python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_adamw_gpu.py tests/gpu/test_moe_permute_gpu.py > "$out/gpu_tests_s3a.txt" 2>&1
  python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_estimate_gpu.py -k "mixtral or deepseek" >> "$out/gpu_tests_s3a.txt" 2>&1
  grep -E "passed|failed|Error" "$out/gpu_tests_s3a.txt" | tail -8
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  (cd benchmarks && python3 train_bench.py --steps 6 --warmup 3 --profile "$out/profile_b4b.txt" -- "${common[@]}" 2>>"$out/b4b_stderr.txt") | sed "s|^|default: |" | tee "$out/b4b.txt"
  (cd benchmarks && python3 train_bench.py --steps 6 --warmup 3 -- "${common[@]}" --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 2>>"$out/b4b_stderr.txt") | sed "s|^|bf16 moments: |" | tee -a "$out/b4b.txt"
  (cd benchmarks && timeout 300 python3 train_bench.py --steps 6 --warmup 3 -- "${common[@]}" --compile 2>>"$out/b4b_stderr.txt") | sed "s|^|compile: |" | tee -a "$out/b4b.txt"
  python3 benchmarks/b4_moe_layer.py --grouped-gemm torch --profile-dir "$out" 2>&1 | tee "$out/b4_layer.txt" ;;
s3b)
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider --durations=5 tests/gpu/test_moe_router_gpu.py tests/gpu/test_grouped_gemm_gpu.py -k "router or fused" \
    > "$out/gpu_tests_s3b.txt" 2>&1
  grep -E "passed|failed|Error|relative error|router|call" "$out/gpu_tests_s3b.txt" | tail -16
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  for variant in "" "--gradient-accumulation-fusion" "--gradient-accumulation-fusion --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"; do
    prof=(); [ "$variant" = "--gradient-accumulation-fusion" ] && prof=(--profile "$out/profile_b4b_gaf.txt")
    # shellcheck disable=SC2086
    (cd benchmarks && python3 train_bench.py --steps 6 --warmup 3 "${prof[@]}" -- "${common[@]}" $variant 2>>"$out/b4b_stderr.txt") | sed "s|^|[$variant]: |" | tee -a "$out/b4b.txt"
  done
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron,meshtron-gaf,hf 2>"$out/b1_stderr.txt" | tee "$out/b1.txt" ;;
s3c)
  timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_moe_router_gpu.py > "$out/gpu_tests_s3c.txt" 2>&1
  grep -E "passed|failed|Error|router" "$out/gpu_tests_s3c.txt" | tail -9
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  for variant in "--no-gradient-accumulation-fusion" "" "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"; do
    prof=(); [ -z "$variant" ] && prof=(--profile "$out/profile_b4b.txt")
    # shellcheck disable=SC2086
    (cd benchmarks && python3 train_bench.py --steps 6 --warmup 3 "${prof[@]}" -- "${common[@]}" $variant 2>>"$out/b4b_stderr.txt") | sed "s|^|[$variant]: |" | tee -a "$out/b4b.txt"
  done
  python3 benchmarks/b4_moe_layer.py --grouped-gemm torch 2>&1 | tee "$out/b4_layer.txt"
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron,hf 2>"$out/b1_stderr.txt" | tee "$out/b1.txt" ;;
s3d)
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  (cd benchmarks && python3 train_bench.py --steps 4 --warmup 3 --profile "$out/profile_b4b.txt" --trace "$out/trace_b4b.json.gz" -- "${common[@]}" \
    2>>"$out/b4b_stderr.txt") | tee "$out/b4b.txt"
  ls -la "$out" ;;
s3e)
  old="$(cd "$3" && pwd)"
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  for tree in "$PWD" "$old" "$PWD"; do
    (cd "$tree/benchmarks" && PYTHONPATH="$tree" python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" 2>>"$out/b4b_stderr.txt") | sed "s|^|[$tree]: |" | tee -a "$out/b4b.txt"
  done
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron,hf 2>"$out/b1_new_stderr.txt" | tee "$out/b1_new.txt"
  (cd "$old" && PYTHONPATH="$old" python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron,hf 2>"$out/b1_old_stderr.txt" | tee "$out/b1_old.txt") ;;
s3f)
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider --durations=5 tests/gpu/test_moe_router_gpu.py tests/gpu/test_moe_permute_gpu.py \
    tests/gpu/test_fused_adamw_gpu.py tests/gpu/test_compile_gpu.py "tests/gpu/test_grouped_gemm_gpu.py::test_fused_expert_weight_gradient_gpu" \
    > "$out/gpu_tests_s3f.txt" 2>&1
  grep -E "passed|failed|Error|call " "$out/gpu_tests_s3f.txt" | tail -9
  for backend in torch triton; do python3 benchmarks/b4_moe_layer.py --grouped-gemm $backend 2>&1 | tee -a "$out/b4_layer.txt"; done
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  for variant in "" "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"; do
    # shellcheck disable=SC2086
    (cd benchmarks && python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" $variant 2>>"$out/b4b_stderr.txt") | sed "s|^|[$variant]: |" | tee -a "$out/b4b.txt"
  done ;;
s3x2)
  timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_overlap_gpu.py tests/gpu/test_moe_router_gpu.py > "$out/gpu_tests_x2.txt" 2>&1; tail -2 "$out/gpu_tests_x2.txt"
  python3 benchmarks/b5_scaling.py --layouts dp2,tp2,tp2ovsm --layers 8 --seq-length 8192 --global-batch 8 --steps 4 --warmup 2 2>"$out/b5_tp_stderr.txt" | tee "$out/b5_tp.txt"
  python3 benchmarks/b5_scaling.py --model deepseek-v2-lite --layers 4 --micro-batch-size 2 --seq-length 4096 --global-batch 8 --layouts dp1,dp2,ep2 --steps 4 --warmup 2 2>"$out/b5_moe_stderr.txt" | tee "$out/b5_moe.txt" ;;
s3tt)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
  PYTHONPATH="$PWD:/tmp/site" timeout 400 python3 .whl/bench_tt_moe.py --layers 4 --compile 2>"$out/tt_stderr.txt" | tee "$out/tt.txt"
  tail -3 "$out/tt_stderr.txt"
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  for variant in "" "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"; do
    # shellcheck disable=SC2086
    (cd benchmarks && python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" $variant 2>>"$out/b4b_stderr.txt") | sed "s|^|[$variant]: |" | tee -a "$out/b4b.txt"
  done ;;
s3g)
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_moe_permute_gpu.py tests/gpu/test_moe_router_gpu.py tests/gpu/test_fused_adamw_gpu.py \
    > "$out/gpu_tests_s3g.txt" 2>&1
  grep -E "passed|failed|Error|dispatch" "$out/gpu_tests_s3g.txt" | tail -5
  python3 benchmarks/b4_moe_layer.py --grouped-gemm torch --profile-dir "$out" 2>&1 | tee "$out/b4_layer.txt" ;;
s3i)
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_moe_permute_gpu.py > "$out/gpu_tests_s3i.txt" 2>&1
  grep -E "passed|failed|Error|dispatch" "$out/gpu_tests_s3i.txt" | tail -4
  python3 benchmarks/b4_moe_layer.py --grouped-gemm torch --profile-dir "$out" 2>&1 | tee "$out/b4_layer.txt"
  grep -E "gather_sum|combine_backward|scatter_copies" "$out/profile_moe_layer_torch.txt" | cut -c1-200 ;;
s4a)
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  (cd benchmarks && python3 train_bench.py --steps 4 --warmup 3 --find-syncs "$out/syncs_b4b.txt" --profile "$out/profile_b4b.txt" \
    --trace "$out/trace_b4b.json.gz" -- "${common[@]}" 2>>"$out/b4b_stderr.txt") | tee "$out/b4b.txt"
  head -c 6000 "$out/syncs_b4b.txt"
  python3 benchmarks/host_waits.py "$out/trace_b4b.json.gz" --top 12 > "$out/gaps_b4b.txt"; head -c 5000 "$out/gaps_b4b.txt" ;;
s4b)
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_adamw_gpu.py tests/gpu/test_cross_entropy_sum_gpu.py \
    > "$out/gpu_tests_s4b.txt" 2>&1
  grep -E "passed|failed|Error|main_grad" "$out/gpu_tests_s4b.txt" | tail -5
  (cd benchmarks && timeout 300 python3 b4_grouped_sweep.py --gemms "wgrad fp32,wgrad fp32 +=" --top 4 2>&1) | tee "$out/sweep_wgrad.txt"
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  (cd benchmarks && python3 train_bench.py --steps 8 --warmup 3 --profile "$out/profile_b4b.txt" --trace "$out/trace_b4b.json.gz" \
    -- "${common[@]}" 2>>"$out/b4b_stderr.txt") | tee "$out/b4b.txt"
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron,hf 2>"$out/b1_stderr.txt" | tee "$out/b1.txt" ;;
s4c)
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_mla_gpu.py tests/gpu/test_cross_entropy_sum_gpu.py \
    tests/gpu/test_fused_adamw_gpu.py tests/gpu/test_compile_gpu.py > "$out/gpu_tests_s4c.txt" 2>&1
  grep -E "passed|failed|Error|positions|main_grad" "$out/gpu_tests_s4c.txt" | tail -8
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  (cd benchmarks && python3 train_bench.py --steps 8 --warmup 3 --profile "$out/profile_b4b.txt" -- "${common[@]}" 2>>"$out/b4b_stderr.txt") | tee "$out/b4b.txt"
  (cd benchmarks && python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" --use-precision-aware-optimizer --exp-avg-dtype bf16 \
    --exp-avg-sq-dtype bf16 2>>"$out/b4b_stderr.txt") | tee -a "$out/b4b.txt"
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron,hf 2>"$out/b1_stderr.txt" | tee "$out/b1.txt" ;;
s4d)
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_adamw_gpu.py \
    tests/gpu/test_mla_gpu.py > "$out/gpu_tests_s4d.txt" 2>&1
  grep -E "passed|failed|Error|positions|main_grad|norm over" "$out/gpu_tests_s4d.txt" | tail -8
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
  PYTHONPATH="$PWD:/tmp/site" timeout 400 python3 .whl/bench_tt_moe.py --layers 4 --compile 2>"$out/tt_stderr.txt" | tee "$out/tt.txt"
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  for variant in "" "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"; do
    # shellcheck disable=SC2086
    (cd benchmarks && python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" $variant 2>>"$out/b4b_stderr.txt") | sed "s|^|[$variant]: |" | tee -a "$out/b4b.txt"
  done
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron,hf 2>"$out/b1_stderr.txt" | tee "$out/b1.txt" ;;
s4x2)
  python3 benchmarks/b5_scaling.py --layouts dp2,tp2ovsm --layers 8 --seq-length 8192 --global-batch 8 --steps 4 --warmup 2 \
    --trace-dir "$out" 2>"$out/b5_tp_stderr.txt" | tee "$out/b5_tp.txt"
  tail -3 "$out/b5_tp_stderr.txt"; ls -la "$out" ;;
s4x2b)
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_overlap_gpu.py > "$out/gpu_tests_x2.txt" 2>&1; tail -2 "$out/gpu_tests_x2.txt"
  python3 benchmarks/b5_scaling.py --layouts dp2,tp2,tp2ovsm --layers 8 --seq-length 8192 --global-batch 8 --steps 4 --warmup 2 \
    --trace-dir "$out" 2>"$out/b5_tp_stderr.txt" | tee "$out/b5_tp.txt"
  rm -f "$out/trace_tp2.json.gz"
  python3 benchmarks/b5_scaling.py --model deepseek-v2-lite --layers 4 --micro-batch-size 2 --seq-length 4096 --global-batch 8 \
    --layouts dp1,dp2,ep2 --steps 4 --warmup 2 2>"$out/b5_moe_stderr.txt" | tee "$out/b5_moe.txt" ;;
s4f)
  old="$(cd "$3" && pwd)"
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_adamw_gpu.py tests/gpu/test_mla_gpu.py > "$out/gpu_tests_s4f.txt" 2>&1
  grep -E "passed|failed|Error|positions|norm over" "$out/gpu_tests_s4f.txt" | tail -5
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
  PYTHONPATH="$PWD:/tmp/site" timeout 400 python3 .whl/bench_tt_moe.py --layers 4 --compile 2>"$out/tt_stderr.txt" | tee "$out/tt.txt"
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  for variant in "" "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"; do
    # shellcheck disable=SC2086
    (cd benchmarks && python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" $variant 2>>"$out/b4b_stderr.txt") | sed "s|^|[$variant]: |" | tee -a "$out/b4b.txt"
  done
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron,hf 2>"$out/b1_new_stderr.txt" | tee "$out/b1_new.txt"
  (cd "$old" && PYTHONPATH="$old" python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron 2>"$out/b1_old_stderr.txt" | tee "$out/b1_old.txt")
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron 2>>"$out/b1_new_stderr.txt" | tee -a "$out/b1_new.txt" ;;
s4g)
  old="$(cd "$3" && pwd)"
  mkdir -p "$out/new" "$out/old"
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron --profile-dir "$out/new" 2>"$out/b1_new_stderr.txt" | tail -2
  (cd "$old" && PYTHONPATH="$old" python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron --profile-dir "$out/old" 2>"$out/b1_old_stderr.txt" | tail -2)
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron 2>>"$out/b1_new_stderr.txt" | tail -1 ;;
s4h)
  (cd benchmarks && python3 b4_moe_layer.py --grouped-gemm torch --profile-dir "$out" 2>&1) | tee "$out/b4_layer.txt"
  python3 benchmarks/host_waits.py "$out/trace_moe_layer_torch.json.gz" --top 10 > "$out/gaps_moe_layer.txt"; head -c 4000 "$out/gaps_moe_layer.txt"
  head -c 3000 "$out/syncs_moe_layer.txt" ;;
s4i)
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_moe_router_gpu.py tests/gpu/test_estimate_gpu.py > "$out/gpu_tests_s4i.txt" 2>&1
  grep -E "passed|failed|Error|fp32 gate|held|peak" "$out/gpu_tests_s4i.txt" | tail -8
  for backend in torch triton; do python3 benchmarks/b4_moe_layer.py --grouped-gemm $backend 2>&1 | tee -a "$out/b4_layer.txt"; done
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  (cd benchmarks && python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" 2>>"$out/b4b_stderr.txt") | tee "$out/b4b.txt" ;;
s4j)
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider "tests/gpu/test_grouped_gemm_gpu.py::test_fused_expert_weight_gradient_gpu" \
    > "$out/gpu_tests_s4j.txt" 2>&1; grep -E "passed|failed|Error" "$out/gpu_tests_s4j.txt" | tail -3
  (cd benchmarks && timeout 240 python3 b4_grouped_sweep.py --gemms "wgrad fp32 +=" --top 3 2>&1) | tee "$out/sweep_wgrad_acc.txt"
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --bf16)
  for tree in "$PWD" "$(cd "$3" && pwd)" "$PWD"; do
    (cd "$tree/benchmarks" && PYTHONPATH="$tree" python3 train_bench.py --steps 4 --warmup 2 -- "${common[@]}" --global-batch-size 8 \
      2>>"$out/b4b_stderr.txt") | sed "s|^|[$tree]: |" | tee -a "$out/b4b_gbs8.txt"
  done ;;
s4k)
  timeout 420 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_mla_gpu.py tests/gpu/test_fused_adamw_gpu.py \
    tests/gpu/test_cross_entropy_sum_gpu.py tests/gpu/test_moe_router_gpu.py tests/gpu/test_kernels_gpu.py tests/gpu/test_moe_permute_gpu.py \
    tests/gpu/test_estimate_gpu.py tests/gpu/test_compile_gpu.py "tests/gpu/test_grouped_gemm_gpu.py::test_fused_expert_weight_gradient_gpu" \
    > "$out/gpu_tests_s4k.txt" 2>&1
  grep -E "passed|failed|Error" "$out/gpu_tests_s4k.txt" | tail -6
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  (cd benchmarks && python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" 2>>"$out/b4b_stderr.txt") | tee "$out/b4b.txt"
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron,hf 2>"$out/b1_stderr.txt" | tail -3 ;;
s4l)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
  PYTHONPATH="$PWD:/tmp/site" timeout 400 python3 .whl/bench_tt_moe.py --layers 4 --compile 2>"$out/tt_stderr.txt" | tee "$out/tt.txt"
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  for variant in "" "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16" ""; do
    # shellcheck disable=SC2086
    (cd benchmarks && python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" $variant 2>>"$out/b4b_stderr.txt") | sed "s|^|[$variant]: |" | tee -a "$out/b4b.txt"
  done ;;
s5a)
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_grouped_gemm_gpu.py tests/gpu/test_qk_layernorm_gpu.py \
    tests/gpu/test_moe_router_gpu.py > "$out/gpu_tests_s5a.txt" 2>&1
  grep -E "passed|failed|Error" "$out/gpu_tests_s5a.txt" | tail -3
  (cd benchmarks && timeout 420 python3 b4_grouped_sweep.py --candidates --library-tiles autotune --top 3 2>&1) | tee "$out/sweep_tma.txt"
  python3 benchmarks/b4_moe_layer.py --grouped-gemm torch --rounds 5 2>&1 | tee "$out/b4_layer.txt" ;;
s5x4)
  moe=(--model deepseek-v2-lite --layers 4 --micro-batch-size 2 --seq-length 4096 --steps 4 --warmup 2)
  python3 benchmarks/b5_scaling.py "${moe[@]}" --global-batch 8 --layouts dp2,ep2,etp2 2>"$out/b5_moe2_stderr.txt" | tee "$out/b5_moe2.txt"
  python3 benchmarks/b5_scaling.py "${moe[@]}" --global-batch 16 --layouts dp4,ep4,ep2etp2,tp2ep2 2>"$out/b5_moe4_stderr.txt" | tee "$out/b5_moe4.txt" ;;
s6a)
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_grouped_gemm_gpu.py -k "not dtype2" > "$out/gpu_tests_s6a.txt" 2>&1
  grep -E "passed|failed|Error" "$out/gpu_tests_s6a.txt" | tail -3
  (cd benchmarks && timeout 240 python3 b4_grouped_sweep.py --candidates --library-tiles autotune --gemms "forward,input grad" --top 4 2>&1) | tee "$out/sweep_tma.txt"
  for backend in triton torch; do python3 benchmarks/b4_moe_layer.py --grouped-gemm $backend --rounds 3 2>&1 | tee -a "$out/b4_layer.txt"; done
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  for variant in "--model.moe_grouped_gemm triton" "--model.moe_grouped_gemm torch"; do
    # shellcheck disable=SC2086
    (cd benchmarks && python3 train_bench.py --steps 6 --warmup 3 -- "${common[@]}" $variant 2>>"$out/b4b_stderr.txt") | sed "s|^|$variant: |" | tee -a "$out/b4b.txt"
  done ;;
s6b)
  old="$(cd "$3" && pwd)"
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_grouped_gemm_gpu.py -k "not dtype2" > "$out/gpu_tests_s6b.txt" 2>&1
  grep -E "passed|failed|Error|relative" "$out/gpu_tests_s6b.txt" | tail -4
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  for tree in "$PWD" "$old" "$PWD"; do
    (cd "$tree/benchmarks" && PYTHONPATH="$tree" python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" 2>>"$out/b4b_stderr.txt") | sed "s|^|[$tree]: |" | tee -a "$out/b4b.txt"
  done
  (cd benchmarks && python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" --model.moe_grouped_gemm triton 2>>"$out/b4b_stderr.txt") | sed "s|^|[triton]: |" | tee -a "$out/b4b.txt"
  for backend in triton torch; do python3 benchmarks/b4_moe_layer.py --grouped-gemm $backend --rounds 3 2>&1 | tee -a "$out/b4_layer.txt"; done
  (cd benchmarks && timeout 200 python3 b4_grouped_sweep.py --candidates --library-tiles autotune --top 3 2>&1) | grep -v "^ \|^$\|^#\|^%\|^{\|^}" | tee "$out/sweep_tma.txt" ;;
s6c)
  old="$(cd "$3" && pwd)"
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_grouped_gemm_gpu.py -k "not dtype2" tests/gpu/test_qk_layernorm_gpu.py \
    tests/gpu/test_moe_router_gpu.py tests/gpu/test_moe_permute_gpu.py tests/gpu/test_estimate_gpu.py > "$out/gpu_tests_s6c.txt" 2>&1
  grep -E "passed|failed|Error" "$out/gpu_tests_s6c.txt" | tail -4
  common=(--preset deepseek-v2-lite --num-layers 4 --moe-layer-freq "([0]+[1]*3)" --seq-length 4096 --micro-batch-size 2 --global-batch-size 2 --bf16)
  for tree in "$PWD" "$old" "$PWD"; do
    (cd "$tree/benchmarks" && PYTHONPATH="$tree" python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" 2>>"$out/b4b_stderr.txt") | sed "s|^|[$tree]: |" | tee -a "$out/b4b.txt"
  done
  (cd benchmarks && python3 train_bench.py --steps 8 --warmup 3 -- "${common[@]}" --model.moe_grouped_gemm triton 2>>"$out/b4b_stderr.txt") | sed "s|^|[triton]: |" | tee -a "$out/b4b.txt"
  for backend in torch triton; do python3 benchmarks/b4_moe_layer.py --grouped-gemm $backend --rounds 5 2>&1 | tee -a "$out/b4_layer.txt"; done ;;
s6d)
  old="$(cd "$3" && pwd)"
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron,hf 2>"$out/b1_new_stderr.txt" | tee "$out/b1_new.txt"
  (cd "$old" && PYTHONPATH="$old" python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron 2>"$out/b1_old_stderr.txt" | tee "$out/b1_old.txt")
  (cd benchmarks && python3 train_bench.py --steps 6 --warmup 3 -- --preset olmoe-1b-7b --num-layers 2 --seq-length 4096 --micro-batch-size 2 \
    --global-batch-size 2 --bf16 2>"$out/olmoe_stderr.txt") | sed "s|^|[olmoe x 2 layers]: |" | tee "$out/olmoe.txt"
  (cd benchmarks && python3 train_bench.py --steps 6 --warmup 3 -- --preset olmoe-1b-7b --num-layers 2 --seq-length 4096 --micro-batch-size 2 \
    --global-batch-size 2 --bf16 --moe-router-load-balancing-type sinkhorn --moe-loss-weight 0 2>>"$out/olmoe_stderr.txt") | sed "s|^|[olmoe x 2, sinkhorn]: |" | tee -a "$out/olmoe.txt" ;;
b1tune)
  python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron,meshtron-compile,hf 2>"$out/b1_stderr.txt" | tee "$out/b1_compile.txt"
  for run in tuning reading; do
    python3 benchmarks/b1_llama.py --steps 8 --warmup 3 --sides meshtron -- --gemm-tuning --data-cache-path "$out/tunableop" 2>>"$out/b1_tune_stderr.txt" | tee "$out/b1_tune_$run.txt"
  done
  ls -la "$out/tunableop" ;;
b8fuse)
  python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_bert_fusions_gpu.py > "$out/gpu_tests_b8fuse.txt" 2>&1
  grep -E "passed|failed|error|dropout|bias" "$out/gpu_tests_b8fuse.txt" | tail -20
  python3 benchmarks/bert_fusions.py 2>&1 | tee "$out/bert_fusions.txt"
  python3 benchmarks/b8_encoders.py --model bert --steps 8 --warmup 3 --sides meshtron,meshtron-unfused,hf 2>"$out/b8_stderr.txt" | tee "$out/b8_fuse.txt" ;;
s7a)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_bert_fusions_gpu.py tests/gpu/test_fp8_experts_gpu.py \
    tests/gpu/test_mtp_gpu.py tests/gpu/test_mla_gpu.py tests/gpu/test_qk_layernorm_gpu.py tests/gpu/test_t5_gpu.py \
    tests/gpu/test_moe_permute_gpu.py tests/gpu/test_moe_router_gpu.py > "$out/gpu_tests_s7a.txt" 2>&1
  tail -25 "$out/gpu_tests_s7a.txt"
  timeout 370 python3 benchmarks/muon_check.py --out "$out/muon_check" 2>"$out/muon_stderr.txt" | tail -30 ;;
esac
