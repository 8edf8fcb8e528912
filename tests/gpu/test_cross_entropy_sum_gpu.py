"""The masked-sum output layer + loss with gradients taken in the forward, on the GPU in bf16 at
B1's output shape (4096 tokens, hidden 2048, vocabulary 128256), against an fp32 reference."""

import pytest
import torch
import torch.nn.functional as F

from meshtron.kernels.cross_entropy import linear_cross_entropy
from meshtron.kernels.cross_entropy_sum import linear_cross_entropy_sum

TOKENS, HIDDEN, VOCAB = 4096, 2048, 128256


def _grads(total_fn, hidden, weight):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    total = total_fn(hidden, weight)
    return (total.float(), *torch.autograd.grad(total / 1000.0, (hidden, weight)))


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [4 * 2**30, 256 * 2**20])  # one token block; four blocks
def test_sum_fusion_bf16_b1_shape(budget):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda").bfloat16()
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda") * 0.02).bfloat16()
    labels = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    labels[:100] = -100
    mask = (torch.rand(TOKENS, device="cuda") > 0.1).float()

    def reference(h, w):  # fp32 logits and loss from the same bf16 values
        per_token = F.cross_entropy(F.linear(h.float(), w.float()), labels, reduction="none")
        return (per_token * mask).sum()

    ref = _grads(reference, hidden, weight)
    fused = _grads(lambda h, w: linear_cross_entropy_sum(h, w, labels, mask, budget_bytes=budget), hidden, weight)
    per_token = _grads(lambda h, w: (linear_cross_entropy(h, w, labels) * mask).sum(), hidden, weight)
    for name, f, p, r in zip(("loss", "hidden grad", "weight grad"), fused, per_token, ref):
        err_fused = ((f.float() - r.float()).norm() / r.float().norm()).item()
        err_per_token = ((p.float() - r.float()).norm() / r.float().norm()).item()
        print(f"{name} budget {budget >> 20} MiB: fused {err_fused:.2e}, per-token chunked {err_per_token:.2e}")
        assert err_fused < 1e-2 and err_fused <= 1.5 * err_per_token + 1e-5, name


@pytest.mark.gpu
def test_weight_gradient_into_main_grad_bf16_b1_shape():
    """Gradient-accumulation fusion of the output layer: the weight gradient goes scaled into an
    fp32 ``main_grad`` (Triton kernel; written over stale NaN, then added by a second micro
    batch), as close to the fp32 reference as the autograd path's, or closer."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from meshtron.optim.grad_buffer import GradBuffer

    torch.manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda").bfloat16()
    weight = torch.nn.Parameter((torch.randn(VOCAB, HIDDEN, device="cuda") * 0.02).bfloat16())
    labels = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    mask = (torch.rand(TOKENS, device="cuda") > 0.1).float()
    ref = torch.autograd.grad(F.cross_entropy(F.linear(hidden.float(), weight.float()), labels, reduction="none") @ mask / 1000.0, weight)[0]
    plain = torch.autograd.grad(linear_cross_entropy_sum(hidden, weight, labels, mask) / 1000.0, weight)[0]
    buffer = GradBuffer([("weight", weight)])
    buffer.data.fill_(float("nan"))
    for _ in range(2):
        (linear_cross_entropy_sum(hidden, weight, labels, mask, fuse_weight_grad=True) / 2000.0).backward()
    buffer.finish_grad_sync()
    err_fused = ((weight.main_grad - ref).norm() / ref.norm()).item()
    err_plain = ((plain.float() - ref).norm() / ref.norm()).item()
    print(f"weight grad into main_grad: {err_fused:.2e}, autograd path {err_plain:.2e}")
    assert weight.grad is None and err_fused < 1e-2 and err_fused <= 1.01 * err_plain
