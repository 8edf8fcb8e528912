"""Multi-head latent attention and YaRN (``meshtron/layers/mla.py``, ``rope.py``), held to
transformers' own DeepseekV2 code on tiny random configs in fp32: weights copied across by the
name table of mla.py, outputs and gradients compared; the latent cache against a full forward."""

import dataclasses
import os

import pytest
import torch

from meshtron.config import ModelConfig, parse_overrides
from meshtron.kernels import triton_available
from meshtron.layers import mla
from meshtron.layers.kv_cache import LatentKVCache
from meshtron.layers.mla import MultiLatentAttention, mla_config_errors, rope_table_dim, softmax_scale
from meshtron.layers.rope import rope_tables

if triton_available() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # fused_kernels "on" runs the interpreter on the CPU
pytest.importorskip("transformers", minversion="5.0")  # DeepseekV2 with ``rope_parameters``
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf  # noqa: E402
from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config  # noqa: E402

# HF name -> meshtron name, as the table in mla.py's docstring.
HF_TO_MESHTRON = {
    "q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm",
    "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj", "kv_a_layernorm": "kv_layernorm",
    "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj",
}  # fmt: skip
# DeepSeek-V2's rope_scaling; and one whose cos/sin multiplier is not 1, one with HF's default temperature.
YARN_CASES = [
    dict(factor=40.0, original=4096, beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
    dict(factor=40.0, original=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8),
    dict(factor=8.0, original=1024, beta_fast=16.0, beta_slow=2.0, mscale=1.0, mscale_all_dim=0.0),
]
TINY = dict(hidden=64, heads=4, kv_lora_rank=16, nope=8, rope=8, v=12)  # qk head 16 != v head 12


def _configs(q_lora_rank: int, yarn: dict, backend: str = "math") -> tuple[ModelConfig, DeepseekV2Config]:
    t = TINY
    ours = ModelConfig(
        num_layers=1, hidden_size=t["hidden"], num_attention_heads=t["heads"], normalization="RMSNorm", norm_epsilon=1e-6,
        position_embedding_type="rope", add_bias_linear=False, attention_backend=backend, multi_latent_attention=True,
        q_lora_rank=q_lora_rank, kv_lora_rank=t["kv_lora_rank"], qk_head_dim=t["nope"], qk_pos_emb_head_dim=t["rope"],
        v_head_dim=t["v"], qk_layernorm=True, rope_scaling="yarn", rope_scaling_factor=yarn["factor"],
        rope_original_max_position_embeddings=yarn["original"], rope_beta_fast=yarn["beta_fast"],
        rope_beta_slow=yarn["beta_slow"], rope_mscale=yarn["mscale"], rope_mscale_all_dim=yarn["mscale_all_dim"],
    )  # fmt: skip
    theirs = DeepseekV2Config(
        hidden_size=t["hidden"], num_attention_heads=t["heads"], num_key_value_heads=t["heads"],
        q_lora_rank=q_lora_rank or None, kv_lora_rank=t["kv_lora_rank"], qk_nope_head_dim=t["nope"],
        qk_rope_head_dim=t["rope"], v_head_dim=t["v"], max_position_embeddings=int(yarn["factor"] * yarn["original"]), num_hidden_layers=1,
        vocab_size=32, intermediate_size=32, moe_intermediate_size=16, rope_parameters=_hf_rope(yarn),
    )  # fmt: skip
    theirs._attn_implementation = "eager"
    return ours, theirs


def _hf_rope(yarn: dict) -> dict:
    keys = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    return {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": yarn["original"], **{k: yarn[k] for k in keys}}


def _pair(q_lora_rank: int, yarn: dict, backend: str = "math"):
    """(ours, HF's) attention with the same random weights (norm weights too, so none hides)."""
    ours_cfg, hf_cfg = _configs(q_lora_rank, yarn, backend)
    torch.manual_seed(0)
    theirs = hf.DeepseekV2Attention(hf_cfg, 0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    ours = MultiLatentAttention(ours_cfg, 0)
    ours.load_state_dict({_meshtron_name(k): v for k, v in theirs.state_dict().items()})
    return ours, theirs, ours_cfg, hf_cfg


def _meshtron_name(hf_name: str) -> str:
    module, _, param = hf_name.partition(".")
    return f"{HF_TO_MESHTRON[module]}.{param}"


def _tables(cfg: ModelConfig, positions: int = 64):
    return rope_tables(cfg, rope_table_dim(cfg), positions)


# --- YaRN ------------------------------------------------------------------------------------


@pytest.mark.parametrize("yarn", YARN_CASES)
def test_yarn_tables_and_scale_match_transformers(yarn):
    """cos/sin (frequencies and their multiplier) as DeepseekV2RotaryEmbedding gives them, on
    DeepSeek's 64 rope dims, and the softmax scale as DeepseekV2Attention sets it."""
    ours_cfg, hf_cfg = _configs(0, yarn)
    ours_cfg = dataclasses.replace(ours_cfg, qk_pos_emb_head_dim=64)
    hf_cfg = DeepseekV2Config(**{**hf_cfg.to_dict(), "qk_rope_head_dim": 64, "rope_parameters": _hf_rope(yarn)})
    rotary = hf.DeepseekV2RotaryEmbedding(hf_cfg)
    inv_freq, factor = hf.ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    plain = 1 / (10000.0 ** (torch.arange(0, 64, 2) / 64))
    assert 0 < int((inv_freq < 0.99 * plain).sum()) < 32  # some dims interpolated, some kept: the ramp is inside
    positions = torch.arange(0, 6000, 7)
    cos, sin = _tables(ours_cfg, 6000)
    freqs = rotary(torch.zeros(1), positions[None])[0]  # complex [positions, 32], times the multiplier
    for half in (slice(0, 32), slice(32, 64)):
        torch.testing.assert_close(cos[positions][:, half], freqs.real, rtol=0, atol=2e-5)
        torch.testing.assert_close(sin[positions][:, half], freqs.imag, rtol=0, atol=2e-5)
    # Position 1 isolates the frequencies (the angle is inv_freq), position 0 the multiplier.
    torch.testing.assert_close(torch.atan2(sin[1, :32], cos[1, :32]), inv_freq, rtol=1e-6, atol=0)
    assert cos[0, 0].item() == pytest.approx(rotary.attention_scaling, rel=1e-7)
    assert softmax_scale(ours_cfg) == pytest.approx(hf.DeepseekV2Attention(hf_cfg, 0).scaling, rel=1e-12)
    if yarn["mscale_all_dim"]:
        assert softmax_scale(ours_cfg) > (8 + 64) ** -0.5  # the temperature is there


# --- MLA against DeepseekV2Attention ------------------------------------------------------------


def _hf_forward(theirs, hf_cfg, x, position_ids, additive_mask):
    freqs = hf.DeepseekV2RotaryEmbedding(hf_cfg)(x, position_ids)
    return theirs(x, attention_mask=additive_mask, position_embeddings=freqs)[0]


def _causal(b: int, s: int) -> torch.Tensor:
    return torch.full((s, s), float("-inf")).triu(1).expand(b, 1, s, s)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("yarn", YARN_CASES[:2])
@pytest.mark.parametrize("q_lora_rank", [0, 24], ids=["lite", "q_lora"])
def test_mla_matches_transformers(q_lora_rank, yarn, backend):
    ours, theirs, cfg, hf_cfg = _pair(q_lora_rank, yarn, backend)
    torch.manual_seed(1)
    x = torch.randn(2, 11, TINY["hidden"])
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    cos, sin = _tables(cfg)
    out = ours(x_ours, cos, sin)
    ref = _hf_forward(theirs, hf_cfg, x_hf, torch.arange(11).expand(2, 11), _causal(2, 11))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=1e-5, atol=1e-5)
    ours_params = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        mine = ours_params[_meshtron_name(name)].grad
        assert mine is not None and mine.abs().sum() > 0, name
        torch.testing.assert_close(mine, p.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("positions", ["none", "given"])
@pytest.mark.parametrize("q_lora_rank", [0, 24], ids=["lite", "q_lora"])
def test_fused_query_key_kernels_equal_the_reference_path(q_lora_rank, positions, monkeypatch):
    """The Triton kernels that rotate q, assemble k and write d(q), d(kv), d(k_rope) in one pass
    each (``kernels/triton_mla.py``; Triton's interpreter here, fp32): outputs and every gradient
    equal the reference path's (rope dims 8, v dim 12: masked blocks)."""
    if not triton_available():
        pytest.skip("needs Triton (its interpreter on the CPU)")
    calls = []
    kernel_path = mla._rotated_query_key
    monkeypatch.setattr(mla, "_rotated_query_key", lambda *a: calls.append(1) or kernel_path(*a))
    ours, _, cfg, _ = _pair(q_lora_rank, YARN_CASES[1], "sdpa")
    fused = MultiLatentAttention(dataclasses.replace(cfg, fused_kernels="on"), 0)
    fused.load_state_dict(ours.state_dict())
    torch.manual_seed(1)
    x = torch.randn(2, 11, TINY["hidden"])
    position_ids = None if positions == "none" else torch.tensor([list(range(3, 14)), [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]])
    cos, sin = _tables(cfg)
    results = []
    for module in (ours, fused):
        xi = x.clone().requires_grad_()
        out = module(xi, cos, sin, position_ids)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
        results.append((out, xi.grad, {n: p.grad for n, p in module.named_parameters()}))
    assert calls == [1]  # the reference module took its own path, the fused one the kernels
    (ref, ref_dx, ref_grads), (got, dx, grads) = results
    pairs = {"output": (got, ref), "input grad": (dx, ref_dx), **{name: (grads[name], g) for name, g in ref_grads.items()}}
    for name, (a, b) in pairs.items():  # normwise: fp32 sums in another order differ in the last bits
        assert ((a - b).norm() / b.norm()).item() < 1e-6, name


def test_packed_documents_attend_only_inside_their_document():
    ours, theirs, cfg, hf_cfg = _pair(0, YARN_CASES[0])
    torch.manual_seed(2)
    x = torch.randn(1, 10, TINY["hidden"])
    document_ids = torch.tensor([[0] * 4 + [1] * 6])
    position_ids = torch.tensor([list(range(4)) + list(range(6))])
    cos, sin = _tables(cfg)
    out = ours(x, cos, sin, position_ids, document_ids)
    separate = torch.cat([ours(x[:, :4], cos, sin), ours(x[:, 4:], cos, sin)], dim=1)
    torch.testing.assert_close(out, separate, rtol=1e-5, atol=1e-6)
    block = torch.full((10, 10), float("-inf"))
    block[:4, :4], block[4:, 4:] = _causal(1, 4)[0, 0], _causal(1, 6)[0, 0]
    torch.testing.assert_close(out, _hf_forward(theirs, hf_cfg, x, position_ids, block[None, None]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[:, 4:], ours(x, cos, sin, position_ids)[:, 4:], atol=1e-3)  # the mask matters


# --- latent cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "up_projected"])
@pytest.mark.parametrize("q_lora_rank", [0, 24], ids=["lite", "q_lora"])
def test_latent_cache_decoding_equals_full_forward(q_lora_rank, absorb):
    """A prefill of 5, a chunk of 2, then one token at a time: each step's outputs are the full
    forward's rows at those positions (one-token steps through the absorbed path or not)."""
    ours, _, cfg, _ = _pair(q_lora_rank, YARN_CASES[1])
    ours.absorb_decode = absorb
    torch.manual_seed(3)
    x = torch.randn(2, 10, TINY["hidden"])
    cos, sin = _tables(cfg)
    full = ours(x, cos, sin)
    cache = LatentKVCache(3, 2, 10, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim)
    ours.layer_number = 1  # any slot of the cache
    for start, end in [(0, 5), (5, 7), (7, 8), (8, 9), (9, 10)]:
        positions = torch.arange(start, end).expand(2, -1)
        step = ours(x[:, start:end], cos, sin, positions, kv_cache=cache)
        cache.advance(end - start)
        torch.testing.assert_close(step, full[:, start:end], rtol=1e-5, atol=1e-5)
    # Per token and layer the cache holds the latent and the one rope key: 16 + 8 numbers.
    assert cache.rows[1].shape == (2, 10, TINY["kv_lora_rank"] + TINY["rope"])
    assert cache.rows[0].abs().sum() == 0 and cache.rows[1].abs().sum() > 0
    with pytest.raises(ValueError, match="holds 10 positions"):
        ours(x[:, :1], cos, sin, torch.full((2, 1), 10), kv_cache=cache)


def test_deepseek_v2_lite_cache_is_576_per_token_and_layer():
    cfg = ModelConfig(multi_latent_attention=True)  # the defaults are DeepSeek-V2's dims
    cache = LatentKVCache(2, 1, 3, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim)
    assert sum(rows.numel() for rows in cache.rows) == 2 * 3 * 576


# --- config and flags --------------------------------------------------------------------------


def test_config_errors_name_the_flag():
    good, _ = _configs(0, YARN_CASES[0])
    assert mla_config_errors(good) == []
    assert mla_config_errors(ModelConfig()) == []
    cases = {
        "--kv-lora-rank": dict(kv_lora_rank=0),
        "--qk-pos-emb-head-dim": dict(qk_pos_emb_head_dim=7),
        "--position-embedding-type": dict(position_embedding_type="learned_absolute"),
        "--num-query-groups": dict(num_query_groups=2),
        "--yarn-beta-fast": dict(rope_beta_fast=0.5),
        "--rotary-scaling-factor": dict(rope_scaling_factor=0.0),
    }
    for flag, change in cases.items():
        errors = mla_config_errors(dataclasses.replace(good, **change))
        assert len(errors) == 1 and flag in errors[0], (flag, errors)
    assert mla_config_errors(ModelConfig(qk_layernorm=True)) == []  # standard attention norms each head's q and k


def test_megatron_and_pai_flags():
    megatron = parse_overrides(
        "--multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 "
        "--qk-layernorm --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707 --q-lora-rank 1536 "
        "--yarn-beta-fast 32 --yarn-beta-slow 1 --yarn-original-max-position-embeddings 4096".split()
    )
    assert megatron == {
        "model.multi_latent_attention": True, "model.kv_lora_rank": "512", "model.qk_head_dim": "128",
        "model.qk_pos_emb_head_dim": "64", "model.v_head_dim": "128", "model.qk_layernorm": True,
        "model.rope_scaling_factor": "40", "model.rope_mscale": "0.707", "model.rope_mscale_all_dim": "0.707",
        "model.q_lora_rank": "1536", "model.rope_beta_fast": "32", "model.rope_beta_slow": "1",
        "model.rope_original_max_position_embeddings": "4096",
    }  # fmt: skip
    pai = parse_overrides("--qk-nope-head-dim 128 --qk-rope-head-dim 64".split())
    assert pai == {"model.qk_head_dim": "128", "model.qk_pos_emb_head_dim": "64"}
