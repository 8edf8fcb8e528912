"""Token permutation: the routed copies of tokens sorted by expert, and back.

A grouped GEMM wants each expert's rows contiguous. ``plan_dispatch`` decides, from the router's
choice, which copy goes to which row; ``permute`` gathers tokens into that order and
``unpermute`` scatters expert outputs back, weighted, summing a token's k copies.

Dropless (default) keeps every copy: T*k rows, each expert as many as it was given. With a
capacity factor (Megatron-Core's ``--moe-expert-capacity-factor``) an expert keeps at most
``ceil(T*k/E * factor)`` copies; the rest are dropped (the residual stream carries those tokens
unchanged). ``--moe-pad-expert-input-to-capacity`` then gives every expert exactly that many rows,
zero rows as filler, so shapes stay static (CUDA graphs); a zero row produces zero output in a
bias-free expert and is never read back.

Dropless, on a GPU with Triton (``model.fused_kernels``), both directions run as gather-form
kernels (``kernels/triton_moe_permute.py``): every row and every token written by one program,
no atomics, fp32 sums, the combine's output directly in the layer's dtype. The plan gives them
``inverse`` [T, k], the row of each token's copy, itself planned by three kernels there (the same
rows as the reference's stable sort). The ops below are the reference, the CPU's path and that of
the capacity modes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from meshtron.kernels import use_triton


@dataclass
class DispatchPlan:
    """Where each kept copy of a token goes. N kept copies, R >= N expert-input rows.

    The reference ops read the kept copies as ``token_index`` and ``weights``, made from ``order``
    when first read (the kernels read ``inverse`` and ``token_weights`` and never make them)."""

    order: torch.Tensor | None  # [N] copy t*k + j of each kept copy, grouped by expert; None: from ``inverse``
    token_weights: torch.Tensor  # [T, k] the combine weights in token order
    row_index: torch.Tensor | None  # [N] its row in the padded expert input; None: row i is copy i
    num_rows: int  # R
    group_sizes: torch.Tensor  # [E] expert-input rows per expert (padding included)
    tokens_per_expert: torch.Tensor  # [E] kept copies per expert
    inverse: torch.Tensor | None = None  # [T, k] row of token t's j-th copy; dropless only

    @functools.cached_property
    def kept_order(self) -> torch.Tensor:
        """``order``, or for a kernel-made dropless plan the copies in row order, from ``inverse``."""
        if self.order is not None:
            return self.order
        flat = self.inverse.reshape(-1)  # dropless: row inverse[t, j] holds copy t*k + j
        return torch.empty_like(flat).scatter_(0, flat, torch.arange(flat.numel(), device=flat.device))

    @functools.cached_property
    def token_index(self) -> torch.Tensor:
        """[N] source token of each kept copy, grouped by expert."""
        return self.kept_order // self.token_weights.shape[1]

    @functools.cached_property
    def weights(self) -> torch.Tensor:
        """[N] each kept copy's combine weight."""
        return self.token_weights.reshape(-1)[self.kept_order]


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron-Core's capacity, ceil(T*k/E * factor), at most T: an expert never gets a token twice."""
    return min(num_tokens, math.ceil(num_tokens * topk / num_experts * capacity_factor))


def plan_dispatch(
    probs: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    capacity_factor: float = 0.0,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
    seq_length: int | None = None,
    fused_kernels: str = "auto",
) -> DispatchPlan:
    """Plan for ``probs``/``experts`` [T, k] (tokens batch-major, ``seq_length`` per sequence).

    Dropping keeps, per expert, the copies with the highest weight (``probs``) or the earliest
    sequence position, earlier sequences of the batch first among equal positions (``position``,
    Megatron's order, whose tokens are position-major). Dropless, the kernels plan where
    ``fused_kernels`` runs them (see the module docstring).
    """
    num_tokens, topk = experts.shape
    if capacity_factor <= 0 and use_triton(fused_kernels, experts):
        from meshtron.kernels.triton_moe_permute import PLAN_MAX_EXPERTS, plan_rows  # Triton stays optional

        if num_experts <= PLAN_MAX_EXPERTS:
            counts, inverse = plan_rows(experts, num_experts)
            return DispatchPlan(None, probs, None, num_tokens * topk, counts, counts, inverse)
    flat_experts = experts.reshape(-1)
    if capacity_factor <= 0:
        counts, order = _sort_by_expert(flat_experts, num_experts)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return DispatchPlan(order, probs, None, order.numel(), counts, counts, inverse.view(num_tokens, topk))

    priority = _drop_priority(probs, num_tokens, drop_policy, seq_length or num_tokens)
    order = priority[torch.argsort(flat_experts[priority], stable=True)]
    sorted_experts = flat_experts[order]
    counts = torch.bincount(sorted_experts, minlength=num_experts)
    rank_in_expert = torch.arange(order.numel(), device=order.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    capacity = expert_capacity(num_tokens, topk, num_experts, capacity_factor)
    keep = rank_in_expert < capacity
    order, kept_counts = order[keep], counts.clamp(max=capacity)
    if pad_to_capacity:
        row_index = sorted_experts[keep] * capacity + rank_in_expert[keep]
        group_sizes = torch.full_like(counts, capacity)
        return DispatchPlan(order, probs, row_index, num_experts * capacity, group_sizes, kept_counts)
    return DispatchPlan(order, probs, None, order.numel(), kept_counts, kept_counts)


def _sort_by_expert(flat_experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(copies per expert [E], copy indices sorted by expert, stable) without a host sync.

    The ids are sorted as uint8 where they fit (one radix pass rather than int64's eight), else
    int32, and counted by binary search in the sorted ids (``bincount`` on a GPU reads its
    maximum back to the host).
    """
    key_dtype = torch.uint8 if num_experts <= 256 else torch.int32
    sorted_experts, order = torch.sort(flat_experts.to(key_dtype), stable=True)
    ends = torch.searchsorted(sorted_experts, torch.arange(num_experts, device=flat_experts.device, dtype=key_dtype), right=True)
    return torch.cat((ends[:1], ends.diff())), order  # no zero prepended: one fill kernel fewer


def _drop_priority(probs: torch.Tensor, num_tokens: int, drop_policy: str, seq_length: int) -> torch.Tensor:
    """Flat copy indices [T*k], the copies to keep first; a stable sort by expert keeps this order."""
    topk = probs.shape[1]
    if drop_policy == "probs":
        return torch.argsort(probs.detach().reshape(-1), descending=True, stable=True)
    if drop_policy == "position":
        tokens = torch.arange(num_tokens, device=probs.device)
        position_major = torch.argsort((tokens % seq_length) * num_tokens + tokens // seq_length)
        return (position_major[:, None] * topk + torch.arange(topk, device=probs.device)).reshape(-1)
    raise ValueError(f"unknown --moe-token-drop-policy '{drop_policy}'")


def permute(tokens: torch.Tensor, plan: DispatchPlan, fused_kernels: str = "auto") -> torch.Tensor:
    """tokens [T, h] -> expert input [R, h], rows grouped by expert."""
    if plan.inverse is not None and use_triton(fused_kernels, tokens):
        from meshtron.kernels.triton_moe_permute import permute_copies  # Triton stays optional

        return permute_copies(tokens, plan.inverse)
    rows = tokens.index_select(0, plan.token_index)
    if plan.row_index is None:
        return rows
    return rows.new_zeros(plan.num_rows, rows.shape[1]).index_copy(0, plan.row_index, rows)


def unpermute(
    expert_output: torch.Tensor, plan: DispatchPlan, num_tokens: int, out_dtype: torch.dtype | None = None, fused_kernels: str = "auto"
) -> torch.Tensor:
    """expert output [R, h] -> [T, h] in ``out_dtype`` (default the weights'): each token's copies
    times their weights, summed.

    The reference computes in the weights' dtype (the router dtype, fp32 with ``--moe-router-dtype
    fp32``) so a token's k contributions add up without bf16 rounding between them; the kernel
    always sums in fp32 and rounds once to ``out_dtype`` (fp64 weights keep the reference).
    """
    out_dtype = out_dtype or plan.token_weights.dtype
    weights = plan.token_weights
    if plan.inverse is not None and weights.dtype != torch.float64 and use_triton(fused_kernels, expert_output):
        from meshtron.kernels.triton_moe_permute import combine_copies  # Triton stays optional

        return combine_copies(expert_output, weights, plan.inverse, out_dtype)
    rows = expert_output if plan.row_index is None else expert_output.index_select(0, plan.row_index)
    weighted = rows.to(plan.weights.dtype) * plan.weights[:, None]
    return weighted.new_zeros(num_tokens, weighted.shape[1]).index_add(0, plan.token_index, weighted).to(out_dtype)
