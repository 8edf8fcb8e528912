"""Preallocated caches for incremental decoding: per-head keys/values, or MLA's latents.

Allocated once for the longest sequence a generation may reach, so each decoding step writes
one slot per layer instead of concatenating (and reallocating) the whole history.
"""

from __future__ import annotations

import torch


class KVCacheBase:
    """The protocol every cache keeps with the model: ``length`` counts the positions already
    written; every layer writes its new chunk at ``length`` through ``update``; the model calls
    ``advance`` once all layers have seen the chunk."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.length = 0

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def _end(self, num_tokens: int) -> int:
        end = self.length + num_tokens
        if end > self.max_length:
            raise ValueError(f"KV cache holds {self.max_length} positions; cannot write up to {end}")
        return end


class KVCache(KVCacheBase):
    """Keys and values of every layer, [batch, max_length, kv_heads, head_dim] each."""

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
        super().__init__(max_length)
        shape = (batch_size, max_length, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this chunk's k/v [b, s, kv_heads, d] for ``layer``; return all keys/values so far."""
        end = self._end(k.shape[1])
        self.keys[layer][:, self.length : end] = k
        self.values[layer][:, self.length : end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]


class LatentKVCache(KVCacheBase):
    """Multi-head latent attention's cache: per layer and token, the normed kv latent and the
    rotated RoPE key shared by all heads, side by side in one row of kv_lora_rank + rope_dim
    numbers (DeepSeek-V2: 576, against 2 x 16 heads x 128 for per-head keys and values).

    One row per token lets the absorbed decoding path read the rows as the single key head of
    multi-query attention, and their first ``kv_lora_rank`` columns as its value head.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_length: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__(max_length)
        shape = (batch_size, max_length, kv_lora_rank + rope_dim)
        self.rows = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def update(self, layer: int, latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """Store this chunk's latent [b, s, kv_lora_rank] and rotated rope key [b, s, rope_dim]
        for ``layer``; return every row so far, [b, t, kv_lora_rank + rope_dim]."""
        end = self._end(latent.shape[1])
        rows = self.rows[layer]
        rank = latent.shape[-1]
        rows[:, self.length : end, :rank] = latent
        rows[:, self.length : end, rank:] = k_rope
        return rows[:, :end]
