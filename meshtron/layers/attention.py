"""Self-attention with grouped-query heads, RoPE, packed-document masks and a KV cache: causal
(decoders) or bidirectional over the real tokens of padded sequences (encoders, ``causal=False``).

Parameter names follow Megatron-Core (``linear_qkv``, ``linear_proj``), and so does the layout of
the fused QKV output: per key/value group, that group's query heads, then its key head, then its
value head ([groups, heads_per_group + 2, head_dim]). A column split of ``linear_qkv`` along whole
groups therefore gives each tensor-parallel rank complete heads, and Megatron checkpoints map
onto it without reshuffling.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from meshtron.config import ModelConfig, recomputes_core_attention
from meshtron.kernels import platform
from meshtron.layers.document_attention import flex_document_attention, uses_flex
from meshtron.layers.kv_cache import KVCache
from meshtron.layers.norms import FullWidthRMSNorm, build_norm
from meshtron.layers.rope import apply_rotary


_SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= "2.5"
_SDPA_KERNELS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def auto_order() -> list[SDPBackend]:
    """``auto``'s SDPA kernels on a GPU, first choice first: cuDNN (on an H100, causal d128
    fwd+bwd: cuDNN 419 TFLOP/s, flash 239, mem-efficient 121; see BENCHMARKS.md), then whatever
    takes the inputs. ROCm has no cuDNN attention and starts at flash (AOTriton or CK)."""
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.CUDNN_ATTENTION, *fused] if platform.cudnn_attention() else fused


def pads_values(backend: str, device: torch.device, qk_dim: int, v_dim: int) -> bool:
    """Whether values narrower than q/k (MLA's 128 against 192) are zero-padded to their width for
    flash, which takes only equal widths: under ``flash``, and under ``auto`` on a GPU without
    cuDNN attention (ROCm: padded flash rather than the memory-efficient kernel, 6.2 ms against
    28 ms on an H100, see layers/mla.py; where cuDNN exists it takes the widths as they are)."""
    if v_dim >= qk_dim:
        return False
    return backend == "flash" or (backend == "auto" and device.type == "cuda" and not platform.cudnn_attention())


# torch's SDPA switches: the name in its flag getter and setter, and the kernel each switches.
_SDPA_FLAGS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "mem_efficient": "EFFICIENT_ATTENTION", "math": "MATH",
               "overrideable": "OVERRIDEABLE"}  # fmt: skip


class SdpaOrder:
    """``sdpa_kernel(backends, set_priority=True)``: only ``backends``, tried in their order, for the
    calls inside, the switches and order before restored after; the same torch calls without that
    context manager's Python, which cost about 60 µs (against 5) on a 2-core host, once per attention
    forward."""

    def __init__(self, backends: list[SDPBackend]):
        flags = [name for name in _SDPA_FLAGS if hasattr(torch._C, f"_set_sdp_use_{name}")]  # those this torch has
        self.getters = [getattr(torch._C, f"_get_{name}_sdp_enabled") for name in flags]
        self.setters = [getattr(torch._C, f"_set_sdp_use_{name}") for name in flags]
        self.enabled = [getattr(SDPBackend, _SDPA_FLAGS[name]) in backends for name in flags]
        self.priority = [int(kernel) for kernel in backends]
        self.saved: list[tuple[list[bool], list[int]]] = []

    def __enter__(self) -> None:
        before = torch._C._get_sdp_priority_order()
        self.saved.append(([get() for get in self.getters], before))
        for set_flag, on in zip(self.setters, self.enabled):
            set_flag(on)
        torch._C._set_sdp_priority_order(self.priority + [kernel for kernel in before if kernel not in self.priority])

    def __exit__(self, *_exc) -> None:
        enabled, priority = self.saved.pop()
        for set_flag, on in zip(self.setters, enabled):
            set_flag(on)
        torch._C._set_sdp_priority_order(priority)


def sdpa_backends(backend: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels ``model.attention_backend`` allows: one named kernel (an error if it cannot
    take the inputs), the ``auto`` priority order on a GPU, or torch's own choice (``sdpa``, CPU)."""
    if backend in _SDPA_KERNELS:
        return sdpa_kernel([_SDPA_KERNELS[backend]])
    if backend == "auto" and device.type == "cuda":
        if torch.compiler.is_compiling():  # dynamo traces torch's context manager, not the switches it sets
            return sdpa_kernel(auto_order(), set_priority=True)
        return _sdpa_order(tuple(auto_order()))
    return contextlib.nullcontext()


@functools.cache
def _sdpa_order(backends: tuple[SDPBackend, ...]) -> SdpaOrder:
    """One ``SdpaOrder`` per order, reused by every call (it keeps a stack of what it restores)."""
    return SdpaOrder(list(backends))


def head_dim(cfg: ModelConfig) -> int:
    return cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads


def num_kv_heads(cfg: ModelConfig) -> int:
    return cfg.num_query_groups or cfg.num_attention_heads


def qk_norm_widths(cfg: ModelConfig) -> tuple[int, int]:
    """The widths of standard attention's ``--qk-layernorm`` weights, (q norm, k norm): one head's
    ``head_dim`` each (span ``head``, Qwen3's), or every query head's and every kv head's (``full``, OLMoE's)."""
    d = head_dim(cfg)
    return (cfg.num_attention_heads * d, num_kv_heads(cfg) * d) if cfg.qk_layernorm_span == "full" else (d, d)


def attention_config_errors(cfg: ModelConfig) -> list[str]:
    """What keeps ``cfg``'s q/k norm span and q/k/v clipping from running, each naming what to change."""
    errors = []
    if cfg.qk_layernorm_span not in ("head", "full"):
        errors.append(f"model.qk_layernorm_span must be head (a norm per head, Qwen3's) or full (one over all heads, OLMoE's), "
                      f"got '{cfg.qk_layernorm_span}'")  # fmt: skip
    if cfg.qk_layernorm_span == "full":
        if not cfg.qk_layernorm:
            errors.append("model.qk_layernorm_span full sets how --qk-layernorm norms q and k; add --qk-layernorm or drop it")
        if cfg.multi_latent_attention:
            errors.append("model.qk_layernorm_span full applies to standard attention; with --multi-latent-attention "
                          "--qk-layernorm norms the latents: set model.qk_layernorm_span head")  # fmt: skip
        if cfg.normalization != "RMSNorm":
            errors.append(f"model.qk_layernorm_span full norms q and k with RMSNorm (OLMoE's); use --normalization RMSNorm "
                          f"(got {cfg.normalization}) or model.qk_layernorm_span head")  # fmt: skip
    if cfg.clip_qkv < 0:
        errors.append(f"model.clip_qkv must be positive (clamp q, k, v to [-clip, clip]) or 0 (off), got {cfg.clip_qkv}")
    if cfg.clip_qkv and cfg.multi_latent_attention:
        errors.append("model.clip_qkv clamps standard attention's q, k and v; --multi-latent-attention has no such clamp: set it to 0")
    return errors


def attention_mask(
    q_len: int,
    kv_len: int,
    document_ids: torch.Tensor | None = None,
    device: torch.device | None = None,
    causal: bool = True,
    padding_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask (True = may attend), broadcastable to [b, 1, q_len, kv_len]; with ``bias``
    (additive scores [1, heads, q_len, kv_len], T5's relative positions) that bias instead, -inf
    where the boolean mask forbids a key: the float mask SDPA adds to the scaled scores.

    Causal: the queries are the last ``q_len`` of ``kv_len`` positions (a chunk after a cached
    prefix), so query ``i`` sees keys up to ``kv_len - q_len + i``. With ``document_ids`` [b, s]
    (packed sequences, Megatron's ``--reset-attention-mask``) a token also sees only its own
    document. With ``padding_mask`` [b, kv_len] (True at real tokens) no query sees a padding key;
    an encoder's mask stays [b, 1, 1, kv_len], which SDPA broadcasts without materializing.
    """
    mask = None
    if causal:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        mask = (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None])[None, None]
    if document_ids is not None:
        same_doc = (document_ids[:, -q_len:, None] == document_ids[:, None, :])[:, None]
        mask = same_doc if mask is None else mask & same_doc
    if padding_mask is not None:
        real_keys = padding_mask[:, None, None, :].bool()
        mask = real_keys if mask is None else mask & real_keys
    if bias is not None:
        return bias if mask is None else torch.where(mask, bias, float("-inf"))
    return torch.ones((1, 1, q_len, kv_len), dtype=torch.bool, device=device) if mask is None else mask


class CoreAttention(nn.Module):
    """softmax(q k^T * scale) v on [b, heads, s, d], by ``model.attention_backend``; ``scale``
    None means 1/sqrt(qk head dim).

    A module of its own so that a parallel plan can replace it (context parallelism attends
    across ranks) and activation recompute can wrap it (``--recompute-granularity selective``).
    k, v may have fewer heads (GQA): query head i reads kv head i // group_size. Without a mask
    it is causal (SDPA's ``is_causal``, which lets the fused kernels skip the upper triangle)
    unless built with ``causal=False``.
    """

    def __init__(self, backend: str, scale: float | None = None, causal: bool = True):
        super().__init__()
        self.backend, self.scale, self.causal = backend, scale, causal

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``mask`` already holds ``document_ids``; they are passed for a replacement core (context
        parallelism) whose keys span other ranks' tokens, and, with no mask, for flex attention
        (``meshtron.layers.document_attention``).

        Grouped heads go to SDPA as they are (``enable_gqa``) when there is no mask, as the flash
        and cuDNN kernels read each kv head for its whole group; with a mask they are repeated,
        since the kernels that take a mask do not all take groups.
        """
        if self.backend == "math":
            return math_attention(q, k, v, mask, dropout, self.scale)
        if mask is None and document_ids is not None:  # the attention module chose flex (``uses_flex``)
            return flex_document_attention(q, k, v, document_ids, self.scale)
        group_size = q.shape[1] // k.shape[1]
        if group_size > 1 and (mask is not None or not _SDPA_HAS_GQA):
            k, v = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        scale = {"scale": self.scale} if self.scale is not None else {}
        v_dim = v.shape[-1]
        if pads_values(self.backend, q.device, q.shape[-1], v_dim):  # zero columns of v give zero outputs
            v = F.pad(v, (0, q.shape[-1] - v_dim))
        with sdpa_backends(self.backend, q.device):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None and self.causal, **gqa, **scale)
        return out[..., :v_dim] if out.shape[-1] != v_dim else out


class SelfAttentionBase(nn.Module):
    """What every self-attention does once it has q, k and v: the mask, dropout, selective
    recompute and the core. ``Attention`` and ``MultiLatentAttention`` differ only before.
    ``softmax_scale`` None means 1/sqrt(qk head dim). ``causal=False``: bidirectional (BERT's
    encoder), attending to every real token of the sequence.
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, softmax_scale: float | None = None, causal: bool = True):
        super().__init__()
        self.layer_number, self.causal = layer_number, causal
        self.backend = cfg.attention_backend
        self.fused_kernels = cfg.fused_kernels
        self.recompute_core = recomputes_core_attention(cfg)
        self.dropout = cfg.attention_dropout
        self.core_attention = CoreAttention(cfg.attention_backend, softmax_scale, causal)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None,
               padding_mask: torch.Tensor | None = None, position_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """q [b, s, heads, d], k [b, t, kv_heads, d], v [b, t, kv_heads, dv] -> [b, s, heads * dv].

        The queries are the last s of t positions (t > s after a KV-cache prefix). ``padding_mask``
        [b, t]: True at the real tokens, the only keys a query sees. ``position_bias`` [1, heads,
        s, t]: added to the scaled scores (T5's relative positions), so the mask becomes a float one.
        """
        s = q.shape[1]
        # Plain attention over the chunk itself (causal, or bidirectional without padding) needs
        # no mask tensor: SDPA's is_causal (or nothing) lets the fused (flash, cuDNN) kernels run.
        # Packed documents on CUDA go to flex attention, which takes their rule without a mask tensor.
        mask = None
        dropout = self.dropout if self.training else 0.0
        flex = padding_mask is None and position_bias is None and uses_flex(self.backend, self.causal, dropout, q, k, v, document_ids)
        bias = None if position_bias is None else position_bias.to(q.dtype)
        if not flex and (document_ids is not None or padding_mask is not None or bias is not None or k.shape[1] != s
                         or self.backend == "math"):  # fmt: skip
            mask = attention_mask(s, k.shape[1], document_ids, q.device, self.causal, padding_mask, bias)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, s, d]
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self.core_attention, q, k, v, mask, dropout, document_ids, use_reentrant=False)
        else:
            out = self.core_attention(q, k, v, mask, dropout, document_ids)
        return out.transpose(1, 2).flatten(2)


class Attention(SelfAttentionBase):
    """Self-attention of block ``layer_number`` (0-based; it picks this layer's KV-cache slot);
    bidirectional with ``causal=False``."""

    def __init__(self, cfg: ModelConfig, layer_number: int, causal: bool = True):
        super().__init__(cfg, layer_number, causal=causal)
        heads, kv_heads = cfg.num_attention_heads, num_kv_heads(cfg)
        self.queries_per_group = heads // kv_heads
        self.head_dim = head_dim(cfg)
        self.use_rope = cfg.position_embedding_type == "rope"
        qkv_out = (heads + 2 * kv_heads) * self.head_dim
        self.linear_qkv = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.add_bias_linear or cfg.add_qkv_bias)
        self.linear_proj = nn.Linear(heads * self.head_dim, cfg.hidden_size, bias=cfg.add_bias_linear)
        # --qk-layernorm (Megatron-Core's; Qwen3's q_norm / k_norm): one norm over each head's
        # head_dim, shared by the heads, on q and on k before RoPE; with span "full" (OLMoE's) one
        # RMSNorm over all query heads and one over all kv heads.
        self.full_width_norms = cfg.qk_layernorm and cfg.qk_layernorm_span == "full"
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:
            self.q_layernorm, self.k_layernorm = (
                FullWidthRMSNorm(width, cfg.norm_epsilon) if self.full_width_norms
                else build_norm(cfg.normalization, width, cfg.norm_epsilon, cfg.fused_kernels) for width in qk_norm_widths(cfg)
            )  # fmt: skip
        self.clip_qkv = cfg.clip_qkv

    def _local_groups(self, qkv_heads: int) -> tuple[int, int]:
        """(kv groups, queries per group) of the fused projection's output, ``qkv_heads`` heads wide.

        Read off the output rather than the config, so that a tensor-parallel ``linear_qkv``
        holding some whole groups, or (fewer kv heads than ranks) part of one group's queries with
        its k and v, runs this code unchanged: whole groups divide the width by queries + 2, and
        a part of one group is always narrower than a whole group.
        """
        per_group = self.queries_per_group + 2
        groups = qkv_heads // per_group if qkv_heads % per_group == 0 else 1
        return groups, qkv_heads // groups - 2

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        padding_mask: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [b, s, hidden] -> [b, s, hidden]. ``cos``/``sin`` are the RoPE tables (unused without RoPE);
        ``padding_mask`` [b, s] marks the real tokens of padded sequences (encoders);
        ``position_bias`` is added to the attention scores (``attend``).

        With ``kv_cache``, x is the next chunk of a sequence whose earlier keys/values are cached:
        its k/v are stored and its queries attend to the whole prefix.
        """
        # The sequence length is read off the projection's output too: with sequence parallelism
        # a column-parallel ``linear_qkv`` gathers the whole sequence from shards.
        qkv = self.linear_qkv(x)
        b, s = qkv.shape[:2]
        groups, group_size = self._local_groups(qkv.shape[-1] // self.head_dim)
        qkv = qkv.view(b, s, groups, group_size + 2, self.head_dim)
        # One split (its backward writes the three gradients into one buffer with a single cat),
        # not slices and selects, whose backwards each zero-fill a whole qkv-sized gradient.
        q, k, v = qkv.split([group_size, 1, 1], dim=3)
        q, k, v = q.flatten(2, 3), k.squeeze(3), v.squeeze(3)
        if self.full_width_norms:  # over this rank's heads' columns, completed over tp by the norm's head_sum
            q, k = self.q_layernorm(q.flatten(2)).view_as(q), self.k_layernorm(k.flatten(2)).view_as(k)
        elif self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.clip_qkv:  # OLMo's clip_qkv: after the norms, before RoPE
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        if self.use_rope:
            q = apply_rotary(q, cos, sin, position_ids, self.fused_kernels)
            k = apply_rotary(k, cos, sin, position_ids, self.fused_kernels)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_number, k, v)
        return self.linear_proj(self.attend(q, k, v, document_ids, padding_mask, position_bias))


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, dropout: float = 0.0, scale: float | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v in fp32 (scale 1/sqrt(d) by default): the reference every
    faster backend must match. A float ``mask`` is added to the scaled scores (SDPA's rule)."""
    group_size = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)
    scores = q.float() @ k.float().transpose(-2, -1)
    scores = scores / math.sqrt(q.shape[-1]) if scale is None else scores * scale
    scores = scores + mask.float() if mask.is_floating_point() else scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    probs = F.dropout(probs, dropout)
    return (probs @ v.float()).to(q.dtype)
