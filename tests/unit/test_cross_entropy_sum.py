"""The masked-sum output layer + loss that takes its gradients in the forward, against full
logits + ``F.cross_entropy`` on the CPU, and the decoder's use of it."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.config import build_config
from meshtron.kernels.cross_entropy import linear_cross_entropy
from meshtron.kernels.cross_entropy_sum import block_tokens_for, linear_cross_entropy_sum
from meshtron.models import build_model
from meshtron.models.contract import SummedTokenLoss

VOCAB, HIDDEN = 300, 24


def _problem():
    """Hidden states computed from a tied weight (an embedding lookup, so the weight's gradient has
    two sources), labels with ignored tokens, a loss mask with zeros and non-unit weights."""
    torch.manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN) * 0.3).requires_grad_()
    tokens = torch.randint(0, VOCAB, (3, 11))
    mix = (torch.randn(HIDDEN, HIDDEN) / HIDDEN**0.5).requires_grad_()
    labels = torch.randint(0, VOCAB, (3, 11))
    labels[1, 4:7] = -100
    mask = (torch.rand(3, 11) > 0.3).float() * torch.tensor([1.0, 0.5, 2.0])[:, None]
    return weight, tokens, mix, labels, mask


def _loss_and_grads(weight, tokens, mix, labels, mask, fused: bool, **kw):
    hidden = torch.tanh(F.embedding(tokens, weight) @ mix)
    if fused:
        total = linear_cross_entropy_sum(hidden, weight, labels, mask, "auto", **kw)
    else:
        logits = F.linear(hidden, weight).float()
        total = (F.cross_entropy(logits.flatten(0, 1), labels.reshape(-1), reduction="none").view(labels.shape) * mask).sum()
    objective = total * 3.0 / mask.sum()  # the runner's scalar: a loss scale over the global count
    grad_weight, grad_mix = torch.autograd.grad(objective, (weight, mix))
    return total, grad_weight, grad_mix


@pytest.mark.parametrize("chunk, budget", [(0, 2**30), (7, 2**30), (64, 2**30), (300, 2**30),
                                           (64, 10 * VOCAB * 4), (64, 5 * VOCAB * 4)])  # fmt: skip
def test_sum_loss_and_grads_equal_unfused_fp32(chunk, budget):
    """Loss, the tied weight's gradient and a gradient upstream of the hidden states equal the
    unfused reference in fp32, for one token block or several (``budget``) and any vocabulary chunk."""
    weight, tokens, mix, labels, mask = _problem()
    if budget < 2**30:
        assert block_tokens_for(33, VOCAB, 4, budget) < 33
    ref = _loss_and_grads(weight, tokens, mix, labels, mask, fused=False)
    got = _loss_and_grads(weight, tokens, mix, labels, mask, fused=True, chunk_size=chunk, budget_bytes=budget)
    for g, r, name in zip(got, ref, ("loss", "weight grad", "upstream grad")):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=name)


def test_sum_loss_and_grads_bf16_near_fp32_reference():
    """bf16 GEMMs (CPU): within bf16 rounding of the fp32 reference, and as close as the
    per-token chunked path is."""
    weight, tokens, mix, labels, mask = _problem()
    ref = _loss_and_grads(weight, tokens, mix, labels, mask, fused=False)
    w16, m16 = weight.detach().bfloat16().requires_grad_(), mix.detach().bfloat16().requires_grad_()
    got = _loss_and_grads(w16, tokens, m16, labels, mask, fused=True, chunk_size=64, budget_bytes=VOCAB * 2 * 8)
    for g, r, name in zip(got, ref, ("loss", "weight grad", "upstream grad")):
        err = (g.float() - r).norm() / r.norm()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("budget", [2**30, VOCAB * 4 * 5])
def test_three_logits_gemms_per_chunk_not_four(budget):
    """Forward + backward of the loss alone: the per-token path runs 4 GEMMs per vocabulary chunk
    (logits, recomputed logits, two gradients), the masked sum 3, however many token blocks."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(33, HIDDEN, requires_grad=True), torch.randn(VOCAB, HIDDEN, requires_grad=True)
    labels, mask = torch.randint(0, VOCAB, (33,)), torch.ones(33)
    counts = []
    for fused in (False, True):
        with _CountMatmuls() as counter:
            if fused:
                total = linear_cross_entropy_sum(hidden, weight, labels, mask, "auto", chunk_size=100, budget_bytes=budget)
            else:
                total = (linear_cross_entropy(hidden, weight, labels, "auto", 100) * mask).sum()
            torch.autograd.grad(total, (hidden, weight))
        counts.append(counter.count)
    blocks = -(-33 // block_tokens_for(33, VOCAB, 4, budget))
    assert counts == [4 * 3, 3 * 3 * blocks]


def test_no_grad_and_frozen_weight():
    weight, tokens, mix, labels, mask = _problem()
    hidden = torch.tanh(F.embedding(tokens, weight.detach()) @ mix.detach())
    with torch.no_grad():
        plain = linear_cross_entropy_sum(hidden, weight, labels, mask, "auto", chunk_size=64)
    ref = (F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), labels.reshape(-1), reduction="none") * mask.reshape(-1)).sum()
    torch.testing.assert_close(plain, ref)
    leaf = hidden.detach().requires_grad_()
    (grad,) = torch.autograd.grad(linear_cross_entropy_sum(leaf, weight.detach(), labels, mask, "auto", chunk_size=64), leaf)
    (want,) = torch.autograd.grad(linear_cross_entropy_sum(leaf, weight.detach(), labels, mask, "off"), leaf)
    torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("preset, tied", [("tiny-llama", True), ("tiny-gpt", False)])
def test_decoder_fusion_equals_per_token_loss(preset, tied):
    """Through the contract's loss (the runner's path): the fused head's total and every parameter's
    gradient equal the per-token head's; without a loss mask the head stays per-token."""
    cfg = dataclasses.replace(build_config(overrides=["--model.preset", preset]).model, tie_embeddings=tied)
    tokens, labels = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    labels[0, :3] = -100
    batch = {"tokens": tokens, "labels": labels, "loss_mask": (torch.rand(2, 16) > 0.2).float()}
    results = []
    for fusion in (False, True):
        torch.manual_seed(0)
        model = build_model(dataclasses.replace(cfg, cross_entropy_loss_fusion=fusion), 96, 16)
        out, _ = model.run_stage(None, batch, list(model.layers), True, True)
        loss = model.loss(batch, out)
        (loss.total / loss.count).backward()
        results.append((loss.total.detach(), {n: p.grad for n, p in model.named_parameters()}))
        assert model(tokens, labels=labels).shape == (2, 16)
    torch.testing.assert_close(results[1][0], results[0][0])
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_flag_and_default():
    assert build_config().model.cross_entropy_loss_fusion
    assert not build_config(overrides=["--no-cross-entropy-loss-fusion"]).model.cross_entropy_loss_fusion
    assert build_config(overrides=["--cross-entropy-loss-fusion"]).model.cross_entropy_loss_fusion


@pytest.mark.parametrize("chunk, budget, real", [(0, 2**30, VOCAB), (64, 2**30, VOCAB - 20), (64, 5 * VOCAB * 4, VOCAB - 20)])
def test_bias_joins_the_logits_and_gets_its_gradient(chunk, budget, real):
    """A bias of the logits (BERT's LM head): loss and the gradients of the hidden states, the weight
    and the bias equal full logits + bias + ``F.cross_entropy`` (fp32), over vocabulary chunks and
    token blocks, with padded rows (``real``) that take no part and get a zero gradient."""
    torch.manual_seed(0)
    hidden, weight, bias = torch.randn(33, HIDDEN), torch.randn(VOCAB, HIDDEN) * 0.3, torch.randn(VOCAB)
    labels, mask = torch.randint(0, real, (33,)), torch.rand(33) * 2
    labels[:4] = -100
    results = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        if fused:
            total = linear_cross_entropy_sum(*leaves[:2], labels, mask, "auto", chunk, budget, real_rows=real, bias=leaves[2])
        else:
            logits = F.linear(leaves[0], leaves[1][:real], leaves[2][:real])
            total = (F.cross_entropy(logits, labels, reduction="none") * mask).sum()
        results.append((total, *torch.autograd.grad(total * 3.0, leaves)))
    for got, want, name in zip(*results, ("loss", "hidden grad", "weight grad", "bias grad")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    assert not results[0][3][real:].any()


def test_bert_head_fusion_equals_per_token_loss():
    """BERT's LM head (a bias, the labelled rows only) through the contract's loss: the fused
    masked sum's total and every gradient equal the per-token head's (fp32, 1e-5)."""
    tokens = torch.randint(0, 96, (2, 16))
    labels = torch.where(torch.rand(2, 16) < 0.3, tokens, -100)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": (labels >= 0).float(), "is_random": torch.tensor([0, 1])}
    results = []
    for fusion in (False, True):
        cfg = build_config(overrides=["--model-type", "bert", "--preset", "tiny-bert", "--num-layers", "2", "--hidden-size", "32",
                                      *([] if fusion else ["--no-cross-entropy-loss-fusion"])]).model  # fmt: skip
        torch.manual_seed(0)
        model = build_model(cfg, 96, 16)
        out, _ = model.run_stage(None, batch, list(model.layers), True, True)
        assert isinstance(out["lm"], SummedTokenLoss) == fusion
        loss = model.loss(batch, out)
        (loss.total / loss.count).backward()
        results.append((loss.total.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0])
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-5, atol=1e-7, msg=name)
