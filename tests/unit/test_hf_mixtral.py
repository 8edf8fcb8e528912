"""Mixtral import/export (``meshtron/models/hf_mixtral.py``) held to transformers' own
``MixtralForCausalLM`` on tiny random configs (no download), fp32 CPU, through the CLI: GQA
attention and every MLP a mixture of 4 experts with top-2 routing. Imported, the logits equal HF's
(so meshtron's top-k-then-softmax routing is HF's softmax-top-k-renormalize); exported back, the
files carry the Hub's names and transformers' logits from them equal the originals."""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from meshtron.checkpoint.checkpoint import CheckpointError  # noqa: E402
from meshtron.config import build_config  # noqa: E402
from meshtron.models import parameter_count  # noqa: E402
from meshtron.models.hf import import_hf  # noqa: E402
from meshtron.models.hf_decoder import hf_config_from_model  # noqa: E402
from tests.unit.test_hf_convert import (  # noqa: E402
    _check_fused_expert_import, _export_through_cli, _import_through_cli, _meshtron_logits, _random_init,
)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, router_aux_loss_coef=0.02)  # fmt: skip


def _hf_model(**overrides):
    cfg = transformers.MixtralConfig(**{**TINY, **overrides})
    cfg._attn_implementation = "eager"
    model = transformers.MixtralForCausalLM(cfg).eval()
    _random_init(model)
    return model


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "num_experts_per_tok": 3}], ids=["top2", "top3-tied"])
def test_import_export_match_transformers(tmp_path, overrides):
    tokens, expected, m = _import_through_cli(tmp_path, _hf_model(**overrides))
    k = overrides.get("num_experts_per_tok", 2)
    assert (m["num_experts"], m["moe_router_topk"], m["moe_ffn_hidden_size"], m["num_query_groups"]) == (4, k, 48, 2)
    assert m["moe_layer_freq"] == "1" and not m["moe_router_pre_softmax"] and m["moe_loss_weight"] == pytest.approx(0.02 * k)
    not_renormalized = _meshtron_logits(tmp_path / "ckpt", tokens, moe_router_pre_softmax=True)
    assert (not_renormalized - expected).abs().max() > 1e-2  # the routing weights matter at this scale

    written, config = _export_through_cli(tmp_path, transformers.MixtralForCausalLM, tokens, expected)
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in written
    assert config["router_aux_loss_coef"] == pytest.approx(0.02) and config["num_local_experts"] == 4


def test_fused_expert_tensors_import(tmp_path):
    """transformers 5's in-memory names (``mlp.gate``, ``mlp.experts.gate_up_proj`` / ``down_proj``)
    read as well as the Hub's ``block_sparse_moe.experts.{e}.w1/w2/w3``."""
    _check_fused_expert_import(tmp_path, _hf_model(), "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight")


def test_sliding_window_is_refused(tmp_path):
    _hf_model(sliding_window=16).save_pretrained(tmp_path / "hf")
    with pytest.raises(CheckpointError, match="sliding_window=16 is not supported"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt", dtype="fp32")


def test_export_refuses_what_mixtral_cannot_express():
    m = build_config(overrides=["--model.preset", "tiny-mixtral"]).model
    assert hf_config_from_model(m, 128, 256, torch.float32)["architectures"] == ["MixtralForCausalLM"]
    for field, value, what in [("moe_shared_expert_intermediate_size", 64, "Qwen2MoeForCausalLM cannot express routed experts without"),
                               ("moe_router_pre_softmax", True, "routing other than"),
                               ("moe_router_load_balancing_type", "sinkhorn", "sinkhorn routing"),
                               ("moe_layer_freq", "([0]+[1])", "dense layers")]:  # fmt: skip
        changed = build_config(overrides=["--model.preset", "tiny-mixtral", f"--model.{field}", str(value)]).model
        with pytest.raises(CheckpointError, match=what):
            hf_config_from_model(changed, 128, 256, torch.float32)


def test_mixtral_8x7b_preset_counts():
    """Published: 46.7B parameters, 12.9B active per token (two of eight experts)."""
    m = build_config(overrides=["--model.preset", "mixtral-8x7b"]).model
    assert parameter_count(m, m.vocab_size) == 46_702_792_704
    assert abs(parameter_count(m, m.vocab_size, active=True) / 12.9e9 - 1) < 0.005
    assert (m.rotary_base, m.num_query_groups, m.moe_ffn_hidden_size, m.norm_epsilon) == (1e6, 8, 14336, 1e-5)
