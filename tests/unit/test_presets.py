"""Presets: shapes that reproduce the published models' parameter counts, and the example configs."""

import dataclasses
from pathlib import Path

import pytest
import torch

from meshtron.config import ConfigError, build_config
from meshtron.validation import validate
from meshtron.models import build_model, num_parameters, parameter_count
from meshtron.presets import PRESETS, preset_fields

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# Published parameter counts (Hugging Face checkpoints, unpadded vocabularies).
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "gpt2-355m": 354_823_168,
    "gpt2-774m": 774_030_080,
    "gpt2-1.5b": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "mixtral-8x7b": 46_702_792_704,
}


def preset_config(name: str):
    return build_config(overrides=["--model.preset", name])


@pytest.mark.parametrize("name, approx", [("llama2-7b", 6.74e9), ("llama3-8b", 8.03e9), ("gpt2-124m", 124.4e6)])
def test_headline_parameter_counts(name, approx):
    cfg = preset_config(name)
    assert abs(parameter_count(cfg.model, cfg.model.vocab_size, cfg.data.seq_length) / approx - 1) < 0.005


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_reproduce_published_counts(name):
    cfg = preset_config(name)
    assert parameter_count(cfg.model, cfg.model.vocab_size, cfg.data.seq_length) == PUBLISHED[name]


@pytest.mark.parametrize(
    "name, fields",
    [
        ("tiny-gpt", {}),
        ("tiny-llama", {}),
        ("tiny-gpt", {"tie_embeddings": False, "num_query_groups": 2, "kv_channels": 8}),
        ("tiny-llama", {"add_bias_linear": True, "tie_embeddings": True, "ffn_hidden_size": 96}),
        ("tiny-llama", {"add_qkv_bias": True}),
    ],
)
def test_parameter_count_matches_built_model(name, fields):
    cfg = preset_config(name)
    model_cfg = dataclasses.replace(cfg.model, **fields)
    model = build_model(model_cfg, 200, cfg.data.seq_length)
    assert num_parameters(model) == parameter_count(model_cfg, 200, cfg.data.seq_length)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates(name):
    cfg = preset_config(name)
    m = cfg.model
    assert m.preset == name
    assert (m.rope_scaling == "llama3") == name.startswith(("llama3.1", "llama3.2"))
    if name.startswith("llama3.2"):
        assert m.rope_scaling_factor == 32.0 and m.tie_embeddings


def test_llama_family_fields():
    m = preset_config("llama2-70b").model
    assert (m.num_query_groups, m.ffn_hidden_size, m.vocab_size, m.rotary_base) == (8, 28672, 32000, 10000.0)
    assert (m.normalization, m.activation, m.add_bias_linear, m.tie_embeddings) == ("RMSNorm", "swiglu", False, False)
    cfg = preset_config("llama3.1-8b")
    assert cfg.data.seq_length == 8192 and cfg.model.rotary_base == 500000.0
    assert (cfg.model.rope_low_freq_factor, cfg.model.rope_high_freq_factor) == (1.0, 4.0)
    assert cfg.model.rope_original_max_position_embeddings == 8192


def test_command_line_wins_over_preset():
    cfg = build_config(overrides=["--model.preset", "llama3-8b", "--num-layers", "2", "--seq-length", "128"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.data.seq_length) == (2, 4096, 128)


def test_unknown_preset_suggests_close_match():
    with pytest.raises(ConfigError, match="did you mean 'llama3-8b'"):
        preset_fields("llama3-8")
    with pytest.raises(ConfigError, match="unknown model preset"):
        build_config(overrides=["--model.preset", "gpt5"])


def test_preset_fields_is_a_copy():
    preset_fields("tiny-gpt")["model.num_layers"] = 99
    assert PRESETS["tiny-gpt"]["model.num_layers"] == 2


def test_a_shorter_deepseek_keeps_its_leading_dense_layers(tmp_path):
    """``--num-layers`` on a DeepSeek preset re-draws its MoE pattern (first layers dense, the rest MoE);
    a pattern the user gives is theirs, and a count that leaves no MoE layer is refused, naming what to change."""
    short = build_config(overrides=["--model.preset", "deepseek-v2-lite", "--num-layers", "4"])
    assert short.model.moe_layer_freq == "([0]*1+[1]*3)"
    validate(short, world_size=1)
    v3 = build_config(overrides=["--model.preset", "deepseek-v3", "--model.num_layers", "5"])
    assert v3.model.moe_layer_freq == "([0]*3+[1]*2)"
    (tmp_path / "c.toml").write_text('[model]\npreset = "deepseek-v2-lite"\nnum-layers = 3\n')
    assert build_config(str(tmp_path / "c.toml")).model.moe_layer_freq == "([0]*1+[1]*2)"
    own = build_config(overrides=["--model.preset", "deepseek-v2-lite", "--num-layers", "4", "--moe-layer-freq", "1"])
    assert own.model.moe_layer_freq == "1"
    with pytest.raises(ConfigError, match="--num-layers 2 leaves no MoE layer after preset deepseek-v3's 3 dense layers"):
        build_config(overrides=["--model.preset", "deepseek-v3", "--num-layers", "2"])


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_example_configs_validate(path):
    cfg = build_config(str(path))
    world_size = 1 if cfg.model.preset.startswith("tiny") else 8
    validate(cfg, world_size=world_size)
    assert cfg.model.preset == path.stem


def test_tiny_llama_config_builds_and_runs():
    cfg = build_config(str(CONFIGS / "tiny-llama.toml"))
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, 256, cfg.data.seq_length)
    tokens = torch.randint(0, 256, (2, cfg.data.seq_length))
    assert torch.isfinite(model(tokens, labels=tokens)).all()
