"""Norms, RoPE, MLP and attention, each held to a direct transcription of its formula."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import ModelConfig
from meshtron.layers.attention import Attention, attention_mask
from meshtron.layers.kv_cache import KVCache
from meshtron.layers.mlp import MLP, ffn_hidden_size
from meshtron.layers.norms import RMSNorm, build_norm
from meshtron.layers.rope import apply_rotary, rope_frequencies

LLAMA = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, normalization="RMSNorm",
    activation="swiglu", position_embedding_type="rope", add_bias_linear=False, tie_embeddings=False,
)  # fmt: skip
GPT = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4)


def _randomize(module: torch.nn.Module) -> None:
    """Random non-zero values everywhere (biases too), so no term can hide behind a zero."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)


# --- norms -----------------------------------------------------------------------------------


def test_rmsnorm_matches_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-2)
    norm.weight.data.normal_()
    x = torch.randn(3, 5, 16) * 0.1  # small enough that eps matters
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_norms_compute_in_fp32_and_return_input_dtype():
    x = torch.full((2, 8), 300.0, dtype=torch.float16)  # x^2 overflows fp16
    x[:, ::2] = -300.0
    for kind in ("RMSNorm", "LayerNorm"):
        out = build_norm(kind, 8, 1e-5).to(torch.float16)(x)
        assert out.dtype == torch.float16
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.abs().float(), torch.ones(2, 8), atol=1e-3, rtol=0)


def test_build_norm_kinds():
    assert isinstance(build_norm("LayerNorm", 8, 1e-5), torch.nn.LayerNorm)
    assert isinstance(build_norm("RMSNorm", 8, 1e-5), RMSNorm)
    with pytest.raises(ValueError, match="RMSNorm"):
        build_norm("BatchNorm", 8, 1e-5)


# --- rope ------------------------------------------------------------------------------------


def _meta_apply_scaling(freqs, scale_factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's llama3 reference ``apply_scaling``, transcribed line by line."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            assert low_freq_wavelen != high_freq_wavelen
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return torch.tensor(new_freqs, dtype=freqs.dtype, device=freqs.device)


def _meta_angles(dim, end, theta, scaling):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    if scaling:
        freqs = _meta_apply_scaling(freqs, *scaling)
    return torch.outer(torch.arange(end, dtype=torch.float32), freqs).float()


@pytest.mark.parametrize("scaling", [None, (8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (4.0, 2.0, 8.0, 1024)])
def test_rope_tables_match_meta_reference(scaling):
    dim, end, theta = 128, 300, 500000.0
    kwargs = dict(zip(("factor", "low_freq_factor", "high_freq_factor", "original_max_positions"), scaling or ()))
    cos, sin = rope_frequencies(dim, end, theta, "llama3" if scaling else "", **kwargs)
    angles = _meta_angles(dim, end, theta, scaling)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (end, dim)
    for half in (slice(0, dim // 2), slice(dim // 2, dim)):  # rotate-half: both halves share angles
        torch.testing.assert_close(cos[:, half], angles.cos(), rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[:, half], angles.sin(), rtol=0, atol=1e-6)


def test_llama3_scaling_slows_only_long_wavelengths():
    plain, _ = rope_frequencies(128, 2, 500000.0)
    scaled, _ = rope_frequencies(128, 2, 500000.0, "llama3", factor=8.0)
    inv_plain, inv_scaled = plain[1, :64].acos(), scaled[1, :64].acos()  # position 1: cos(freq)
    assert torch.equal(inv_plain[:10], inv_scaled[:10])  # high frequencies untouched
    torch.testing.assert_close(inv_scaled[-10:], inv_plain[-10:] / 8)  # low ones divided by the factor
    with pytest.raises(ValueError, match="llama3"):
        rope_frequencies(128, 2, scaling="dynamic")


def test_apply_rotary_is_complex_rotation_of_half_pairs():
    torch.manual_seed(0)
    b, s, h, d = 2, 7, 3, 8
    x = torch.randn(b, s, h, d)
    cos, sin = rope_frequencies(d, 16, 10000.0)
    out = apply_rotary(x, cos, sin)
    angles = torch.atan2(sin[:s, : d // 2], cos[:s, : d // 2])[None, :, None]
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * torch.polar(torch.ones_like(angles), angles)
    torch.testing.assert_close(out, torch.cat((z.real, z.imag), dim=-1))


def test_apply_rotary_position_ids_shift():
    torch.manual_seed(0)
    b, s, h, d, shift = 2, 5, 2, 16, 9
    q, k = torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    cos, sin = rope_frequencies(d, 64, 10000.0)
    positions = torch.arange(shift, shift + s).expand(b, s)
    shifted = apply_rotary(q, cos, sin, positions)
    torch.testing.assert_close(shifted, apply_rotary(q, cos[shift:], sin[shift:]))
    assert not torch.allclose(shifted, apply_rotary(q, cos, sin))
    # Attention scores depend only on relative position: shifting both q and k changes nothing.
    scores = torch.einsum("bshd,bthd->bhst", apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))
    scores_shifted = torch.einsum("bshd,bthd->bhst", shifted, apply_rotary(k, cos, sin, positions))
    torch.testing.assert_close(scores, scores_shifted, rtol=1e-4, atol=1e-4)


def test_apply_rotary_keeps_dtype():
    cos, sin = rope_frequencies(8, 4, 10000.0)
    assert apply_rotary(torch.randn(1, 4, 1, 8, dtype=torch.bfloat16), cos, sin).dtype == torch.bfloat16


# --- mlp -------------------------------------------------------------------------------------


def test_ffn_hidden_size_defaults():
    assert ffn_hidden_size(ModelConfig(hidden_size=768)) == 3072
    assert ffn_hidden_size(ModelConfig(hidden_size=4096, activation="swiglu")) == 11008  # Llama 2 7B
    assert ffn_hidden_size(ModelConfig(hidden_size=64, activation="swiglu")) == 256
    assert ffn_hidden_size(ModelConfig(hidden_size=64, activation="swiglu", ffn_hidden_size=100)) == 100


def test_swiglu_mlp_matches_formula():
    torch.manual_seed(0)
    mlp = MLP(dataclasses.replace(LLAMA, ffn_hidden_size=48))
    _randomize(mlp)
    x = torch.randn(2, 3, 64)
    gate_w, up_w = mlp.linear_fc1.weight[:48], mlp.linear_fc1.weight[48:]
    expected = (F.silu(x @ gate_w.T) * (x @ up_w.T)) @ mlp.linear_fc2.weight.T
    torch.testing.assert_close(mlp(x), expected)
    assert mlp.linear_fc1.bias is None


def test_gelu_mlp_uses_exact_gelu():
    torch.manual_seed(0)
    mlp = MLP(GPT)
    _randomize(mlp)
    x = torch.randn(2, 3, 64) * 3
    hidden = x @ mlp.linear_fc1.weight.T + mlp.linear_fc1.bias
    expected = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2))) @ mlp.linear_fc2.weight.T + mlp.linear_fc2.bias
    torch.testing.assert_close(mlp(x), expected)


# --- attention -------------------------------------------------------------------------------


def _attention(cfg, seed=0):
    torch.manual_seed(seed)
    attn = Attention(cfg, layer_number=0)
    _randomize(attn)
    return attn


def test_attention_mask_offset_and_documents():
    mask = attention_mask(2, 5)
    assert mask.tolist() == [[[[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]]]
    docs = torch.tensor([[0, 0, 1, 1]])
    assert attention_mask(4, 4, docs)[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("with_documents", [False, True])
def test_math_backend_matches_sdpa(cfg, with_documents):
    attn = _attention(cfg)
    math_attn = _attention(dataclasses.replace(cfg, attention_backend="math"))
    math_attn.load_state_dict(attn.state_dict())
    x = torch.randn(2, 12, 64)
    cos, sin = rope_frequencies(16, 12, 10000.0)
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12]) if with_documents else None
    torch.testing.assert_close(math_attn(x, cos, sin, document_ids=docs), attn(x, cos, sin, document_ids=docs), rtol=1e-5, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa = _attention(LLAMA)  # 4 query heads in 2 groups
    mha = Attention(dataclasses.replace(LLAMA, num_query_groups=0), layer_number=0)
    d = 16
    w = gqa.linear_qkv.weight.view(2, 4, d, 64)  # [group, (q, q, k, v), d, hidden]
    rows = [torch.stack((w[g, i], w[g, 2], w[g, 3])) for g in range(2) for i in range(2)]  # [q_i, k_g, v_g] per head
    with torch.no_grad():
        mha.linear_qkv.weight.copy_(torch.stack(rows).reshape(-1, 64))
        mha.linear_proj.weight.copy_(gqa.linear_proj.weight)
    x = torch.randn(2, 9, 64)
    cos, sin = rope_frequencies(d, 9, 10000.0)
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin))


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_kv_cache_chunks_equal_full_sequence(backend):
    attn = _attention(dataclasses.replace(LLAMA, attention_backend=backend))
    x = torch.randn(2, 10, 64)
    cos, sin = rope_frequencies(16, 10, 10000.0)
    full = attn(x, cos, sin)
    cache = KVCache(1, 2, 10, 2, 16)
    outs = []
    for start, end in [(0, 4), (4, 5), (5, 6), (6, 10)]:
        positions = torch.arange(start, end).expand(2, -1)
        outs.append(attn(x[:, start:end], cos, sin, positions, kv_cache=cache))
        cache.advance(end - start)
    torch.testing.assert_close(torch.cat(outs, dim=1), full)
    with pytest.raises(ValueError, match="holds 10"):
        cache.update(0, torch.zeros(2, 1, 2, 16), torch.zeros(2, 1, 2, 16))


def test_attention_runs_on_whole_groups_of_its_projections():
    """What tensor parallelism will do: each rank keeps whole key/value groups of ``linear_qkv``
    and the matching input columns of ``linear_proj``; the partial outputs sum to the full one."""
    attn = _attention(LLAMA)  # 2 groups of (2 query heads + k + v), head dim 16
    x = torch.randn(2, 6, 64)
    cos, sin = rope_frequencies(16, 6, 10000.0)
    rows, cols = 4 * 16, 2 * 16
    partial = []
    for g in range(2):
        shard = Attention(LLAMA, layer_number=0)
        shard.linear_qkv = torch.nn.Linear(64, rows, bias=False)
        shard.linear_proj = torch.nn.Linear(cols, 64, bias=False)
        with torch.no_grad():
            shard.linear_qkv.weight.copy_(attn.linear_qkv.weight[g * rows : (g + 1) * rows])
            shard.linear_proj.weight.copy_(attn.linear_proj.weight[:, g * cols : (g + 1) * cols])
        partial.append(shard(x, cos, sin))
    torch.testing.assert_close(partial[0] + partial[1], attn(x, cos, sin))


@pytest.mark.parametrize("weighted", [False, True])
def test_output_layer_with_bias_computes_only_labelled_rows_exactly(weighted):
    """BERT's LM head (a bias: the full-logits path) takes the logits of the labelled rows only;
    loss and gradients equal the cross-entropy of the whole logits, with nothing labelled too."""
    from meshtron.layers.output import OutputLayer

    g = torch.Generator().manual_seed(0)
    layer = OutputLayer(16, 40, tied=False, bias=True)
    with torch.no_grad():
        layer.weight.normal_(generator=g)
        layer.bias.normal_(generator=g)
    for labelled in (0.3, 0.0):
        hidden = torch.randn(3, 7, 16, generator=g, requires_grad=True)
        labels = torch.randint(0, 40, (3, 7), generator=g).masked_fill(torch.rand(3, 7, generator=g) >= labelled, -100)
        weights = torch.rand(3, 7, generator=g) if weighted else None
        got = layer(hidden, labels, loss_weights=weights)
        got_grads = torch.autograd.grad(got.sum(), [hidden, layer.weight, layer.bias])
        logits = torch.nn.functional.linear(hidden, layer.weight, layer.bias)
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.reshape(-1), reduction="none").view(3, 7)
        want = want if weights is None else (want * weights).sum()
        want_grads = torch.autograd.grad(want.sum(), [hidden, layer.weight, layer.bias])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
