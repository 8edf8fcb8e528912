"""OLMoE import/export (``meshtron/models/hf_olmoe.py``) held to transformers' own
``OlmoeForCausalLM`` on tiny random configs (no download), fp32 CPU, through the CLI: GQA with q
and k RMSNorms over the whole projections (``model.qk_layernorm_span full``), 4 experts top-2
without and with ``norm_topk_prob``, and with ``clip_qkv``. Imported, the logits equal HF's;
exported back, transformers' logits from the files equal them. Also: the fused expert form, what
export refuses, and the ``olmoe-1b-7b`` preset's parameter counts."""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from meshtron.checkpoint.checkpoint import CheckpointError  # noqa: E402
from meshtron.config import build_config  # noqa: E402
from meshtron.models import parameter_count  # noqa: E402
from meshtron.models.hf_decoder import hf_config_from_model  # noqa: E402
from tests.unit.test_hf_convert import (  # noqa: E402
    _check_fused_expert_import, _export_through_cli, _import_through_cli, _meshtron_logits, _random_init,
)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-5,
            router_aux_loss_coef=0.01, eos_token_id=None)  # fmt: skip


def _hf_model(**overrides):
    cfg = transformers.OlmoeConfig(**{**TINY, **overrides})
    cfg._attn_implementation = "eager"
    model = transformers.OlmoeForCausalLM(cfg).eval()
    _random_init(model)
    return model


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": True}, {"clip_qkv": 0.5}], ids=["released", "renormalized", "clip-qkv"])
def test_olmoe_import_export_match_transformers(tmp_path, overrides):
    tokens, expected, m = _import_through_cli(tmp_path, _hf_model(**overrides))
    assert (m["qk_layernorm"], m["qk_layernorm_span"], m["clip_qkv"]) == (True, "full", overrides.get("clip_qkv", 0.0))
    assert (m["num_experts"], m["moe_router_topk"], m["moe_ffn_hidden_size"], m["num_query_groups"]) == (4, 2, 32, 2)
    assert m["moe_router_pre_softmax"] == (not overrides.get("norm_topk_prob", False)) and m["moe_loss_weight"] == pytest.approx(0.02)
    other_routing = _meshtron_logits(tmp_path / "ckpt", tokens, moe_router_pre_softmax=not m["moe_router_pre_softmax"])
    assert (other_routing - expected).abs().max() > 1e-2  # the routing weights matter at this scale
    if overrides.get("clip_qkv"):
        assert (_meshtron_logits(tmp_path / "ckpt", tokens, clip_qkv=0.0) - expected).abs().max() > 1e-2

    _, config = _export_through_cli(tmp_path, transformers.OlmoeForCausalLM, tokens, expected)
    assert config["model_type"] == "olmoe" and config["router_aux_loss_coef"] == pytest.approx(0.01)
    assert config["clip_qkv"] == overrides.get("clip_qkv") and config["norm_topk_prob"] == overrides.get("norm_topk_prob", False)


def test_fused_expert_tensors_import(tmp_path):
    """transformers 5's in-memory names (``mlp.experts.gate_up_proj`` / ``down_proj``) read as
    well as the Hub's ``mlp.experts.{e}.{gate,up,down}_proj``."""
    _check_fused_expert_import(tmp_path, _hf_model(), "model.layers.1.mlp.experts.gate_up_proj")


def _tiny_olmoe(*flags: str):
    return build_config(overrides=["--model.preset", "tiny-mixtral", "--qk-layernorm", "--qk-layernorm-span", "full", *flags]).model


def test_export_refuses_what_olmoe_cannot_express():
    assert hf_config_from_model(_tiny_olmoe(), 128, 256, torch.float32)["architectures"] == ["OlmoeForCausalLM"]
    for flags, what in [(["--moe-layer-freq", "([0]+[1])"], "OlmoeForCausalLM cannot express dense layers"),
                        (["--num-experts", "0"], "OlmoeForCausalLM cannot express dense layers"),
                        (["--model.moe_shared_expert_intermediate_size", "64"], "cannot express shared experts"),
                        (["--moe-router-score-function", "sigmoid"], "cannot express a sigmoid router"),
                        (["--kv-channels", "32"], "cannot express a head dim other than hidden / heads")]:  # fmt: skip
        with pytest.raises(CheckpointError, match=what):
            hf_config_from_model(_tiny_olmoe(*flags), 128, 256, torch.float32)
    mixtral_clipped = build_config(overrides=["--model.preset", "tiny-mixtral", "--clip-qkv", "8"]).model
    with pytest.raises(CheckpointError, match="model.clip_qkv is OLMoE's"):
        hf_config_from_model(mixtral_clipped, 128, 256, torch.float32)


def test_olmoe_1b_7b_preset_counts():
    """Published: 6.9B parameters, 1.3B active per token (8 of 64 experts)."""
    m = build_config(overrides=["--model.preset", "olmoe-1b-7b"]).model
    assert parameter_count(m, m.vocab_size) == 6_919_161_856
    assert parameter_count(m, m.vocab_size, active=True) == 1_282_017_280
    assert (m.qk_layernorm_span, m.moe_router_pre_softmax, m.num_query_groups, m.norm_epsilon) == ("full", True, 16, 1e-5)
