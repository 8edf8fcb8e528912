"""Gradient-accumulation fusion's non-GEMM paths on the GPU: the token embedding's rows scattered
into an fp32 ``main_grad`` (B1's table: 128256 x 2048, 4 x 4096 ids), against the fp32 dense
gradient and bit for bit equal run to run; and the fused optimizer's one-pass gradient norm."""

import pytest
import torch

from meshtron.kernels.grad_accum_fusion import FusedWgradEmbedding, apply_gradient_accumulation_fusion
from meshtron.optim.grad_buffer import GradBuffer


@pytest.mark.gpu
def test_embedding_into_main_grad_bf16_b1_shape():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    table = FusedWgradEmbedding(128256, 2048).cuda().bfloat16()
    buffer = GradBuffer([("weight", table.weight)])
    apply_gradient_accumulation_fusion(torch.nn.Module(), table)
    ids = torch.randint(0, 1000, (4, 4096), device="cuda")  # many repeats, as in text
    grad = torch.randn(4, 4096, 2048, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        buffer.zero_()
        buffer.data.fill_(float("nan"))
        table(ids).backward(grad)
        buffer.finish_grad_sync()
        runs.append(table.weight.main_grad.clone())
    reference = torch.zeros(128256, 2048, device="cuda").index_add_(0, ids.reshape(-1), grad.reshape(-1, 2048).float())
    error = ((runs[0] - reference).norm() / reference.norm()).item()
    print(f"embedding rows into main_grad: {error:.1e} against the fp32 sum")
    assert torch.equal(runs[0], runs[1]) and error < 1e-6


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
