export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; git log --oneline -1 2>/dev/null
s=$(date +%s)
timeout 110 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_bert_fusions_gpu.py tests/gpu/test_kernels_gpu.py tests/gpu/test_fp8_experts_gpu.py 2>&1 | tail -8
echo "tests $(( $(date +%s) - s )) s"; s=$(date +%s)
timeout 110 python benchmarks/b8_encoders.py --model bert --steps 8 --warmup 3 --sides meshtron,meshtron-unfused,hf 2>$OUT/b8_stderr.txt | tee $OUT/b8.txt | tail -8
echo "b8 $(( $(date +%s) - s )) s"; s=$(date +%s)
timeout 50 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_plan_gpu.py 2>&1 | tail -3
echo "plan $(( $(date +%s) - s )) s"
