"""``model.qk_layernorm_span full`` (OLMoE's q and k RMSNorms over every head at once) and
``model.clip_qkv``: the full-width norm is a plain RMSNorm over the width in one process, the
attention norms the whole q and k projections, the parameter counts include the norms, and
validation names what to change. The tensor-parallel sum of squares is held to one process by
``tests/distributed/test_tensor_parallel.py`` (the ``llama_qk_full*`` cases)."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import ConfigError, ModelConfig, build_config
from meshtron.layers.attention import Attention
from meshtron.layers.norms import FullWidthRMSNorm, RMSNorm
from meshtron.models import build_model, parameter_count
from meshtron.parallel.sizes import rank_parameters
from meshtron.validation import validate

LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, normalization="RMSNorm",
             activation="swiglu", position_embedding_type="rope", add_bias_linear=False, qk_layernorm=True)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_width_norm_is_rmsnorm_over_the_width(dtype):
    """Output, input gradient and weight gradient of a plain RMSNorm over all 96 columns."""
    torch.manual_seed(0)
    full, plain = FullWidthRMSNorm(96, eps=1e-5).to(dtype), RMSNorm(96, eps=1e-5, fused_kernels="off").to(dtype)
    with torch.no_grad():
        full.weight.copy_(torch.randn(96))
        plain.weight.copy_(full.weight)
    x = (torch.randn(2, 5, 96) * 3).to(dtype)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [full(xs[0]), plain(xs[1])]
    assert outs[0].dtype == dtype
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=1e-6 if dtype == torch.float32 else 1e-2)
    grad = torch.randn_like(outs[0])
    for out in outs:
        out.backward(grad)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, **tol)
    torch.testing.assert_close(full.weight.grad, plain.weight.grad, **tol)


def test_full_span_norms_all_heads_of_q_and_of_k_together():
    """Scaling one query head's projection rows changes the other heads' normed q under span full
    (one norm over all heads), not under span head; q and k norms are [heads x d] and [kv x d]."""
    outputs = {}
    for span in ("head", "full"):
        torch.manual_seed(0)
        attention = Attention(ModelConfig(**{**LLAMA, "position_embedding_type": "learned_absolute"}, qk_layernorm_span=span), 0)
        assert attention.q_layernorm.weight.shape[0] == (64 if span == "full" else 16)
        assert attention.k_layernorm.weight.shape[0] == (32 if span == "full" else 16)
        captured = []
        attention.q_layernorm.register_forward_hook(lambda module, args, out: captured.append(out))
        x = torch.randn(1, 3, 64)
        attention(x, None, None)
        with torch.no_grad():
            attention.linear_qkv.weight[:16] *= 10  # query head 0 of group 0
        attention(x, None, None)
        before, after = (out.reshape(1, 3, 4, 16) for out in captured)
        outputs[span] = (after[:, :, 1:] - before[:, :, 1:]).abs().max().item()
    assert outputs["head"] < 1e-6 and outputs["full"] > 1e-2


def test_parameter_counts_include_the_full_width_norms():
    m = ModelConfig(**LLAMA, qk_layernorm_span="full")
    model = build_model(m, 256, 16)
    built = sum(p.numel() for p in model.parameters())
    assert parameter_count(m, 256) == built == rank_parameters(m, 256).total
    assert built - parameter_count(ModelConfig(**LLAMA), 256) == 2 * ((64 + 32) - 2 * 16)  # two layers' norms, wider by these
    # tp 4 with 2 kv heads: a rank holds one query head's q-norm columns and its kv head's k-norm columns (a replica)
    assert rank_parameters(m, 256, tp=4).total - rank_parameters(ModelConfig(**{**LLAMA, "qk_layernorm": False}), 256, tp=4).total == 2 * (16 + 16)


def test_clip_qkv_clamps_q_k_and_v():
    """With a clip far below the values, q, k and v are all clamped: the output changes with it."""
    torch.manual_seed(0)
    attention = Attention(ModelConfig(**{**LLAMA, "position_embedding_type": "learned_absolute"}, qk_layernorm_span="full", clip_qkv=0.1), 0)
    x = torch.randn(1, 3, 64)
    clipped = attention(x, None, None)
    attention.clip_qkv = 0.0
    assert (attention(x, None, None) - clipped).abs().max() > 1e-3


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--qk-layernorm-span", "full"], "model.qk_layernorm_span full sets how --qk-layernorm norms q and k; add --qk-layernorm"),
        (["--qk-layernorm", "--qk-layernorm-span", "all"], "model.qk_layernorm_span must be head .* or full .*, got 'all'"),
        (["--qk-layernorm", "--qk-layernorm-span", "full", "--normalization", "LayerNorm"],
         "norms q and k with RMSNorm .*; use --normalization RMSNorm"),
        (["--qk-layernorm", "--qk-layernorm-span", "full", "--multi-latent-attention"],
         "applies to standard attention; with --multi-latent-attention .* set model.qk_layernorm_span head"),
        (["--clip-qkv", "-1"], r"model.clip_qkv must be positive .* or 0 \(off\), got -1.0"),
        (["--clip-qkv", "8", "--multi-latent-attention"], "--multi-latent-attention has no such clamp: set it to 0"),
    ],
    ids=["full-without-qk-layernorm", "unknown-span", "full-layernorm", "full-mla", "negative-clip", "clip-mla"],
)  # fmt: skip
def test_validation_names_what_to_change(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(build_config(overrides=["--preset", "tiny-llama", *flags]), world_size=1)
