"""T5's relative position bias: a learned scalar per (distance bucket, head) added to the
attention scores of every layer of a stack (Megatron's ``RelativePositionEmbedding``,
``--position-embedding-type relative``).

A key's distance from its query falls into one of ``num_buckets`` buckets: exact buckets for
the nearest half, then buckets logarithmically wider up to ``max_distance``, beyond which all
distances share the last. Bidirectional (an encoder) spends half the buckets on keys after the
query; unidirectional (a causal decoder) spends them all on keys before it.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Bucket of each ``key_position - query_position`` (integer tensor) as T5 buckets it."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class RelativePositionBias(nn.Module):
    """One stack's table ``weight`` [num_buckets, heads] and the bias it gives the attention
    scores. Under tensor parallelism a rank holds its own heads' columns and reads them only."""

    def __init__(self, num_buckets: int, max_distance: int, num_heads: int, bidirectional: bool):
        super().__init__()
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.weight = nn.Parameter(torch.empty(num_buckets, num_heads))

    def forward(self, q_len: int, kv_len: int) -> torch.Tensor:
        """The bias [1, heads, q_len, kv_len] of queries at the last ``q_len`` of ``kv_len``
        positions (a chunk after a cached prefix, as ``attention_mask`` places them)."""
        keys = torch.arange(kv_len, device=self.weight.device)
        relative = keys[None, :] - keys[kv_len - q_len :, None]
        buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        # Contiguous: the GPU's fused SDPA kernels take a float mask only with a unit last stride.
        return self.weight[buckets].permute(2, 0, 1).contiguous()[None]

    def extra_repr(self) -> str:
        return f"buckets={self.num_buckets}, max_distance={self.max_distance}, heads={self.weight.shape[1]}, bidirectional={self.bidirectional}"
