"""DeepSeek-V3 import/export (``meshtron/models/hf_deepseek_v3.py``) held to transformers' own
``DeepseekV3ForCausalLM`` on a tiny random model (no download), fp32, through the CLI: sigmoid
routing with a random expert bias over 4 groups of 2 experts (top-4 from the best 2 groups, a
group scored by its best two, as V3's 8 of 256 from 4 of 8 groups), a low-rank query, YaRN, a
dense first layer. Imported, the logits equal HF's; exported, transformers loads the folder and
its logits equal them again. A multi-token prediction depth (layer ``num_hidden_layers``, which
transformers neither builds nor saves) is added to the files by hand: imported into ``mtp.0``
and exported back tensor for tensor, copies of the embedding and output layer included. The
``deepseek-v3`` preset is held to the Hub's config.json of deepseek-ai/DeepSeek-V3."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from meshtron.checkpoint.checkpoint import CheckpointError, load_checkpoint, read_meta  # noqa: E402
from meshtron.cli import main as cli_main  # noqa: E402
from meshtron.config import Config, ModelConfig, build_config  # noqa: E402
from meshtron.models import build_model  # noqa: E402
from meshtron.models.hf import import_hf, model_config_from_hf  # noqa: E402
from meshtron.models.hf_decoder import decoder_hf_export, hf_config_from_model  # noqa: E402
from tests.unit.test_hf_convert import _hf_logits, _meshtron_logits, _random_init  # noqa: E402

LAYERS = 3
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
            n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})  # fmt: skip
# The Hub's config.json of deepseek-ai/DeepSeek-V3 (the keys that describe the model).
HUB_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def _hf_model():
    cfg = transformers.DeepseekV3Config(**TINY)
    cfg._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    _random_init(model)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # a bias as large as the scores' spread: it changes which experts are chosen
        for layer in model.model.layers[TINY["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(TINY["n_routed_experts"], generator=gen) * 0.3)
    return model


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(seed))  # past the original 16 positions


def _convert(*args: str) -> None:
    assert cli_main(["convert", *args, "--dtype", "fp32"]) == 0


def test_import_export_match_transformers(tmp_path):
    hf_model = _hf_model()
    hf_model.save_pretrained(tmp_path / "hf")
    tokens = _tokens()
    expected = _hf_logits(hf_model, tokens)

    _convert("hf-import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"))
    m = read_meta(tmp_path / "ckpt")["config"]["model"]
    assert (m["moe_router_score_function"], m["moe_router_enable_expert_bias"], m["moe_router_dtype"]) == ("sigmoid", True, "fp32")
    assert (m["moe_router_num_groups"], m["moe_router_group_topk"], m["moe_router_group_score"]) == (4, 2, "sum_topk")
    assert (m["moe_router_topk_scaling_factor"], m["moe_shared_expert_intermediate_size"], m["mtp_num_layers"]) == (2.5, 32, 0)
    torch.testing.assert_close(_meshtron_logits(tmp_path / "ckpt", tokens), expected, atol=1e-5, rtol=1e-5)
    without_bias = _unbiased_logits(tmp_path / "ckpt", tokens)
    assert (without_bias - expected).abs().max() > 1e-2  # the imported bias is what routes alike

    _convert("hf-export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "out"))
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "out" / "model.safetensors")).keys() == load_file(str(tmp_path / "hf" / "model.safetensors")).keys()
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (reloaded.config.n_group, reloaded.config.topk_group, reloaded.config.num_mtp_layers) == (4, 2, 0)
    reloaded.config._attn_implementation = "eager"
    torch.testing.assert_close(_hf_logits(reloaded, tokens), expected, atol=1e-5, rtol=1e-5)


def _unbiased_logits(save_dir, tokens) -> torch.Tensor:
    meta = read_meta(save_dir)
    cfg = Config.from_dict(meta["config"])
    model = build_model(cfg.model, meta["vocab_size"], cfg.data.seq_length).eval()
    load_checkpoint(save_dir, model, load_rng=False)
    for layer in model.layers[TINY["first_k_dense_replace"]:]:
        layer.mlp.router.expert_bias.zero_()
    with torch.no_grad():
        return model(tokens)


def _add_depth(hf_dir, copies_differ: bool = False) -> dict[str, torch.Tensor]:
    """Layer ``LAYERS`` written into the folder as DeepSeek's files hold a prediction depth: the last
    layer's tensors renamed and redrawn, ``enorm``/``hnorm``/``eh_proj``/``shared_head.norm``, and copies of
    the embedding and output layer. Returns the depth's tensors."""
    from safetensors.torch import load_file, save_file

    files = load_file(str(hf_dir / "model.safetensors"))
    gen, h, last = torch.Generator().manual_seed(9), TINY["hidden_size"], f"model.layers.{LAYERS - 1}."
    depth = {name.replace(last, f"model.layers.{LAYERS}."): torch.randn(t.shape, generator=gen) * 0.1 + (1.0 if t.dim() == 1 else 0.0)
             for name, t in files.items() if name.startswith(last)}  # fmt: skip
    prefix = f"model.layers.{LAYERS}."
    depth.update({prefix + name: 1.0 + 0.1 * torch.randn(h, generator=gen) for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    depth[prefix + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.1
    depth[prefix + "embed_tokens.weight"] = files["model.embed_tokens.weight"].clone()
    depth[prefix + "shared_head.head.weight"] = files["lm_head.weight"] + (1.0 if copies_differ else 0.0)
    save_file({**files, **depth}, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return depth


def test_prediction_depth_imported_and_exported(tmp_path):
    hf_model = _hf_model()
    hf_model.save_pretrained(tmp_path / "hf")
    depth = _add_depth(tmp_path / "hf")
    tokens = _tokens(2)

    import_hf(tmp_path / "hf", tmp_path / "ckpt", dtype="fp32")
    meta = read_meta(tmp_path / "ckpt")
    assert meta["config"]["model"]["mtp_num_layers"] == 1
    model = build_model(Config.from_dict(meta["config"]).model, meta["vocab_size"], 64)
    load_checkpoint(tmp_path / "ckpt", model, load_rng=False)
    prefix = f"model.layers.{LAYERS}."
    for ours, theirs in (("eh_proj", "eh_proj"), ("enorm", "enorm"), ("final_norm", "shared_head.norm"),
                         ("layer.pre_mlp_layernorm", "post_attention_layernorm"), ("layer.self_attention.linear_kv_up_proj", "self_attn.kv_b_proj"),
                         ("layer.mlp.router", "mlp.gate")):  # fmt: skip
        assert torch.equal(model.get_parameter(f"mtp.0.{ours}.weight"), depth[f"{prefix}{theirs}.weight"]), ours
    assert torch.equal(model.mtp[0].layer.mlp.router.expert_bias, depth[prefix + "mlp.gate.e_score_correction_bias"])
    with torch.no_grad():  # the main model is untouched by the depth
        torch.testing.assert_close(model.eval()(tokens), _hf_logits(hf_model, tokens), atol=1e-5, rtol=1e-5)

    _convert("hf-export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "out"))
    from safetensors.torch import load_file

    source, exported = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").eval()  # skips the depth's tensors
    reloaded.config._attn_implementation = "eager"
    torch.testing.assert_close(_hf_logits(reloaded, tokens), _hf_logits(hf_model, tokens), atol=1e-5, rtol=1e-5)


def test_a_depth_with_its_own_output_layer_is_refused(tmp_path):
    _hf_model().save_pretrained(tmp_path / "hf")
    _add_depth(tmp_path / "hf", copies_differ=True)
    with pytest.raises(CheckpointError, match="shared_head.head.weight differs from the main model's"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt", dtype="fp32")


def test_group_rule_other_than_the_best_two_is_refused(tmp_path):
    hf = {**transformers.DeepseekV3Config(**TINY).to_dict(), "num_experts_per_tok": 2}
    with pytest.raises(CheckpointError, match="best 2 / 2 experts, HF by its best 2"):
        model_config_from_hf(hf, "config.json", set())
    m = model_config_from_hf(transformers.DeepseekV3Config(**TINY).to_dict(), "config.json", set())
    m.moe_router_group_topk = 1  # top-4 from the best group: a group of 2 cannot be scored by its best 4
    with pytest.raises(CheckpointError, match="groups not scored by their best 2 experts"):
        hf_config_from_model(m, 128, 256, torch.float32)


@pytest.mark.parametrize("preset, architecture", [("tiny-deepseek", "DeepseekV2ForCausalLM"), ("tiny-llama", "LlamaForCausalLM")])
def test_architectures_without_prediction_depths_export_without_them(tmp_path, capsys, preset, architecture):
    """A softmax-routed latent-attention model is V2's, a Llama is Llama's: neither has depths, which
    inference never reads; the export leaves them out and says so."""
    cfg = build_config(overrides=["--model.preset", preset, "--mtp-num-layers", "1"])
    config, _ = decoder_hf_export({}, cfg, {"vocab_size": 128}, tmp_path, torch.float32, 256)
    assert config["architectures"] == [architecture] and "num_nextn_predict_layers" not in config
    assert f"hf-export: {architecture} has no multi-token prediction; its 1 depth(s) (--mtp-num-layers) are left out" in capsys.readouterr().out


def test_preset_is_the_hub_config():
    """Every number of the ``deepseek-v3`` preset that config.json states, read back through the
    importer (the training choices it does not state, the balancing loss's weight, are the paper's)."""
    names = {"model.layers.61.eh_proj.weight"}
    hub = model_config_from_hf(HUB_V3, "config.json", names)
    preset = build_config(overrides=["--model.preset", "deepseek-v3"]).model
    skipped = {"preset", "make_vocab_size_divisible_by", "moe_aux_loss_coeff"}  # import-only and training choices
    differ = {f.name: (getattr(preset, f.name), getattr(hub, f.name)) for f in ModelConfig.__dataclass_fields__.values()
              if f.name not in skipped and getattr(preset, f.name) != getattr(hub, f.name)}  # fmt: skip
    assert differ == {}, differ
    assert (preset.moe_aux_loss_coeff, preset.moe_router_load_balancing_type) == (1e-4, "seq_aux_loss")
