"""Causal self-attention with grouped-query heads, RoPE, packed-document masks and a KV cache.

Parameter names follow Megatron-Core (``linear_qkv``, ``linear_proj``), and so does the layout of
the fused QKV output: per key/value group, that group's query heads, then its key head, then its
value head ([groups, heads_per_group + 2, head_dim]). A column split of ``linear_qkv`` along whole
groups therefore gives each tensor-parallel rank complete heads, and Megatron checkpoints map
onto it without reshuffling.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import ModelConfig
from meshtron.layers.kv_cache import KVCache
from meshtron.layers.rope import apply_rotary


def head_dim(cfg: ModelConfig) -> int:
    return cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads


def num_kv_heads(cfg: ModelConfig) -> int:
    return cfg.num_query_groups or cfg.num_attention_heads


def attention_mask(
    q_len: int, kv_len: int, document_ids: torch.Tensor | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Boolean mask (True = may attend), [1 or b, 1, q_len, kv_len].

    The queries are the last ``q_len`` of ``kv_len`` positions (a chunk after a cached prefix),
    so query ``i`` sees keys up to ``kv_len - q_len + i``. With ``document_ids`` [b, s] (packed
    sequences, Megatron's ``--reset-attention-mask``) a token also sees only its own document.
    """
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    mask = (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None])[None, None]
    if document_ids is not None:
        same_doc = document_ids[:, -q_len:, None] == document_ids[:, None, :]
        mask = mask & same_doc[:, None]
    return mask


class Attention(nn.Module):
    """Self-attention of block ``layer_number`` (0-based; it picks this layer's KV-cache slot)."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = num_kv_heads(cfg)
        self.head_dim = head_dim(cfg)
        self.use_rope = cfg.position_embedding_type == "rope"
        self.backend = cfg.attention_backend
        self.dropout = cfg.attention_dropout
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.linear_qkv = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.add_bias_linear)
        self.linear_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """x [b, s, hidden] -> [b, s, hidden]. ``cos``/``sin`` are the RoPE tables (unused without RoPE).

        With ``kv_cache``, x is the next chunk of a sequence whose earlier keys/values are cached:
        its k/v are stored and its queries attend to the whole prefix.
        """
        group_size = self.num_heads // self.num_kv_heads
        # Head counts and the sequence length are read off the projection's output, not the
        # config or x, so that a column-parallel ``linear_qkv`` holding only some groups (and,
        # with sequence parallelism, gathering the whole sequence from shards) runs this code.
        qkv = self.linear_qkv(x)
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, -1, group_size + 2, self.head_dim)
        q = qkv[:, :, :, :group_size].flatten(2, 3)
        k, v = qkv[:, :, :, group_size], qkv[:, :, :, group_size + 1]
        if self.use_rope:
            q = apply_rotary(q, cos, sin, position_ids)
            k = apply_rotary(k, cos, sin, position_ids)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_number, k, v)
        # Plain causal attention over the chunk itself needs no mask tensor: SDPA's is_causal
        # lets the fused (flash) kernels run.
        mask = None
        if document_ids is not None or k.shape[1] != s or self.backend == "math":
            mask = attention_mask(s, k.shape[1], document_ids, x.device)
        # [b, s, heads, d] -> [b, heads, s, d]; kv heads repeated to one per query head (query
        # head i reads group i // group_size), which every SDPA backend accepts.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if group_size > 1:
            k, v = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)
        dropout = self.dropout if self.training else 0.0
        if self.backend == "math":
            out = math_attention(q, k, v, mask, dropout)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None)
        return self.linear_proj(out.transpose(1, 2).flatten(2))


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), masked) v in fp32: the reference every faster backend must match."""
    scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    probs = F.dropout(probs, dropout)
    return (probs @ v.float()).to(q.dtype)
