"""Cross-attention (encoder–decoder models): the decoder's tokens query the encoder's output.

It shares everything after the projections with self-attention (``SelfAttentionBase.attend``:
the mask, dropout, selective recompute and the core attention, bidirectional here); only where
q, k and v come from differs. Names follow Megatron-Core's ``CrossAttention``: ``linear_q`` on the
decoder's hidden states, ``linear_kv`` on the encoder's output, its rows laid out per head
([heads, (k, v), head_dim]) so a column split along whole heads gives each tensor-parallel rank
its heads' keys and values, and ``linear_proj`` back to the hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.config import ModelConfig
from meshtron.layers.attention import SelfAttentionBase, head_dim


class CrossAttention(SelfAttentionBase):
    """Multi-head attention of decoder block ``layer_number`` over the encoder's output (every
    real encoder token visible to every decoder token)."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__(cfg, layer_number, causal=False)
        self.head_dim = head_dim(cfg)
        width = cfg.num_attention_heads * self.head_dim
        self.linear_q = nn.Linear(cfg.hidden_size, width, bias=cfg.add_bias_linear)
        self.linear_kv = nn.Linear(cfg.hidden_size, 2 * width, bias=cfg.add_bias_linear)
        self.linear_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.add_bias_linear)

    def memory(self, encoder_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of ``encoder_output`` [b, t, hidden]: [b, t, heads, d] each. Heads
        are read off the projection's width, so a tensor-parallel ``linear_kv`` runs this unchanged.
        Generation computes them once per prompt (the encoder's output does not change)."""
        kv = self.linear_kv(encoder_output)
        kv = kv.view(*kv.shape[:2], -1, 2, self.head_dim)
        return kv[:, :, :, 0], kv[:, :, :, 1]

    def forward(self, x: torch.Tensor, encoder_output: torch.Tensor | None, encoder_padding_mask: torch.Tensor | None = None,
                memory: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """x [b, s, hidden] -> [b, s, hidden]. ``encoder_padding_mask`` [b, t]: True at real
        encoder tokens. ``memory``: keys and values from ``memory`` already (then ``encoder_output``
        is not read)."""
        q = self.linear_q(x)
        q = q.view(*q.shape[:2], -1, self.head_dim)
        k, v = memory if memory is not None else self.memory(encoder_output)
        return self.linear_proj(self.attend(q, k, v, None, encoder_padding_mask))
