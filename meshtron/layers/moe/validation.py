"""Every MoE config check that needs no tensor; each message names the flag to change."""

from __future__ import annotations

from meshtron.config import ModelConfig
from meshtron.layers.moe.fp8_grouped_gemm import FOR_GROUPED_GEMM, FP8_EXPERT_MODES
from meshtron.layers.moe.grouped_gemm import GROUPED_GEMM_BACKENDS
from meshtron.layers.moe.layer_pattern import parse_layer_freq
from meshtron.layers.moe.router import GROUP_SCORES, ROUTER_DTYPES


def moe_config_errors(m: ModelConfig) -> list[str]:
    """Problems with the MoE fields of ``m`` (none when ``num_experts`` is 0 and nothing MoE is set)."""
    if m.num_experts < 0:
        return [f"--num-experts must be 0 (dense) or positive, got {m.num_experts}"]
    if m.num_experts == 0:
        return []
    errors: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errors.append(msg)

    experts, k = m.num_experts, m.moe_router_topk
    need(not m.add_bias_linear, "MoE experts have no biases; add --disable-bias-linear (model.add_bias_linear = false)")
    need(1 <= k <= experts, f"--moe-router-topk {k} must be between 1 and --num-experts {experts}")
    need(m.moe_ffn_hidden_size >= 0, f"--moe-ffn-hidden-size must not be negative, got {m.moe_ffn_hidden_size}")
    sinkhorn = m.moe_router_load_balancing_type == "sinkhorn"
    need(m.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss", "sinkhorn", "none"),
         f"--moe-router-load-balancing-type must be aux_loss, seq_aux_loss, sinkhorn or none, got '{m.moe_router_load_balancing_type}'")  # fmt: skip
    for flag, value in (("--moe-aux-loss-coeff", m.moe_aux_loss_coeff), ("--moe-loss-weight", m.moe_loss_weight),
                        ("--moe-z-loss-coeff", m.moe_z_loss_coeff)):  # fmt: skip
        need(value >= 0, f"{flag} must not be negative, got {value}")
    need(not (m.moe_aux_loss_coeff and m.moe_loss_weight),
         "--moe-aux-loss-coeff (per layer) and --moe-loss-weight (averaged over layers) set the same loss; keep one")  # fmt: skip
    need(m.moe_router_score_function in ("softmax", "sigmoid"),
         f"--moe-router-score-function must be softmax or sigmoid, got '{m.moe_router_score_function}'")  # fmt: skip
    # A softmax over a single chosen logit is constant 1: the router would get no gradient (sinkhorn's k 1 is a sigmoid).
    need(sinkhorn or not (k == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax),
         "--moe-router-topk 1 with softmax needs --moe-router-pre-softmax (a softmax over one logit has no gradient)")  # fmt: skip
    need(m.moe_router_topk_scaling_factor > 0,
         f"--moe-router-topk-scaling-factor must be positive, got {m.moe_router_topk_scaling_factor}")  # fmt: skip
    errors.extend(_group_errors(m))
    if sinkhorn:
        errors.extend(_sinkhorn_errors(m))
    need(m.moe_router_dtype in ROUTER_DTYPES, f"--moe-router-dtype must be fp32 or fp64 (or empty for the input's), got '{m.moe_router_dtype}'")
    need(not (m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid"),
         "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")  # fmt: skip
    need(m.moe_router_bias_update_rate >= 0, f"--moe-router-bias-update-rate must not be negative, got {m.moe_router_bias_update_rate}")
    need(0 <= m.moe_jitter_eps < 1, f"--moe-jitter-eps must be in [0, 1), got {m.moe_jitter_eps}")
    need(m.moe_expert_capacity_factor >= 0,
         f"--moe-expert-capacity-factor must be positive, or 0 for dropless, got {m.moe_expert_capacity_factor}")  # fmt: skip
    need(m.moe_token_drop_policy in ("probs", "position"), f"--moe-token-drop-policy must be probs or position, got '{m.moe_token_drop_policy}'")
    need(not (m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor <= 0),
         "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (dropless has no capacity to pad to)")  # fmt: skip
    need(m.moe_shared_expert_intermediate_size >= 0,
         f"--moe-shared-expert-intermediate-size must not be negative, got {m.moe_shared_expert_intermediate_size}")  # fmt: skip
    need(not (m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size <= 0),
         "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")  # fmt: skip
    need(m.moe_grouped_gemm in GROUPED_GEMM_BACKENDS,
         f"model.moe_grouped_gemm must be one of {', '.join(GROUPED_GEMM_BACKENDS)}, got '{m.moe_grouped_gemm}'")  # fmt: skip
    need(m.moe_fp8 in FP8_EXPERT_MODES, f"model.moe_fp8 must be one of {', '.join(FP8_EXPERT_MODES)}, got '{m.moe_fp8}'")
    need(not (m.fp8_format and m.moe_fp8 == "rowwise" and m.moe_grouped_gemm not in FOR_GROUPED_GEMM),
         f"FP8 experts (--fp8-format, model.moe_fp8 rowwise) run on --model.moe_grouped_gemm auto, torch or loop: there is "
         f"no Triton FP8 grouped GEMM; change {m.moe_grouped_gemm} or set model.moe_fp8 off")  # fmt: skip
    try:
        need(any(parse_layer_freq(m.moe_layer_freq, m.num_layers)),
             f"--moe-layer-freq {m.moe_layer_freq} makes no layer MoE; set --num-experts 0 for a dense model")  # fmt: skip
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def _sinkhorn_errors(m: ModelConfig) -> list[str]:
    """What sinkhorn routing would ignore or fight: it balances by its plan alone (Megatron-Core
    asserts no auxiliary loss), chooses among all experts, and its weights are fixed by k (no
    scaling factor either: Megatron-Core applies that on its top-k path only)."""
    sinkhorn = "--moe-router-load-balancing-type sinkhorn"
    errors = []
    for flag, coeff in (("--moe-aux-loss-coeff", m.moe_aux_loss_coeff), ("--moe-loss-weight", m.moe_loss_weight)):
        if coeff > 0:
            errors.append(f"{sinkhorn} balances by its plan and takes no auxiliary loss (as in Megatron-Core); set {flag} 0 or use aux_loss")
    if m.moe_router_num_groups or m.moe_router_group_topk:
        errors.append(f"{sinkhorn} chooses among all experts; drop group-limited routing (--moe-router-num-groups, "
                      "--moe-router-group-topk, --moe-router-topk-limited-devices)")  # fmt: skip
    if m.moe_router_enable_expert_bias:
        errors.append(f"{sinkhorn} already balances the load; drop --moe-router-enable-expert-bias")
    weights = "its weights are sigmoid with --moe-router-topk 1, else the softmax over all experts"
    if m.moe_router_score_function != "softmax":
        errors.append(f"{sinkhorn} ignores the score function ({weights}); drop --moe-router-score-function {m.moe_router_score_function}")
    if m.moe_router_pre_softmax and m.moe_router_topk == 1:  # above k 1 the flag names sinkhorn's own weights
        errors.append(f"{sinkhorn} with --moe-router-topk 1 weighs by a sigmoid, not --moe-router-pre-softmax's softmax; drop it")
    if m.moe_router_topk_scaling_factor != 1.0:
        errors.append(f"{sinkhorn} does not scale its weights (as in Megatron-Core); drop --moe-router-topk-scaling-factor "
                      f"{m.moe_router_topk_scaling_factor}")  # fmt: skip
    return errors


def _group_errors(m: ModelConfig) -> list[str]:
    """Group-limited routing: equal groups, enough experts in the chosen groups for the top-k."""
    groups, chosen, k = m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk
    if not chosen:  # Megatron's rule: --moe-router-num-groups alone leaves plain top-k (ROCm's 16B script passes it so)
        return []
    if m.moe_router_group_score not in GROUP_SCORES:
        return [f"model.moe_router_group_score must be one of {', '.join(GROUP_SCORES)}, got '{m.moe_router_group_score}'"]
    if groups <= 0 or chosen <= 0:
        return ["--moe-router-num-groups and --moe-router-group-topk must both be positive for group-limited routing"]
    if m.num_experts % groups:
        return [f"--moe-router-num-groups {groups} must divide --num-experts {m.num_experts}"]
    per_group = m.num_experts // groups
    # sum_topk scores a group by its best k // group_topk experts; the chosen groups must hold k experts.
    most = min(groups, k) if m.moe_router_group_score == "sum_topk" else groups
    if not (chosen <= most and chosen * per_group >= k):
        bound = f"--moe-router-topk {k} and " if m.moe_router_group_score == "sum_topk" else ""
        return [
            f"--moe-router-group-topk {chosen} must be at most {bound}--moe-router-num-groups "
            f"{groups}, and its groups of {per_group} experts must hold the top-{k}"
        ]
    return []
