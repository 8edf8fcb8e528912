"""Qwen3 and Qwen3-MoE import/export (``meshtron/models/hf_qwen.py``) held to transformers' own
``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` on tiny random configs (no download), fp32 CPU,
through the CLI: GQA with per-head q and k norms (``--qk-layernorm``) and a head_dim of its own,
and for the MoE, dense and MoE layers mixed, 4 experts top-2 with and without ``norm_topk_prob``.
Imported, the logits equal HF's; exported back, transformers' logits from the files equal them."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from meshtron.checkpoint.checkpoint import read_meta  # noqa: E402
from meshtron.cli import main as cli_main  # noqa: E402
from tests.unit.test_hf_convert import _hf_logits, _meshtron_logits, _random_init  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6)  # fmt: skip
MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.001)


def _hf_model(moe: bool, **overrides):
    cls, config = (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig) if moe else (transformers.Qwen3ForCausalLM, transformers.Qwen3Config)
    cfg = config(**{**TINY, **(MOE if moe else {}), **overrides})
    cfg.head_dim = TINY["head_dim"]  # Qwen3-MoE's config takes it as an attribute
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    _random_init(model)
    return model


def _round_trip(tmp_path, hf_model, cls) -> dict:
    hf_model.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    expected = _hf_logits(hf_model, tokens)
    assert cli_main(["convert", "hf-import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"), "--dtype", "fp32"]) == 0
    m = read_meta(tmp_path / "ckpt")["config"]["model"]
    assert m["qk_layernorm"] and m["kv_channels"] == 24
    torch.testing.assert_close(_meshtron_logits(tmp_path / "ckpt", tokens), expected, atol=1e-5, rtol=1e-5)
    assert cli_main(["convert", "hf-export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "out" / "model.safetensors")).keys() == load_file(str(tmp_path / "hf" / "model.safetensors")).keys()
    reloaded = cls.from_pretrained(tmp_path / "out").eval()
    reloaded.config._attn_implementation = "eager"
    torch.testing.assert_close(_hf_logits(reloaded, tokens), expected, atol=1e-5, rtol=1e-5)
    return m


def test_qwen3_import_export_match_transformers(tmp_path):
    m = _round_trip(tmp_path, _hf_model(moe=False), transformers.Qwen3ForCausalLM)
    assert m["num_experts"] == 0 and not m["add_qkv_bias"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3"


@pytest.mark.parametrize(
    "overrides, layer_freq",
    [({"mlp_only_layers": [0]}, "[0,1,1]"), ({"decoder_sparse_step": 2, "norm_topk_prob": True}, "[0,1,0]")],
    ids=["dense-first", "every-second-renormalized"],
)
def test_qwen3_moe_import_export_match_transformers(tmp_path, overrides, layer_freq):
    m = _round_trip(tmp_path, _hf_model(moe=True, **overrides), transformers.Qwen3MoeForCausalLM)
    assert (m["moe_layer_freq"], m["moe_shared_expert_intermediate_size"], m["num_experts"]) == (layer_freq, 0, 4)
    assert m["moe_router_pre_softmax"] == (not overrides.get("norm_topk_prob", False))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["router_aux_loss_coef"] == pytest.approx(0.001)
