"""Per-token statistics summed over the whole sequence, from the part of it this rank sees: the
parallel module of the contract's ``SequenceSum`` (a balancing loss's expert counts, mean router
probabilities and z-loss sums over a micro batch's tokens).

Two kinds of rank hold other tokens of the same sequences, and their sums differ in backward
because the runner counts their copies of the loss differently:

- sequence parallelism (tp): the tp ranks of one micro batch are replicas of one loss, counted
  once; each backwards its own shard's part and the sequence-partial parameter gradients are added
  up over tp afterwards, so the sum's backward is the identity (``reduce_from_tp_region``);
- context parallelism (cp): each cp rank's auxiliary terms are a share of the objective (the
  runner divides them by dp x cp), so the gradient of the statistics of rank r is the sum of every
  share's gradient: the sum's backward is again a sum over cp. With the parameter gradients summed
  over dp x cp this is the one-process gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.parallel.tensor_parallel import reduce_from_tp_region, sum_over_shares


class SequenceShardSum(nn.Module):
    """Sums over this rank's tokens -> sums over every token of its micro batch's sequences:
    summed over the tp group under sequence parallelism (``tp_group``, else None), then over the
    cp group under context parallelism (``cp_group``, else None)."""

    def __init__(self, tp_group, cp_group):
        super().__init__()
        self.tp_group, self.cp_group = tp_group, cp_group

    def forward(self, partial_sums: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            partial_sums = reduce_from_tp_region(partial_sums, self.tp_group)
        if self.cp_group is not None:
            partial_sums = sum_over_shares(partial_sums, self.cp_group)
        return partial_sums
