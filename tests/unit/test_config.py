"""Config: file + overrides, Megatron aliases, and early errors that say what to change."""

import pytest

from meshtron.config import ConfigError, build_config, parse_overrides
from meshtron.validation import validate


def test_megatron_aliases_map_to_fields():
    cfg = build_config(None, [
        "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "64", "--num-layers", "3",
        "--hidden-size", "96", "--num-attention-heads", "6", "--lr", "1e-4", "--min-lr", "1e-5",
        "--lr-warmup-iters", "5", "--train-iters", "50", "--split", "90,9,1", "--bf16", "--clip-grad", "0.5",
        "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--mock-data",
        "--tensor-model-parallel-size", "1",
    ])
    validate(cfg)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.data.seq_length) == (2, 8, 64)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads) == (3, 96, 6)
    assert cfg.train.lr == 1e-4 and cfg.train.min_lr == 1e-5 and cfg.train.lr_warmup_iters == 5
    assert cfg.train.precision == "bf16" and cfg.train.clip_grad == 0.5 and cfg.data.split == "90,9,1"
    assert cfg.model.activation == "swiglu" and not cfg.model.add_bias_linear and not cfg.model.tie_embeddings
    assert cfg.data.mock


def test_dotted_short_and_equals_forms():
    parsed = parse_overrides(["--model.hidden_size", "64", "--num-layers=2", "--mock", "--no-tie-embeddings"])
    assert parsed == {"model.hidden_size": "64", "model.num_layers": "2", "data.mock": True, "model.tie_embeddings": False}


def test_blended_data_path_takes_several_values():
    parsed = parse_overrides(["--data-path", "0.3", "a", "0.7", "b", "--lr", "1"])
    assert parsed["data.data_path"] == ["0.3", "a", "0.7", "b"] and parsed["train.lr"] == "1"


def test_unknown_flag_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean '--micro-batch-size'"):
        build_config(None, ["--micro-bach-size", "4"])


def test_heads_must_divide_hidden():
    with pytest.raises(ConfigError, match="does not divide --hidden-size 100"):
        validate(build_config(None, ["--hidden-size", "100", "--num-attention-heads", "3", "--mock-data"]))


def test_global_batch_must_be_multiple_of_micro_times_dp():
    cfg = build_config(None, ["--micro-batch-size", "4", "--global-batch-size", "8", "--mock-data"])
    with pytest.raises(ConfigError, match=r"--global-batch-size 8 is not a multiple of --micro-batch-size 4 x data-parallel size 4"):
        validate(cfg, world_size=4)


def test_world_size_must_divide_by_model_parallel():
    cfg = build_config(None, ["--tp", "2", "--pp", "2", "--mock-data"])
    with pytest.raises(ConfigError, match="world size 6 is not a multiple of tp 2 x pp 2"):
        validate(cfg, world_size=6)


def test_missing_data_path_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"missing_text_document\.bin' not found"):
        validate(build_config(None, ["--data-path", str(tmp_path / "missing_text_document"), "--tokenizer-type", "ByteTokenizer"]))


def test_bad_value_type_is_named():
    with pytest.raises(ConfigError, match="model.num_layers must be int"):
        build_config(None, ["--num-layers", "four"])


def test_toml_and_yaml_files_with_overrides(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nnum_layers = 3\nhidden_size = 96\nnum_attention_heads = 3\n[train]\nlr = 0.01\n[data]\nmock = true\n')
    cfg = build_config(str(toml), ["--lr", "0.02"])
    assert cfg.model.num_layers == 3 and cfg.train.lr == 0.02
    yaml = tmp_path / "run.yaml"
    yaml.write_text("model:\n  num_layers: 5\ndata:\n  mock: true\n")
    assert build_config(str(yaml), []).model.num_layers == 5
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nnum_layer = 3\n")
    with pytest.raises(ConfigError, match="did you mean 'num_layers'"):
        build_config(str(bad), [])


def test_preset_fills_defaults_and_explicit_flags_win():
    cfg = build_config(None, ["--preset", "llama3-8b", "--num-layers", "2", "--mock-data"])
    assert cfg.model.hidden_size == 4096 and cfg.model.num_query_groups == 8 and cfg.model.num_layers == 2
    with pytest.raises(ConfigError, match="llama3-8b"):
        build_config(None, ["--preset", "llama3-8"])


def test_layout_errors_come_before_any_process_group(monkeypatch):
    """tp must divide the heads: refused from the environment's world size alone (no MASTER_ADDR set)."""
    from meshtron.training.trainer import Trainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    cfg = build_config(None, ["--mock-data", "--tp", "2", "--num-attention-heads", "3", "--hidden-size", "96", "--global-batch-size", "16"])
    with pytest.raises(ConfigError, match="--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"):
        Trainer(cfg, log=lambda _: None)


@pytest.mark.parametrize("flags,message", [
    (["--optimizer-impl", "apex"], "--optimizer-impl must be one of auto, fused, reference"),
    (["--optimizer-impl", "fused", "--device", "cpu"], "--optimizer-impl fused needs a GPU"),
    (["--optimizer-impl", "fused", "--use-torch-fsdp2"], "--optimizer-impl fused needs meshtron's flat gradient buffer"),
])  # fmt: skip
def test_optimizer_impl_is_checked(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(build_config(None, flags + ["--mock-data"]), world_size=2)


def test_tp_comm_overlap_is_a_real_switch():
    """Megatron's --tp-comm-overlap sets the field (no longer a noted flag) and is refused where
    there is nothing to overlap: no sequence parallelism, tp 1, FP8 linears, an unknown backend."""
    base = ["--mock-data", "--tp", "2", "--global-batch-size", "16"]
    cfg = build_config(None, base + ["--sequence-parallel", "--tp-comm-overlap"])
    validate(cfg, world_size=2)
    assert cfg.parallel.tp_comm_overlap and cfg.parallel.tp_comm_overlap_backend == "p2p"
    assert not cfg.logging.noted_flags
    # Transformer Engine's userbuffers knobs are accepted and noted (the start-up log says what meshtron does)
    cfg = build_config(None, base + ["--sequence-parallel", "--tp-comm-overlap", "--tp-comm-overlap-cfg", "ub.yaml",
                                     "--disable-tp-comm-bulk-wgrad"])  # fmt: skip
    assert cfg.parallel.tp_comm_overlap and len(cfg.logging.noted_flags) == 2
    for flags, message in [
        (base + ["--tp-comm-overlap"], "--tp-comm-overlap .* needs --tensor-model-parallel-size > 1 and --sequence-parallel"),
        (["--mock-data", "--sequence-parallel", "--tp-comm-overlap"], "needs --tensor-model-parallel-size > 1"),
        (base + ["--sequence-parallel", "--tp-comm-overlap", "--fp8-format", "hybrid"], "does not cover FP8 linears"),
        (base + ["--sequence-parallel", "--tp-comm-overlap-backend", "ub"], "--tp-comm-overlap-backend must be p2p, bulk or symm_mem"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(build_config(None, flags), world_size=2)


def test_a_megatron_qwen3_moe_script_builds_the_preset_model():
    """Qwen3-30B-A3B's flags as a Megatron-Core training script passes them (per-head q/k norms,
    --rotary-percent 1.0, the MoE performance switches) give the qwen3-30b-a3b preset's model."""
    from meshtron.estimate import model_parameters

    script = ("--disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 32 --num-query-groups 4 "
              "--kv-channels 128 --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --normalization RMSNorm "
              "--position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 1.0 --swiglu --untie-embeddings-and-output-weights "
              "--vocab-size 151936 --rotary-base 1000000 --moe-ffn-hidden-size 768 --moe-router-score-function softmax "
              "--moe-token-dispatcher-type alltoall --moe-router-topk 8 --moe-layer-freq ([1]*48) --num-experts 128 --moe-grouped-gemm "
              "--moe-token-drop-policy probs --moe-router-dtype fp32 --moe-permute-fusion --moe-aux-loss-coeff 0 --mock-data "
              "--micro-batch-size 1 --global-batch-size 8").split()
    cfg = build_config(None, script)
    validate(cfg, world_size=8)
    assert model_parameters(cfg) == model_parameters(build_config(None, ["--preset", "qwen3-30b-a3b"]))
    with pytest.raises(ConfigError, match="partial rotary embeddings are not implemented"):
        validate(build_config(None, ["--preset", "tiny-llama", "--mock-data", "--rotary-percent", "0.5"]))


@pytest.mark.parametrize("positions", ["learned_absolute", "rope"])
def test_sequence_longer_than_the_position_tables_is_refused_up_front(positions):
    cfg = build_config(None, ["--mock-data", "--position-embedding-type", positions, "--max-position-embeddings", "64", "--seq-length", "128"])
    with pytest.raises(ConfigError, match="--seq-length 128 exceeds --max-position-embeddings 64"):
        validate(cfg)


def test_overlap_param_gather_is_a_real_switch():
    """Megatron's --overlap-param-gather sets the field (no longer a noted flag) and is refused
    without the distributed optimizer whose gather it overlaps: under FSDP2 (which gathers per
    layer in forward itself) and with --compile (its pre-hooks would be traced)."""
    base = ["--mock-data", "--global-batch-size", "16"]
    cfg = build_config(None, base + ["--use-distributed-optimizer", "--overlap-param-gather"])
    validate(cfg, world_size=2)
    assert cfg.parallel.overlap_param_gather and not cfg.logging.noted_flags
    for flags, message in [
        (["--overlap-param-gather"], "--overlap-param-gather .* add --use-distributed-optimizer"),
        (["--overlap-param-gather", "--use-torch-fsdp2"], "FSDP2 gathers each layer's parameters in its forward already"),
        (["--overlap-param-gather", "--use-distributed-optimizer", "--compile"], "--compile would trace"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(build_config(None, base + flags), world_size=2)
