"""MoE config: --moe-layer-freq parsing (never evaluated), value checks, Megatron and MegaBlocks flags."""

import builtins
import re

import pytest

from meshtron.config import ModelConfig, build_config
from meshtron.layers.moe import moe_config_errors, moe_layer_pattern
from meshtron.layers.moe.layer_pattern import parse_layer_freq


@pytest.mark.parametrize(
    "text, layers, expected",
    [
        ("1", 3, [1, 1, 1]),
        ("2", 5, [1, 0, 1, 0, 1]),
        ("([0]+[1]*3)", 4, [0, 1, 1, 1]),
        ("[1,0,1]", 3, [1, 0, 1]),
        (" [1, 0] * 2 + 2*[0] ", 6, [1, 0, 1, 0, 0, 0]),
        ("([1]*2+[0])*2", 6, [1, 1, 0, 1, 1, 0]),
    ],
)
def test_layer_freq_forms(text, layers, expected):
    assert parse_layer_freq(text, layers) == [bool(v) for v in expected]


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('touch /tmp/pwned')",
        "[1]*10**9",
        "[1]*1000000000",
        "[1,0,2]",
        "[1,0",
        "[1,0,1]]",
        "0",
        "[]",
        "[1]*-1",
    ],
)
def test_bad_or_malicious_layer_freq_is_refused_without_eval(text, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the layer pattern must never be evaluated as Python")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    with pytest.raises(ValueError, match="moe-layer-freq"):
        parse_layer_freq(text, 3)


def test_layer_pattern_of_a_config():
    assert moe_layer_pattern(ModelConfig(num_layers=3)) == [False] * 3
    assert moe_layer_pattern(ModelConfig(num_layers=3, num_experts=4, moe_layer_freq="[0,1,1]")) == [False, True, True]
    errors = moe_config_errors(ModelConfig(num_layers=3, num_experts=4, add_bias_linear=False, moe_layer_freq="[0,1]"))
    assert errors == ["--moe-layer-freq [0,1] names 2 layers but --num-layers is 3"]


def _errors(**fields) -> str:
    return "\n".join(moe_config_errors(ModelConfig(num_experts=8, add_bias_linear=False, **fields)))


def test_config_checks_name_the_flag():
    assert moe_config_errors(ModelConfig()) == []
    assert _errors() == ""
    assert "--disable-bias-linear" in "\n".join(moe_config_errors(ModelConfig(num_experts=8)))
    assert "--moe-router-topk 9" in _errors(moe_router_topk=9)
    assert "--moe-router-pre-softmax" in _errors(moe_router_topk=1)
    assert _errors(moe_router_topk=1, moe_router_pre_softmax=True) == ""
    assert "--moe-router-enable-expert-bias" in _errors(moe_router_enable_expert_bias=True)
    assert "--moe-router-num-groups 3" in _errors(moe_router_num_groups=3, moe_router_group_topk=1)
    assert "--moe-router-group-topk 3" in _errors(moe_router_num_groups=4, moe_router_group_topk=3)
    assert _errors(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2) == ""
    # A group scored by its best expert: more groups than k may be kept (6 of 8 groups of 1 for the top-2).
    assert _errors(moe_router_topk=2, moe_router_num_groups=8, moe_router_group_topk=6, moe_router_group_score="max") == ""
    assert "--moe-router-topk 2" in _errors(moe_router_topk=2, moe_router_num_groups=8, moe_router_group_topk=6)
    assert "moe_router_group_score" in _errors(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                                               moe_router_group_score="mean")  # fmt: skip
    assert "--moe-pad-expert-input-to-capacity" in _errors(moe_pad_expert_input_to_capacity=True)
    assert "--moe-token-drop-policy" in _errors(moe_token_drop_policy="random")
    assert "--moe-loss-weight" in _errors(moe_aux_loss_coeff=0.01, moe_loss_weight=0.1)
    assert "--moe-shared-expert-gate" in _errors(moe_shared_expert_gate=True)
    assert "moe_grouped_gemm" in _errors(moe_grouped_gemm="cutlass")
    assert "--moe-router-dtype" in _errors(moe_router_dtype="bf16")


def test_sinkhorn_is_accepted_and_refuses_what_it_would_ignore():
    assert _errors(moe_router_load_balancing_type="sinkhorn") == ""
    assert _errors(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1) == ""  # a sigmoid: the gate has a gradient
    assert _errors(moe_router_load_balancing_type="sinkhorn", moe_z_loss_coeff=1e-3, moe_expert_capacity_factor=1.25) == ""
    # Above k 1 sinkhorn weighs by the softmax over all experts, which is what --moe-router-pre-softmax says (OLMoE's presets set it).
    assert _errors(moe_router_load_balancing_type="sinkhorn", moe_router_pre_softmax=True) == ""
    assert "aux_loss, seq_aux_loss, sinkhorn or none" in _errors(moe_router_load_balancing_type="balanced")
    refused = [
        (dict(moe_aux_loss_coeff=1e-2), "takes no auxiliary loss (as in Megatron-Core); set --moe-aux-loss-coeff 0"),
        (dict(moe_loss_weight=0.1), "set --moe-loss-weight 0"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=2), "drop group-limited routing (--moe-router-num-groups"),
        (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True), "drop --moe-router-enable-expert-bias"),
        (dict(moe_router_score_function="sigmoid"), "ignores the score function (its weights are sigmoid with --moe-router-topk 1"),
        (dict(moe_router_pre_softmax=True, moe_router_topk=1), "weighs by a sigmoid, not --moe-router-pre-softmax's softmax"),
        (dict(moe_router_topk_scaling_factor=2.5), "does not scale its weights (as in Megatron-Core); drop --moe-router-topk-scaling-factor"),
    ]
    for fields, message in refused:
        errors = _errors(moe_router_load_balancing_type="sinkhorn", **fields)
        assert "--moe-router-load-balancing-type sinkhorn" in errors and message in errors, (fields, errors)
        assert message not in _errors(**fields), f"{fields} alone is fine without sinkhorn"


def test_sinkhorn_from_megatron_flags():
    from meshtron.errors import ConfigError
    from meshtron.validation import validate

    flags = ["--preset", "tiny-mixtral", "--mock-data", "--moe-router-load-balancing-type", "sinkhorn"]
    with pytest.raises(ConfigError, match="set --moe-loss-weight 0"):  # the preset's MegaBlocks-scale loss
        validate(build_config(None, flags))
    validate(build_config(None, [*flags, "--moe-loss-weight", "0"]))


def test_megatron_and_megablocks_flags():
    megatron = build_config(overrides=[
        "--num-experts", "64", "--moe-router-topk", "6", "--moe-ffn-hidden-size", "1408", "--moe-grouped-gemm",
        "--moe-router-pre-softmax", "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3",
        "--moe-layer-freq", "([0]+[1]*26)", "--moe-shared-expert-intermediate-size", "2816",
        "--moe-expert-capacity-factor", "1.25", "--moe-token-drop-policy", "position",
    ]).model  # fmt: skip
    assert (megatron.num_experts, megatron.moe_router_topk, megatron.moe_ffn_hidden_size) == (64, 6, 1408)
    assert megatron.moe_grouped_gemm == "auto" and megatron.moe_router_pre_softmax
    assert megatron.moe_router_load_balancing_type == "seq_aux_loss" and megatron.moe_aux_loss_coeff == 1e-3
    assert megatron.moe_layer_freq == "([0]+[1]*26)" and megatron.moe_shared_expert_intermediate_size == 2816
    assert (megatron.moe_expert_capacity_factor, megatron.moe_token_drop_policy) == (1.25, "position")
    megablocks = build_config(overrides=[
        "--moe-num-experts", "8", "--moe-top-k", "1", "--moe-capacity-factor", "0", "--moe-loss-weight", "0.1",
        "--moe-jitter-eps", "0.01",
    ]).model  # fmt: skip
    assert (megablocks.num_experts, megablocks.moe_router_topk) == (8, 1)
    assert megablocks.moe_expert_capacity_factor == 0  # dropless
    assert (megablocks.moe_loss_weight, megablocks.moe_jitter_eps) == (0.1, 0.01)
    assert build_config(overrides=["--model.moe_grouped_gemm", "loop"]).model.moe_grouped_gemm == "loop"


def test_megatron_moe_performance_flags_are_accepted_and_say_what_meshtron_does():
    from meshtron.flags import noted_flag_lines
    from meshtron.validation import validate

    flags = ["--preset", "tiny-mixtral", "--mock-data", "--moe-permute-fusion", "--moe-router-fusion", "--moe-per-layer-logging",
             "--moe-lbl-in-fp32", "--moe-router-padding-for-fp8", "--moe-enable-deepep",
             "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep", "--moe-deepep-num-sms", "20"]  # fmt: skip
    cfg = build_config(None, flags)
    validate(cfg)
    assert cfg.model.moe_token_dispatcher_type == "alltoall"  # flex: the same tokens, by NCCL's all-to-all
    lines = "\n".join(noted_flag_lines(cfg.logging.noted_flags))
    assert "--moe-permute-fusion: always where Triton runs" in lines and "--moe-flex-dispatcher-backend deepep: DeepEP is not used" in lines
    assert "--moe-token-dispatcher-type flex: meshtron's alltoall, NCCL's variable-size all-to-all" in lines


def test_overlap_moe_expert_parallel_comm_is_accepted_with_ep_and_refused_without():
    from meshtron.errors import ConfigError
    from meshtron.validation import validate

    base = ["--preset", "tiny-mixtral", "--mock-data", "--overlap-moe-expert-parallel-comm"]
    cfg = build_config(None, [*base, "--expert-model-parallel-size", "2"])
    validate(cfg, world_size=2)
    assert cfg.model.overlap_moe_expert_parallel_comm and cfg.model.moe_ep_overlap_chunks == 2
    local = cfg.model.num_experts // 2
    refused = [([], "with --expert-model-parallel-size 1 there is none; drop the flag or set ep > 1"),
               (["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"], "use alltoall or drop the flag"),
               (["--expert-model-parallel-size", "2", "--model.moe_ep_overlap_chunks", str(local + 1)],
                f"must be between 2 and the {local} experts per ep rank")]  # fmt: skip
    for flags, message in refused:
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(build_config(None, [*base, *flags]), world_size=2)


@pytest.mark.parametrize("flags, message", [
    (["--moe-use-upcycling"], "no upcycling of a dense checkpoint"),
    (["--moe-extended-tp"], "--expert-tensor-parallel-size <tp x ep>"),
    (["--moe-apply-probs-on-input"], "scale the experts' outputs"),
    (["--moe-flex-dispatcher-backend", "nccl"], "not one of Megatron's values (deepep | hybridep)"),
])  # fmt: skip
def test_megatron_moe_flags_meshtron_cannot_honour_are_refused_with_what_to_do(flags, message):
    from meshtron.errors import ConfigError
    from meshtron.validation import validate

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        validate(build_config(None, ["--preset", "tiny-mixtral", "--mock-data", *flags]))


def test_device_limited_routing_is_group_limited_routing_over_the_ep_ranks():
    from meshtron.errors import ConfigError

    cfg = build_config(None, ["--preset", "tiny-mixtral", "--expert-model-parallel-size", "2", "--moe-router-topk-limited-devices", "1"])
    assert (cfg.model.moe_router_num_groups, cfg.model.moe_router_group_topk) == (2, 1)
    assert not moe_config_errors(cfg.model)
    with pytest.raises(ConfigError, match="older spelling of --moe-router-num-groups"):
        build_config(None, ["--preset", "tiny-mixtral", "--moe-router-topk-limited-devices", "1", "--moe-router-num-groups", "2"])
