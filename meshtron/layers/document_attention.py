"""Causal attention inside packed documents through flex attention, on CUDA.

Packed sequences (``--sft``, ``--reset-attention-mask``) keep each token's attention inside its
own document. The dense path builds a [b, 1, s, s] boolean mask and hands it to SDPA, whose
fused flash and cuDNN kernels take no mask, so it runs the slower masked kernels over every
block, the ones between documents included. Flex attention gets the same rule as a block mask
(``kv <= q`` and the same ``document_ids``): blocks wholly across documents are skipped and no
dense mask exists. The dense SDPA path stays the reference (and the CPU path), and
``tests/gpu/test_document_attention_gpu.py`` compares the two, forward and backward.
"""

from __future__ import annotations

import torch

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch < 2.5
    flex_attention = None

_compiled_flex = None  # flex attention compiled once: uncompiled it runs an unfused reference
_last_mask: tuple | None = None  # (document_ids, block mask): every layer of a forward reuses one


def uses_flex(backend: str, causal: bool, dropout: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              document_ids: torch.Tensor | None) -> bool:  # fmt: skip
    """Whether ``CoreAttention`` attends through flex: packed documents, causal, on CUDA, the
    ``auto`` backend, no dropout (flex has none), as many keys as queries (no KV-cache prefix)
    and equal query and value head dims; q, k, v as ``attend`` gets them, [b, s, heads, d]."""
    return (
        flex_attention is not None and document_ids is not None and q.is_cuda and backend == "auto" and causal
        and dropout == 0.0 and q.shape[1] == k.shape[1] and v.shape[-1] == q.shape[-1]
    )  # fmt: skip


@torch.compiler.disable  # built eagerly once per forward, also inside a compiled block (``--compile``)
def document_block_mask(document_ids: torch.Tensor):
    """The flex block mask of causal attention within documents of ``document_ids`` [b, s]."""
    global _last_mask
    if _last_mask is not None and _last_mask[0] is document_ids:
        return _last_mask[1]

    def causal_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    b, s = document_ids.shape
    mask = create_block_mask(causal_same_document, b, None, s, s, device=document_ids.device)
    _last_mask = (document_ids, mask)
    return mask


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor,
                            scale: float | None = None) -> torch.Tensor:  # fmt: skip
    """q [b, heads, s, d], k/v [b, kv_heads, s, d] (grouped heads native) -> [b, heads, s, d]."""
    global _compiled_flex
    block_mask = document_block_mask(document_ids)
    gqa = k.shape[1] != q.shape[1]
    if torch.compiler.is_compiling():  # inside a compiled block: traced with it
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
