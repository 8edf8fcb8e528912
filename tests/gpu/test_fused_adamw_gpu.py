"""The fused optimizer step against the reference step (torch's fused AdamW) on the GPU, over
several steps with clipping, decay and no-decay groups, fp16 loss scaling, in the replicated and
distributed-optimizer layouts (one process). Relative errors: fp32 rounding for masters and
moments (the kernel may contract multiply-adds the reference rounds twice), a rare flipped
last bit for the low-precision model copy."""

import pytest
import torch

from meshtron.kernels.checks import adamw_block_groups_check, fused_adamw_check, narrow_moments_check


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,model_tol", [(torch.bfloat16, 1e-3), (torch.float16, 1e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("distributed", [False, True])
def test_fused_step_matches_reference_gpu(dtype, model_tol, distributed):
    worst = fused_adamw_check("cuda", dtype, distributed, steps=6)
    print(f"{dtype} distributed={distributed}: {worst}")
    assert max(worst["master"], worst["exp_avg"], worst["exp_avg_sq"]) < 1e-5, worst
    assert worst["model"] < model_tol and worst["grad_norm"] < 1e-4, worst


@pytest.mark.gpu
@pytest.mark.parametrize("moment_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("distributed", [False, True])
def test_narrow_moments_gpu(moment_dtype, distributed):
    """--exp-avg-dtype / --exp-avg-sq-dtype: narrow moments equal fp32 ones rounded after each step, bit for bit."""
    assert narrow_moments_check("cuda", moment_dtype, distributed)


@pytest.mark.gpu
def test_block_group_summary_gpu():
    """Per-block parameter groups: equal to reading every element's group, bit for bit."""
    assert adamw_block_groups_check("cuda")


@pytest.mark.gpu
def test_one_pass_gradient_norm():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from meshtron.kernels.fused_adamw import sum_of_squares

    flat = torch.randn(300_000_001, device="cuda")
    expected = torch.linalg.vector_norm(flat.double())
    got = sum_of_squares([flat[:1000], flat[1000:]]).sqrt()
    times = {}
    for name, fn in {"one pass": lambda: sum_of_squares([flat]), "foreach_norm": lambda: torch._foreach_norm([flat])}.items():
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 10
    print(f"gradient norm over 300M fp32: one pass {times['one pass']:.3f} ms, foreach_norm {times['foreach_norm']:.3f} ms")
    assert abs(got.double() - expected) / expected < 1e-6
