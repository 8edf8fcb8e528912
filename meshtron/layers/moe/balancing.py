"""Load-balancing and router z-losses, as differentiable scalars the model reports by name, and
Sinkhorn's balanced routing plan.

Nothing here adds to a global: the layer hands its losses to the model, which reports them as
named auxiliary terms of its loss. That keeps them right under pipeline parallelism and
recomputation, where MegaBlocks' global list of per-layer statistics went wrong.

Scales are Megatron-Core's: each MoE layer's loss is ``coeff * E * sum_i f_i * P_i`` over one
micro-batch on one data-parallel rank (its whole sequences, under sequence and context
parallelism too), the layers' losses add up (the total grows with the number of MoE layers), and
a micro-batch's terms are weighted as its language-model loss is (Megatron scales them by
1/num_micro_batches, as the LM loss). MegaBlocks' ``--moe-loss-weight w`` averages over the
layers instead: a per-layer coefficient of ``w / num_moe_layers`` (``aux_loss_coeff``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from meshtron.config import ModelConfig


def aux_loss_coeff(cfg: ModelConfig, num_moe_layers: int) -> float:
    """The per-layer coefficient, from Megatron-Core's or MegaBlocks' flag (validation allows one)."""
    return cfg.moe_aux_loss_coeff or cfg.moe_loss_weight / max(1, num_moe_layers)


def balancing_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """[T, E] fp32 probabilities the balancing loss averages (P_i): the full softmax, or sigmoid
    scores normalized per token, whatever top-k rule the router uses (Megatron-Core's choice)."""
    if score_function == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    scores = torch.sigmoid(logits.float())
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def switch_aux_loss(score_sums: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: torch.Tensor | int, topk: int) -> torch.Tensor:
    """Switch/GShard loss ``E * sum_i f_i * P_i`` (1 when perfectly balanced), before its coefficient.

    f_i = tokens_per_expert_i / (num_tokens * k) is a count and carries no gradient; P_i =
    score_sums_i / num_tokens, the mean of the balancing scores over the tokens, does. Sums rather
    than means, so that a sequence-parallel layer can add its shards' sums up first (``TokenSum``).
    """
    fraction = tokens_per_expert.float() / (num_tokens * topk)
    return score_sums.shape[-1] * (fraction * score_sums / num_tokens).sum(dim=-1)


class TokenSum(nn.Module):
    """Sums over the tokens of the micro batch, from sums over the tokens this layer sees: the
    same at one process. Under sequence (context) parallelism each tp (cp) rank sees a part of
    every sequence, and the parallel plan replaces this module by a sum over the parts
    (``SequenceSum`` style)."""

    def forward(self, partial_sums: torch.Tensor) -> torch.Tensor:
        return partial_sums


class StatisticsNeeded(NamedTuple):
    """Which per-token sums a layer's losses read: balancing (its scores and chosen counts, per
    sequence for ``seq_aux_loss``) and the z-loss."""

    balanced: bool = False
    per_sequence: bool = False
    z: bool = False


def statistics_needed(balancing_type: str, aux_coeff: float, z_coeff: float) -> StatisticsNeeded:
    balanced = balancing_type in ("aux_loss", "seq_aux_loss") and aux_coeff > 0
    return StatisticsNeeded(balanced, balanced and balancing_type == "seq_aux_loss", z_coeff > 0)


# The sums of ``token_statistics`` that gradients flow through: the balancing scores and the z-loss's
# logsumexp; the token and chosen counts are counts.
DIFFERENTIABLE_STATISTICS = ("scores", "z")


def token_statistics(logits: torch.Tensor, batch_size: int, topk: int, score_function: str, needed: StatisticsNeeded) -> dict[str, torch.Tensor]:
    """The sums over this layer's tokens the losses need (the reference of the router's fused kernel).

    ``logits`` [T, E] with T = batch_size * seq tokens in batch-major order (this layer's share of
    the sequence under sequence parallelism). The counts f_i come from the plain top-k of the
    balancing scores, not from the router's final choice (groups, bias and dropping left out), as
    Megatron-Core computes them; ``seq_aux_loss`` keeps one row of sums per sequence.
    """
    parts: dict[str, torch.Tensor] = {"tokens": logits.new_full((1,), logits.shape[0], dtype=torch.float32)}
    if needed.balanced:
        rows = batch_size if needed.per_sequence else 1
        scores = balancing_scores(logits, score_function)
        chosen = scores.topk(topk, dim=-1).indices.view(rows, -1)
        parts["scores"] = scores.view(rows, -1, scores.shape[-1]).sum(dim=1)
        # Counted by an integer scatter-add: exact, with no [rows, T*k, E] one-hot in between.
        parts["counts"] = chosen.new_zeros(rows, scores.shape[-1]).scatter_add_(1, chosen, torch.ones_like(chosen)).float()
    if needed.z:
        parts["z"] = torch.logsumexp(logits.float(), dim=-1).square().sum().reshape(1)
    return parts


def losses_from_statistics(parts: dict[str, torch.Tensor], topk: int, aux_coeff: float, z_coeff: float,
                           token_sum: nn.Module | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The layer's named losses, each already times its coefficient, from ``token_statistics``'
    sums; ``token_sum`` completes them over the whole sequence in one call (packed into one vector).

    The z-loss (ST-MoE) is the mean over tokens of logsumexp(logits)^2: it keeps logits small so
    the router's softmax stays in a range where bf16 rounding does not flip the top-k.
    """
    token_sum = token_sum or TokenSum()
    sums = token_sum(torch.cat([p.reshape(-1) for p in parts.values()])).split([p.numel() for p in parts.values()])
    # The token and chosen counts carry no gradient; detached, the backward skips the losses' terms in them.
    total = {name: (summed if name in DIFFERENTIABLE_STATISTICS else summed.detach()).view_as(part)
             for (name, part), summed in zip(parts.items(), sums)}  # fmt: skip
    num_tokens = total["tokens"][0]
    losses: dict[str, torch.Tensor] = {}
    if "scores" in total:
        per_row = num_tokens / total["scores"].shape[0]
        losses["load_balancing"] = aux_coeff * switch_aux_loss(total["scores"], total["counts"], per_row, topk).mean()
    if "z" in total:
        losses["z_loss"] = z_coeff * total["z"][0] / num_tokens
    return losses


SINKHORN_TOLERANCE = 1e-4
SINKHORN_MAX_ITERATIONS = 100_000  # Megatron-Core's loop has no bound; steep logits can take ~10^5 iterations
SINKHORN_CHECK_EVERY = 8  # iterations between reads of the stopping test: each read waits for the GPU


@torch.no_grad()
def sinkhorn(logits: torch.Tensor, token_sum: nn.Module | None = None) -> torch.Tensor:
    """Megatron-Core's Sinkhorn-Knopp plan for ``--moe-router-load-balancing-type sinkhorn``:
    exp(logits) [T, E] scaled per token (d0) and per expert (d1) until every token's row sums to
    1/T and every expert's column to 1/E, so a top-k of the plan spreads tokens evenly.

    The row sums are per token; the column sums and T are over the tokens of the micro batch,
    which ``token_sum`` completes from this rank's (the layer's ``TokenSum``: the sp/cp ranks'
    sum under the parallel plan). So every rank computes its rows of the one-process plan, and
    d1, its change (the stopping error) and the iteration count are the same on every rank.
    """
    token_sum = token_sum or TokenSum()
    cost = torch.exp(logits.float())
    eps = 1e-8
    num_tokens = token_sum(cost.new_tensor([cost.shape[0]]))
    num_experts = cost.shape[1]
    d1 = torch.ones(num_experts, dtype=cost.dtype, device=cost.device)
    iterates, errors = [], []
    for _ in range(SINKHORN_MAX_ITERATIONS):
        d0 = (1 / num_tokens) / (torch.sum(d1 * cost, 1) + eps)
        d1_old, d1 = d1, (1 / num_experts) / (token_sum(torch.sum(d0.unsqueeze(1) * cost, 0)) + eps)
        iterates.append((d0, d1))
        errors.append(torch.mean(torch.abs(d1_old - d1)))
        if len(errors) == SINKHORN_CHECK_EVERY:
            # One host sync for a block of iterations; the plan is still that of the first
            # iteration whose change met the tolerance, where Megatron-Core's loop stops.
            block = torch.stack(errors)
            converged = torch.nonzero(block <= SINKHORN_TOLERANCE)
            if converged.numel():
                d0, d1 = iterates[int(converged[0])]
                return d1 * cost * d0.unsqueeze(1)
            if not torch.isfinite(block[-1]):
                raise RuntimeError(_sinkhorn_failure("its scalings are not finite (router logits too large for exp, or not finite)"))
            iterates, errors = [], []
    raise RuntimeError(_sinkhorn_failure(f"it did not converge in {SINKHORN_MAX_ITERATIONS} iterations"))


def _sinkhorn_failure(why: str) -> str:
    return (f"--moe-router-load-balancing-type sinkhorn: no routing plan, {why}; "
            "add --moe-z-loss-coeff to keep the router's logits small, or use aux_loss")  # fmt: skip
