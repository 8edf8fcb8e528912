"""DeepSeek-V2 import/export (``meshtron/models/hf_deepseek.py``) held to transformers' own
``DeepseekV2ForCausalLM`` on tiny random configs (no download), fp32, through the CLI: V2-Lite's
shape (full query projection) and V2's (low-rank query with its norm), both with YaRN, a dense
first layer and MoE layers with shared experts. Imported, the logits equal HF's; exported back,
transformers loads the folder and its logits equal them again."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from meshtron.checkpoint.checkpoint import CheckpointError, read_meta  # noqa: E402
from meshtron.cli import main as cli_main  # noqa: E402
from meshtron.models.hf import import_hf  # noqa: E402
from tests.unit.test_hf_convert import _check_fused_expert_import, _hf_logits, _meshtron_logits, _random_init  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
            max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})  # fmt: skip


def _hf_model(q_lora_rank: int | None, **overrides):
    cfg = transformers.DeepseekV2Config(**{**TINY, "q_lora_rank": q_lora_rank, **overrides})
    cfg._attn_implementation = "eager"
    model = transformers.DeepseekV2ForCausalLM(cfg).eval()
    _random_init(model)
    return model


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["lite", "full"])
def test_import_export_match_transformers(tmp_path, q_lora_rank, capsys):
    hf_model = _hf_model(q_lora_rank)
    hf_model.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))  # past the original 16 positions
    expected = _hf_logits(hf_model, tokens)

    assert cli_main(["convert", "hf-import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"), "--dtype", "fp32"]) == 0
    m = read_meta(tmp_path / "ckpt")["config"]["model"]
    assert (m["multi_latent_attention"], m["q_lora_rank"], m["num_experts"], m["moe_layer_freq"]) == (True, q_lora_rank or 0, 4, "([0]*1+[1]*2)")
    assert m["moe_shared_expert_intermediate_size"] == 64 and m["rope_scaling"] == "yarn" and m["moe_router_pre_softmax"]
    torch.testing.assert_close(_meshtron_logits(tmp_path / "ckpt", tokens), expected, atol=1e-5, rtol=1e-5)

    assert cli_main(["convert", "hf-export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "out" / "model.safetensors")).keys() == load_file(str(tmp_path / "hf" / "model.safetensors")).keys()
    reloaded = transformers.DeepseekV2ForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.q_lora_rank == q_lora_rank and reloaded.config.rope_parameters["rope_type"] == "yarn"
    reloaded.config._attn_implementation = "eager"
    torch.testing.assert_close(_hf_logits(reloaded, tokens), expected, atol=1e-5, rtol=1e-5)


def test_fused_expert_tensors_import(tmp_path):
    """transformers 5's in-memory form (``experts.gate_up_proj`` / ``down_proj``, stacked) reads
    as well as the per-expert files the Hub holds."""
    _check_fused_expert_import(tmp_path, _hf_model(None), "model.layers.1.mlp.experts.gate_up_proj")


def test_group_limited_greedy_routing_matches_transformers(tmp_path):
    """Full V2's ``group_limited_greedy``: 8 experts in 2 groups, each token's top-2 from the group
    whose best expert scores highest. Imported as ``moe_router_group_score = "max"``, logits equal
    transformers'; scoring groups Megatron's way (sum of the best 2) changes them, so the rule
    matters here; exported, the config names the rule again and transformers' logits are equal."""
    hf_model = _hf_model(None, n_routed_experts=8, topk_method="group_limited_greedy", n_group=2, topk_group=1)
    hf_model.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    expected = _hf_logits(hf_model, tokens)
    import_hf(tmp_path / "hf", tmp_path / "ckpt", dtype="fp32")
    m = read_meta(tmp_path / "ckpt")["config"]["model"]
    assert (m["moe_router_num_groups"], m["moe_router_group_topk"], m["moe_router_group_score"]) == (2, 1, "max")
    torch.testing.assert_close(_meshtron_logits(tmp_path / "ckpt", tokens), expected, atol=1e-5, rtol=1e-5)
    sum_of_best_two = _meshtron_logits(tmp_path / "ckpt", tokens, moe_router_group_score="sum_topk")
    assert (sum_of_best_two - expected).abs().max() > 1e-2

    assert cli_main(["convert", "hf-export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["topk_method"], config["n_group"], config["topk_group"]) == ("group_limited_greedy", 2, 1)
    reloaded = transformers.DeepseekV2ForCausalLM.from_pretrained(tmp_path / "out").eval()
    reloaded.config._attn_implementation = "eager"
    torch.testing.assert_close(_hf_logits(reloaded, tokens), expected, atol=1e-5, rtol=1e-5)


def test_export_refuses_group_scores_deepseek_v2_cannot_express():
    """Megatron's rule (sum of the best k / group_topk) is HF's only when that is one expert."""
    from meshtron.config import ModelConfig
    from meshtron.models.hf_decoder import hf_config_from_model

    m = ModelConfig(**{"multi_latent_attention": True, "qk_layernorm": True, "normalization": "RMSNorm", "activation": "swiglu",
                       "add_bias_linear": False, "num_experts": 8, "moe_router_topk": 4, "moe_router_num_groups": 4,
                       "moe_router_group_topk": 2})  # fmt: skip
    with pytest.raises(CheckpointError, match="moe_router_group_score max"):
        hf_config_from_model(m, 128, 256, torch.float32)
    m.moe_router_group_topk = 4  # best 4 / 4 = 1 expert per group: the sum is the max
    assert hf_config_from_model(m, 128, 256, torch.float32)["topk_method"] == "group_limited_greedy"
    m.moe_router_group_score = "max"
    m.moe_router_group_topk = 2
    assert hf_config_from_model(m, 128, 256, torch.float32)["n_group"] == 4


def test_unknown_topk_method_is_refused(tmp_path):
    hf_model = _hf_model(None)
    hf_model.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "topk_method": "noaux_tc"}))
    with pytest.raises(CheckpointError, match="topk_method='noaux_tc' is not supported"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt", dtype="fp32")


def test_group_limited_greedy_keeping_every_group_is_plain_top_k():
    from meshtron.models.hf import model_config_from_hf

    every = transformers.DeepseekV2Config(**{**TINY, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 2})
    m = model_config_from_hf(every.to_dict())
    assert (m.moe_router_num_groups, m.moe_router_group_topk) == (0, 0)
    limited = transformers.DeepseekV2Config(**{**TINY, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1})
    assert model_config_from_hf(limited.to_dict()).moe_router_group_score == "max"
