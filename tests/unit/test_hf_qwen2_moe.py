"""Qwen2-MoE import/export (``meshtron/models/hf_qwen.py``) held to transformers' own
``Qwen2MoeForCausalLM`` on tiny random configs (no download), fp32 CPU, through the CLI: GQA with
q/k/v biases, dense and MoE layers mixed (``mlp_only_layers``, ``decoder_sparse_step``), 4 experts
top-2 with and without ``norm_topk_prob``, and the sigmoid-gated shared expert. Imported, the
logits equal HF's; exported back, transformers' logits from the files equal them again."""

from __future__ import annotations


import pytest

transformers = pytest.importorskip("transformers", minversion="5.0")

from meshtron.checkpoint.checkpoint import CheckpointError  # noqa: E402
from meshtron.models.hf import import_hf  # noqa: E402
from tests.unit.test_hf_convert import (  # noqa: E402
    _check_fused_expert_import, _export_through_cli, _import_through_cli, _meshtron_logits, _random_init,
)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256, rms_norm_eps=1e-6, router_aux_loss_coef=0.001)  # fmt: skip


def _hf_model(**overrides):
    cfg = transformers.Qwen2MoeConfig(**{**TINY, **overrides})
    cfg._attn_implementation = "eager"
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    _random_init(model)
    return model


@pytest.mark.parametrize(
    "overrides, layer_freq",
    [({"mlp_only_layers": [0]}, "[0,1,1]"), ({"decoder_sparse_step": 2, "norm_topk_prob": True}, "[0,1,0]")],
    ids=["dense-first", "every-second-renormalized"],
)
def test_import_export_match_transformers(tmp_path, overrides, layer_freq):
    tokens, expected, m = _import_through_cli(tmp_path, _hf_model(**overrides))
    assert (m["moe_layer_freq"], m["add_qkv_bias"], m["moe_shared_expert_intermediate_size"], m["moe_shared_expert_gate"]) == (
        layer_freq, True, 48, True)  # fmt: skip
    assert m["moe_router_pre_softmax"] == (not overrides.get("norm_topk_prob", False))
    other_routing = _meshtron_logits(tmp_path / "ckpt", tokens, moe_router_pre_softmax=not m["moe_router_pre_softmax"])
    assert (other_routing - expected).abs().max() > 1e-2  # renormalizing or not shows in the logits

    _, config = _export_through_cli(tmp_path, transformers.Qwen2MoeForCausalLM, tokens, expected)
    assert config["router_aux_loss_coef"] == pytest.approx(0.001)


def test_fused_expert_tensors_import(tmp_path):
    """transformers 5's in-memory ``mlp.experts.gate_up_proj`` / ``down_proj`` read too."""
    _check_fused_expert_import(tmp_path, _hf_model(), "model.layers.0.mlp.experts.gate_up_proj")


def test_sliding_window_is_refused(tmp_path):
    _hf_model(use_sliding_window=True, sliding_window=16).save_pretrained(tmp_path / "hf")
    with pytest.raises(CheckpointError, match="use_sliding_window=True is not supported"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt", dtype="fp32")
