"""Preallocated key/value cache for incremental decoding.

Allocated once for the longest sequence a generation may reach, so each decoding step writes
one slot per layer instead of concatenating (and reallocating) the whole history.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer, [batch, max_length, kv_heads, head_dim] each.

    ``length`` counts the positions already written. Every layer writes its new chunk at
    ``length`` through ``update``; the model calls ``advance`` once all layers have seen the chunk.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_length: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        shape = (batch_size, max_length, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_length = max_length
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this chunk's k/v [b, s, kv_heads, d] for ``layer``; return all keys/values so far."""
        end = self.length + k.shape[1]
        if end > self.max_length:
            raise ValueError(f"KV cache holds {self.max_length} positions; cannot write up to {end}")
        self.keys[layer][:, self.length : end] = k
        self.values[layer][:, self.length : end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens
