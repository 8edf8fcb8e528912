"""The router: which k experts each token visits, and with what weight.

Semantics follow Megatron-Core's ``--moe-router-*`` flags, so a config moved from Megatron routes
the same tokens to the same experts:

- softmax, top-k first (default): softmax over the k chosen logits (Mixtral; weights sum to 1);
- softmax, ``--moe-router-pre-softmax``: softmax over all experts, then top-k, not renormalized
  (DeepSeek-V2's ``norm_topk_prob = false``);
- sigmoid: top-k of sigmoid scores (plus the expert bias, for selection only), the chosen scores
  renormalized to sum 1 when k > 1 (DeepSeek-V3);
- sinkhorn (``--moe-router-load-balancing-type sinkhorn``, Megatron-Core's): in training the k
  experts come from the top-k of Sinkhorn's balanced plan over the micro batch, in eval from the
  top-k of the weights; the weights are sigmoid (k = 1) or the softmax over all experts (k > 1)
  at the chosen experts, not renormalized and not scaled, whatever the score function;
- then (top-k) every weight times ``--moe-router-topk-scaling-factor``.

The router also measures what the layer's balancing losses need (``token_statistics``). Without
groups or expert bias, on a GPU with ``model.fused_kernels`` (auto), all of it after the gate GEMM is one
Triton kernel each way (``meshtron/kernels/triton_router.py``); ``topk_routing`` and
``token_statistics`` are its reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import ModelConfig
from meshtron.kernels import use_triton
from meshtron.kernels.fp32_gate import fp32_gate
from meshtron.layers.moe.balancing import StatisticsNeeded, TokenSum, losses_from_statistics, sinkhorn, token_statistics

ROUTER_DTYPES = {"": None, "fp32": torch.float32, "fp64": torch.float64}


@dataclass
class Routing:
    """One layer's routing of T tokens: ``experts`` [T, k] ids, ``probs`` [T, k] combine weights,
    ``statistics`` the sums over tokens its losses need (``token_statistics``; left out where
    the fused kernel computed the ``losses`` from them itself)."""

    logits: torch.Tensor  # [T, E], in the router dtype
    probs: torch.Tensor
    experts: torch.Tensor
    statistics: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # ``losses_from_statistics``', given the coefficients


GROUP_SCORES = ("sum_topk", "max")


def group_limited_topk(
    scores: torch.Tensor, k: int, num_groups: int, group_topk: int, group_score: str = "sum_topk"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to the ``group_topk`` best of ``num_groups`` equal expert groups.

    DeepSeek's device/node-limited routing: with groups = devices (or nodes), a token's experts
    live on at most ``group_topk`` of them, which bounds its all-to-all fan-out. A group's score
    is the sum of its best k / group_topk scores (``sum_topk``: Megatron-Core's rule, DeepSeek-V3's
    ``noaux_tc`` at its k 8 / 4 groups) or its best score (``max``: DeepSeek-V2's
    ``group_limited_greedy``); the two agree when k / group_topk is 1.
    """
    tokens, num_experts = scores.shape
    grouped = scores.view(tokens, num_groups, num_experts // num_groups)
    if group_score == "max":
        group_scores = grouped.amax(dim=-1)
    else:
        group_scores = grouped.topk(k // group_topk, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best_groups, True)
    allowed = allowed.unsqueeze(-1).expand_as(grouped).reshape(tokens, num_experts)
    return scores.masked_fill(~allowed, float("-inf")).topk(k, dim=-1)


def topk_routing(
    logits: torch.Tensor,
    k: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    scaling_factor: float = 1.0,
    num_groups: int = 0,
    group_topk: int = 0,
    group_score: str = "sum_topk",
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (probs [T, k] in the logits' dtype, expert ids [T, k]); see the module docstring.

    Score functions run in fp32 whatever the logits' dtype: a bf16 softmax over many experts
    loses the small probabilities that decide the balancing loss.
    """

    def select(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if group_topk:
            return group_limited_topk(scores, k, num_groups, group_topk, group_score)
        return scores.topk(k, dim=-1)

    if score_function == "softmax":
        if pre_softmax:
            probs, experts = select(torch.softmax(logits.float(), dim=-1))
        else:
            top_logits, experts = select(logits.float())
            probs = torch.softmax(top_logits, dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        if expert_bias is None:
            probs, experts = select(scores)
        else:
            experts = select(scores + expert_bias.float()).indices
            probs = scores.gather(1, experts)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"unknown --moe-router-score-function '{score_function}'")
    if scaling_factor != 1.0:
        probs = probs * scaling_factor
    return probs.to(logits.dtype), experts


def sinkhorn_routing(
    logits: torch.Tensor, k: int, training: bool = True, token_sum: nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (probs [T, k] in the logits' dtype, expert ids [T, k]) by Megatron-Core's
    sinkhorn rule (module docstring). The plan only selects (no gradient); the weights carry the
    gate's gradient. ``token_sum`` completes the plan's sums over the micro batch (``sinkhorn``)."""
    weights = torch.sigmoid(logits.float()) if k == 1 else torch.softmax(logits.float(), dim=-1)
    chosen_from = sinkhorn(logits, token_sum) if training else weights
    experts = chosen_from.topk(k, dim=-1).indices
    return weights.gather(1, experts).to(logits.dtype), experts


class Router(nn.Module):
    """Linear gate ``weight`` [E, h] (no bias) and top-k routing, with DeepSeek-V3's expert bias.

    The expert bias shifts only which experts are chosen, never the combine weights, so it
    balances load without a gradient that fights the language-model loss. It is a buffer (saved
    in checkpoints, not trained) kept in fp32: its steps of ``--moe-router-bias-update-rate``
    vanish in bf16.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.topk = cfg.moe_router_topk
        self.sinkhorn = cfg.moe_router_load_balancing_type == "sinkhorn"
        self.score_function = cfg.moe_router_score_function
        # Megatron ignores --moe-router-pre-softmax with sigmoid scores (ROCm's DeepSeek-V3 script passes both).
        self.pre_softmax = cfg.moe_router_pre_softmax and cfg.moe_router_score_function == "softmax"
        self.scaling_factor = cfg.moe_router_topk_scaling_factor
        self.num_groups = cfg.moe_router_num_groups
        self.group_topk = cfg.moe_router_group_topk
        self.group_score = cfg.moe_router_group_score
        self.dtype = ROUTER_DTYPES[cfg.moe_router_dtype]
        self.jitter_eps = cfg.moe_jitter_eps
        self.force_load_balancing = cfg.moe_router_force_load_balancing
        self.bias_update_rate = cfg.moe_router_bias_update_rate
        self.fused_kernels = cfg.fused_kernels
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        nn.init.normal_(self.weight, std=cfg.init_method_std)
        if cfg.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
            # Integer, so casting the model to bf16 leaves the counts exact; not saved (zero after a step).
            self.register_buffer("tokens_since_update", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)
        else:
            self.expert_bias = None

    def _apply(self, fn, recurse=True):
        """``model.to(bfloat16)`` casts buffers too; bring the expert bias back to fp32 (see class doc)."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def forward(self, tokens: torch.Tensor, batch_size: int = 1, needed: StatisticsNeeded = StatisticsNeeded(),
                token_sum: nn.Module | None = None, coefficients: tuple[float, float] | None = None) -> Routing:  # fmt: skip
        """tokens [T, h] (``batch_size`` sequences, batch-major) -> Routing with the ``needed``
        statistics and, given ``coefficients`` (balancing, z), the losses made of them
        (``losses_from_statistics``). Input jitter (MegaBlocks, Switch) applies in training only.
        ``token_sum`` sums over the micro batch's tokens from this rank's (the layer's; sinkhorn's
        plan and the losses read it)."""
        if self.training and self.jitter_eps > 0:
            tokens = tokens * torch.empty_like(tokens).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
        if self.dtype == torch.float32:  # bf16 operands on tensor cores, fp32 numbers (kernels/fp32_gate.py)
            logits = fp32_gate(tokens, self.weight, self.fused_kernels)
        else:
            dtype = self.dtype or tokens.dtype
            logits = F.linear(tokens.to(dtype), self.weight.to(dtype))
        if self.force_load_balancing:
            logits = _RandomLogits.apply(logits)
        rows = batch_size if needed.per_sequence else 1
        losses = None
        if self._fusable(logits, rows):
            # Sums over every token of the micro batch already (one process, no sequence split): the kernel makes the losses.
            whole = coefficients is not None and (token_sum is None or isinstance(token_sum, TokenSum)) and logits.shape[0] > 0
            probs, experts, statistics, losses = _fused_routing(logits, self.topk, self.score_function == "softmax", self.pre_softmax,
                                                                self.scaling_factor, rows, needed, coefficients if whole else None)  # fmt: skip
        else:
            if self.sinkhorn:
                probs, experts = sinkhorn_routing(logits, self.topk, self.training, token_sum)
            else:
                probs, experts = topk_routing(
                    logits, self.topk, self.score_function, self.pre_softmax, self.scaling_factor,
                    self.num_groups, self.group_topk, self.group_score, self.expert_bias,
                )  # fmt: skip
            statistics = token_statistics(logits, batch_size, self.topk, self.score_function, needed)
        if losses is None:
            wanted = coefficients is not None and (needed.balanced or needed.z)
            losses = losses_from_statistics(statistics, self.topk, *coefficients, token_sum) if wanted else {}
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            self.tokens_since_update += torch.bincount(experts.detach().reshape(-1), minlength=self.expert_bias.numel())
        return Routing(logits, probs, experts, statistics, losses)

    def _fusable(self, logits: torch.Tensor, rows: int) -> bool:
        """Whether the fused kernel computes this routing: top-k (not sinkhorn), no groups or bias,
        Triton for this tensor (``model.fused_kernels``), and each program's tokens within one
        sequence (``FusedRouting``)."""
        if not use_triton(self.fused_kernels, logits):
            return False
        from meshtron.kernels.triton_router import block_tokens

        tokens, experts = logits.shape
        one_sequence_per_program = rows == 1 or (tokens // rows) % block_tokens(experts) == 0
        plain = not (self.sinkhorn or self.group_topk) and self.expert_bias is None and self.score_function in ("softmax", "sigmoid")
        return plain and one_sequence_per_program and self.topk <= experts <= 4096

    def step_statistics(self) -> torch.Tensor | None:
        """This rank's routed copies per expert since the last update ([E], summed over the step's
        training micro batches), or None without an expert bias. A layer that activation
        recompute reruns counts each token twice: the update reads only the sign of (mean - load),
        which a uniform factor leaves unchanged."""
        return None if self.expert_bias is None else self.tokens_since_update

    @torch.no_grad()
    def apply_step_statistics(self, tokens_per_expert: torch.Tensor) -> None:
        """After the optimizer step: one bias update from the counts summed over every rank that
        routed other tokens, then the count restarts."""
        self.update_expert_bias(tokens_per_expert)
        self.tokens_since_update.zero_()

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """One aux-loss-free balancing step: experts above the mean load get a lower bias.

        ``tokens_per_expert`` [E] must already be summed over every rank and micro-batch of the
        step (the caller owns the all-reduce), so all replicas of the router make the same step.
        """
        load = tokens_per_expert.to(self.expert_bias.device, torch.float32)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)


class _RandomLogits(torch.autograd.Function):
    """``--moe-router-force-load-balancing`` (Megatron's, for benchmarks only): the gate's logits
    replaced by standard normal draws, so every expert gets about T*k/E rows whatever the weights;
    the gradient passes straight through to the gate. Drawn from the default generator, like the
    jitter: the same on every rank (tensor-parallel ranks that share tokens route them alike),
    replayed by activation recompute and restored on resume."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        return torch.randn(logits.shape, device=logits.device, dtype=logits.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


@torch.compiler.disable  # a graph break: the kernels run eagerly inside a compiled block
def _fused_routing(logits: torch.Tensor, k: int, softmax: bool, pre_softmax: bool, scaling: float, rows: int, needed: StatisticsNeeded,
                   coefficients: tuple[float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:  # fmt: skip
    """``topk_routing`` and ``token_statistics`` through ``FusedRouting``: (probs, experts,
    statistics, None), or with ``coefficients`` (the statistics being the micro batch's) (probs,
    experts, {}, the losses of ``losses_from_statistics``)."""
    from meshtron.kernels.triton_router import FusedRouting

    stats = needed.balanced or needed.z
    probs, experts, scores, counts, z, balance, z_loss = FusedRouting.apply(logits, k, softmax, pre_softmax, scaling, rows, stats, coefficients)
    if coefficients is not None:
        losses = {"load_balancing": balance} if needed.balanced else {}
        return probs, experts, {}, {**losses, "z_loss": z_loss} if needed.z else losses
    statistics = {"tokens": logits.new_full((1,), logits.shape[0], dtype=torch.float32)}
    if needed.balanced:
        statistics["scores"], statistics["counts"] = scores, counts
    if needed.z:
        statistics["z"] = z
    return probs, experts, statistics, None
