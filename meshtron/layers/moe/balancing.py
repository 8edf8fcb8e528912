"""Load-balancing and router z-losses, as differentiable scalars the model reports by name.

Nothing here adds to a global: the layer hands its losses to the model, which reports them as
named auxiliary terms of its loss. That keeps them right under pipeline parallelism and
recomputation, where MegaBlocks' global list of per-layer statistics went wrong.

Scales are Megatron-Core's: each MoE layer's loss is ``coeff * E * sum_i f_i * P_i`` over the
tokens that layer sees (one micro-batch on one rank), the layers' losses add up (the total grows
with the number of MoE layers), and a micro-batch's terms are weighted as its language-model
loss is (Megatron scales them by 1/num_micro_batches, as the LM loss). MegaBlocks'
``--moe-loss-weight w`` averages over the layers instead: a per-layer coefficient of
``w / num_moe_layers`` (``aux_loss_coeff``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def switch_aux_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: int, topk: int) -> torch.Tensor:
    """Switch/GShard loss ``E * sum_i f_i * P_i`` (1 when perfectly balanced), before its coefficient.

    f_i = tokens_per_expert_i / (num_tokens * k) is a count and carries no gradient; P_i = the mean
    of ``scores`` [T, E] over tokens does. ``tokens_per_expert`` and ``num_tokens`` may cover more
    tokens than ``scores`` (a sequence-parallel runner sums the counts over its group first).
    """
    num_experts = scores.shape[-1]
    fraction = tokens_per_expert.float() / (num_tokens * topk)
    mean_prob = scores.sum(dim=0) / num_tokens
    return num_experts * (fraction * mean_prob).sum()


def sequence_aux_loss(scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """DeepSeek's sequence-wise balance loss: the switch loss of each sequence, averaged over them.

    ``scores`` [b, s, E], ``chosen`` [b, s, k] expert ids. Balancing each sequence, not only the
    micro-batch, stops one long document from sending all its tokens to the same few experts.
    """
    b, s, num_experts = scores.shape
    k = chosen.shape[-1]
    counts = F.one_hot(chosen.reshape(b, s * k), num_experts).sum(dim=1)  # [b, E]
    fraction = counts.float() / (s * k)
    mean_prob = scores.mean(dim=1)
    return num_experts * (fraction * mean_prob).sum(dim=-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss, mean over tokens of logsumexp(logits)^2: keeps logits small so the
    router's softmax stays in a range where bf16 rounding does not flip the top-k."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def balancing_losses(
    logits: torch.Tensor,
    batch_size: int,
    topk: int,
    score_function: str,
    balancing_type: str,
    aux_coeff: float,
    z_coeff: float,
) -> dict[str, torch.Tensor]:
    """The layer's named losses, each already times its coefficient; a zero coefficient omits it.

    ``logits`` [T, E] with T = batch_size * seq tokens in batch-major order. The counts f_i come
    from the plain top-k of the balancing scores, not from the router's final choice (groups,
    bias and dropping left out), as Megatron-Core computes them.
    """
    losses: dict[str, torch.Tensor] = {}
    if balancing_type != "none" and aux_coeff > 0:
        scores = balancing_scores(logits, score_function)
        chosen = scores.topk(topk, dim=-1).indices
        if balancing_type == "seq_aux_loss":
            loss = sequence_aux_loss(scores.view(batch_size, -1, scores.shape[-1]), chosen.view(batch_size, -1, topk))
        else:
            counts = torch.bincount(chosen.flatten(), minlength=scores.shape[-1])
            loss = switch_aux_loss(scores, counts, scores.shape[0], topk)
        losses["load_balancing"] = aux_coeff * loss
    if z_coeff > 0:
        losses["z_loss"] = z_coeff * z_loss(logits)
    return losses
