"""Kernel selection and the chunked output layer + loss, on the CPU without Triton."""

import dataclasses

import pytest
import torch

from meshtron import kernels
from meshtron.config import ConfigError, build_config
from meshtron.validation import validate
from meshtron.kernels.cross_entropy import default_chunk_size, linear_cross_entropy
from meshtron.models import build_model


def test_use_triton_modes(monkeypatch):
    cpu = torch.zeros(1)
    assert not kernels.use_triton("off", cpu)
    assert not kernels.use_triton("auto", cpu)  # never on a CPU tensor unless asked
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="pip install triton"):
        kernels.use_triton("on", cpu)
    with pytest.raises(ValueError, match="fused_kernels"):
        kernels.use_triton("yes", cpu)


def test_fused_kernel_and_recompute_flags():
    m = build_config(overrides=["--no-fused-kernels", "--recompute-granularity", "full", "--recompute-method", "block",
                                "--recompute-num-layers", "2", "--attention-backend", "cudnn"]).model  # fmt: skip
    assert (m.fused_kernels, m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("off", "full", "block", 2)
    assert m.attention_backend == "cudnn"
    assert build_config().model.fused_kernels == "auto"
    for bad in (["--recompute-granularity", "some"], ["--recompute-method", "x"], ["--attention-backend", "fast"],
                ["--recompute-num-layers", "0"], ["--model.fused-kernels", "maybe"]):  # fmt: skip
        with pytest.raises(ConfigError):
            validate(build_config(overrides=bad))


def test_chunk_size_bounds():
    assert default_chunk_size(16384, 128256) == 16384
    assert default_chunk_size(10, 1000) == 1000
    assert default_chunk_size(2**31, 128256) == 256


@pytest.mark.parametrize("chunk", [0, 7, 64, 300])
def test_chunked_loss_and_grads_equal_unfused(chunk):
    """Loss and both gradients of the chunked path equal full logits + F.cross_entropy (fp32),
    under a non-uniform upstream gradient (a masked, weighted per-token loss) and ignored labels."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 24, requires_grad=True)
    weight = (torch.randn(300, 24) * 0.3).requires_grad_()
    labels = torch.randint(0, 300, (3, 11))
    labels[1, 4:7] = -100
    upstream = torch.rand(3, 11)
    results = []
    for mode in ("off", "auto"):
        loss = linear_cross_entropy(hidden, weight, labels, mode, chunk)
        results.append((loss, *torch.autograd.grad((loss * upstream).sum(), (hidden, weight))))
    for fused, ref in zip(results[1], results[0]):
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-6)
    assert (results[1][0][1, 4:7] == 0).all()


def test_chunked_loss_frozen_weight():
    hidden = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(40, 8)
    labels = torch.randint(0, 40, (5,))
    (grad,) = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, "auto", 16).sum(), hidden)
    (ref,) = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, "off").sum(), hidden)
    torch.testing.assert_close(grad, ref)


@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-llama"])
def test_model_fused_default_equals_reference_path(preset):
    """On the CPU ``auto`` changes only the loss (chunked); the model's numbers stay those of ``off``."""
    cfg = build_config(overrides=["--model.preset", preset]).model
    tokens = torch.randint(0, 96, (2, 16))
    labels = torch.randint(0, 96, (2, 16))
    grads = []
    for mode in ("off", "auto"):
        torch.manual_seed(0)
        model = build_model(dataclasses.replace(cfg, fused_kernels=mode), 96, 16)
        loss = model(tokens, labels=labels)
        loss.mean().backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=1e-5, atol=1e-7, msg=name)
