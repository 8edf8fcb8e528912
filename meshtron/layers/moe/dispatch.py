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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class DispatchPlan:
    """Where each kept copy of a token goes. N kept copies, R >= N expert-input rows."""

    token_index: torch.Tensor  # [N] source token of each kept copy, grouped by expert
    weights: torch.Tensor  # [N] its combine weight
    row_index: torch.Tensor | None  # [N] its row in the padded expert input; None: row i is copy i
    num_rows: int  # R
    group_sizes: torch.Tensor  # [E] expert-input rows per expert (padding included)
    tokens_per_expert: torch.Tensor  # [E] kept copies per expert


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
) -> DispatchPlan:
    """Plan for ``probs``/``experts`` [T, k] (tokens batch-major, ``seq_length`` per sequence).

    Dropping keeps, per expert, the copies with the highest weight (``probs``) or the earliest
    sequence position, earlier sequences of the batch first among equal positions (``position``,
    Megatron's order, whose tokens are position-major).
    """
    num_tokens, topk = experts.shape
    flat_experts = experts.reshape(-1)
    flat_tokens = torch.arange(num_tokens, device=experts.device).repeat_interleave(topk)
    flat_probs = probs.reshape(-1)
    if capacity_factor <= 0:
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=num_experts)
        return DispatchPlan(flat_tokens[order], flat_probs[order], None, order.numel(), counts, counts)

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
        return DispatchPlan(flat_tokens[order], flat_probs[order], row_index, num_experts * capacity, group_sizes, kept_counts)
    return DispatchPlan(flat_tokens[order], flat_probs[order], None, order.numel(), kept_counts, kept_counts)


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


def permute(tokens: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """tokens [T, h] -> expert input [R, h], rows grouped by expert."""
    rows = tokens.index_select(0, plan.token_index)
    if plan.row_index is None:
        return rows
    return rows.new_zeros(plan.num_rows, rows.shape[1]).index_copy(0, plan.row_index, rows)


def unpermute(expert_output: torch.Tensor, plan: DispatchPlan, num_tokens: int) -> torch.Tensor:
    """expert output [R, h] -> [T, h]: each token's copies times their weights, summed.

    Computed in the weights' dtype (the router dtype, fp32 with ``--moe-router-dtype fp32``) so
    a token's k contributions add up without bf16 rounding between them.
    """
    rows = expert_output if plan.row_index is None else expert_output.index_select(0, plan.row_index)
    weighted = rows.to(plan.weights.dtype) * plan.weights[:, None]
    return weighted.new_zeros(num_tokens, weighted.shape[1]).index_add(0, plan.token_index, weighted)
