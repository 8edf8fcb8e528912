"""Context parallelism: each sequence split over the ``cp`` ranks, attention computed across them.

Everything in a transformer block but attention works token by token, so with the sequence split
over ``cp`` ranks only attention needs the other ranks: a query must see the keys and values of
every earlier token, wherever it lives. Two ways of getting them there are offered (Megatron's
``--cp-comm-type``), both exact:

- ``p2p`` (``ring_attention``): the key/value blocks travel around the cp ring, one hop per step,
  while each rank attends its queries to the block it holds; partial results are merged with
  their log-sum-exp (online softmax, fp32), so no rank ever holds more than two blocks. Backward
  runs the ring again; the key/value gradients travel with their blocks and arrive home at the end.
- ``all_gather`` (``allgather_kv_attention``): all-gather the keys and values, one masked
  attention. Simpler and fewer, larger messages, but the whole sequence's k/v on every rank.

Which is faster depends on the sequence length and the interconnect; that is for a GPU benchmark
to decide (pending), not this file.

Load balance: with causal attention the last tokens do the most work. Each sequence is cut into
``2 * cp`` chunks and rank ``r`` keeps chunks ``r`` and ``2cp-1-r``, so every rank holds one early
and one late chunk and every ring step costs every rank the same (Megatron's scheme). Then, at
ring step ``i`` rank ``r`` holds the block of rank ``src = r - i``:

- ``src == r``: its own chunks, causal (the local order is increasing in global position);
- ``src < r``: both local query chunks come after the block's first chunk and before its second:
  all queries against the first half of the keys, unmasked;
- ``src > r``: the block's two chunks both lie between the local two: only the second half of the
  queries, against all the keys, unmasked.

Packed documents (``document_ids``) add a same-document mask to each block; the ids of every rank
are all-gathered once (a few integers per token).

The math per block is plain PyTorch in fp32 (it runs, and is tested, on the CPU); a fused GPU
kernel returning its log-sum-exp (flash-attention's forward/backward) would replace
``_block_forward`` / ``_block_backward`` and nothing else.

How training uses it: ``shard_batch_for_cp`` gives each rank its tokens (with their global
positions, so RoPE and learned positions stay right); ``apply_context_parallel`` routes each
attention module's core through one of the two algorithms; per-token losses come out for the
local tokens only, so the trainer divides the masked loss sum by the token count all-reduced over
``dp x cp``, and gradients are summed over ``mesh.dp_cp_group`` (the data-parallel buffer's group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshtron.config import ConfigError
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.tensor_parallel import all_gather_sequence

ALGORITHMS = ("p2p", "all_gather")

# ---------------------------------------------------------------------- sharding the batch


def cp_token_index(seq_len: int, cp_size: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of rank ``cp_rank``'s tokens: chunks ``r`` and ``2cp-1-r`` of ``2cp``."""
    if seq_len % (2 * cp_size):
        raise ConfigError(
            f"--seq-length {seq_len} must be a multiple of 2 x --context-parallel-size = {2 * cp_size} (each sequence "
            f"is cut into {2 * cp_size} equal chunks for load balance); change the sequence length or the cp size"
        )
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device), torch.arange(second, second + chunk, device=device)])


def shard_batch_for_cp(batch: dict[str, torch.Tensor], mesh: Mesh, seq_dim: int = 1) -> dict[str, torch.Tensor]:
    """This cp rank's tokens of every [b, s, ...] tensor of ``batch`` (tokens, labels, loss_mask,
    position_ids, document_ids, ...), along ``seq_dim``.

    ``position_ids`` is added when absent (the global positions of the kept tokens): the model
    would otherwise number the local tokens from 0. Present ones (reset at document starts) are
    sharded like the rest. At cp 1 the batch is returned as it is.
    """
    if mesh.cp_size == 1:
        return batch
    tokens = batch["tokens"]
    seq_len = tokens.shape[seq_dim]
    index = cp_token_index(seq_len, mesh.cp_size, mesh.cp_rank, tokens.device)
    out = {}
    for name, t in batch.items():
        if t is None:
            continue
        if t.shape[seq_dim] != seq_len:
            raise ValueError(f"batch['{name}'] has {t.shape[seq_dim]} positions along dim {seq_dim}, tokens have {seq_len}")
        out[name] = t.index_select(seq_dim, index.to(t.device))
    if out.get("position_ids") is None:
        out["position_ids"] = index.expand(tokens.shape[:seq_dim] + index.shape)
    return out


def unshard_sequence(x: torch.Tensor, mesh: Mesh, dim: int = 1) -> torch.Tensor:
    """The inverse of the sharding: every cp rank's part of ``x`` put back in sequence order
    (per-token losses, for logging or a test). Collective over cp; not differentiable."""
    if mesh.cp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(mesh.cp_size)]
    dist.all_gather(parts, x.contiguous(), group=mesh.cp_group)
    seq_len = x.shape[dim] * mesh.cp_size
    index = torch.cat([cp_token_index(seq_len, mesh.cp_size, r, x.device) for r in range(mesh.cp_size)])
    shape = list(x.shape)
    shape[dim] = seq_len
    return x.new_empty(shape).index_copy_(dim, index, torch.cat(parts, dim=dim))


# ---------------------------------------------------------------------- attention of one block
# Layout of the math: q [b, kv_heads, group, s_q, d] against k/v [b, kv_heads, 1, s_k, d], so a
# key/value head serves its group of query heads by broadcasting (no repeated copies), and its
# gradient is a sum over the group.


def _grouped_q(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, s, heads, d] -> fp32 [b, kv_heads, heads // kv_heads, s, d] (query head i reads kv head i // group)."""
    b, s, h, d = x.shape
    return x.float().view(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)


def _ungroup(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``_grouped_q``: [b, kv_heads, group, s, d] -> [b, s, heads, d] in ``dtype``."""
    b, hk, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hk * g, d).to(dtype)


def _grouped_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., b, s, kv_heads, d] -> fp32 [..., b, kv_heads, 1, s, d]."""
    return x.float().transpose(-3, -2).unsqueeze(-3)


def _block_mask(q_docs, k_docs, diagonal: bool, s_q: int, s_k: int, device) -> torch.Tensor | None:
    """Boolean mask (True = may attend) broadcastable to [b, kv_heads, group, s_q, s_k], or None."""
    mask = None
    if diagonal:
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril()
    if q_docs is not None:
        same_doc = (q_docs[:, :, None] == k_docs[:, None, :])[:, None, None]
        mask = same_doc if mask is None else mask & same_doc
    return mask


def _scores(q, k, mask, scale) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _block_forward(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T scale, masked) v, log-sum-exp of each query's scores), fp32.

    A query masked from the whole block gets output 0 and log-sum-exp -inf, which the merge
    weighs by exp(-inf) = 0. The row maximum is only for stability (the result does not depend
    on it), hence detached: autograd through this function (``allgather_kv_attention``) then
    differentiates the softmax alone.
    """
    scores = _scores(q, k, mask, scale)
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)
    probs = (scores - row_max).exp()
    row_sum = probs.sum(dim=-1, keepdim=True)
    out = (probs @ v) / row_sum.clamp(min=torch.finfo(row_sum.dtype).tiny)
    return out, (row_max + row_sum.log()).squeeze(-1)


def _block_backward(q, k, v, mask, scale, dout, lse, delta):
    """Gradients of one block's share of the attention, given the final log-sum-exp ``lse`` and
    ``delta = rowsum(dout * out)`` of the whole attention (flash-attention's backward)."""
    probs = (_scores(q, k, mask, scale) - lse.unsqueeze(-1)).exp()
    dv = (probs.transpose(-1, -2) @ dout).sum(dim=2, keepdim=True)
    dscores = probs * (dout @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    dq = (dscores @ k) * scale
    dk = (dscores.transpose(-1, -2) @ q).sum(dim=2, keepdim=True) * scale
    return dq, dk, dv


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's normalized output into the running one, in place (online softmax)."""
    total = torch.logaddexp(lse, block_lse)
    out.mul_((lse - total).exp().unsqueeze(-1)).add_(block_out * (block_lse - total).exp().unsqueeze(-1))
    lse.copy_(total)


# ---------------------------------------------------------------------- ring attention


class _RingExchange:
    """Send a tensor to the next cp rank and receive one of the same shape from the previous, in
    the background; ``wait()`` gives the received one. Holds the sent tensor until then."""

    def __init__(self, send: torch.Tensor, mesh: Mesh):
        group, n, rank = mesh.cp_group, mesh.cp_size, mesh.cp_rank
        self.send, self.recv = send, torch.empty_like(send)
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % n), group),
            dist.P2POp(dist.irecv, self.recv, dist.get_global_rank(group, (rank - 1) % n), group),
        ])  # fmt: skip

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.recv


def _ring_step(step: int, mesh: Mesh, seq_local: int, causal: bool) -> tuple[int, slice, slice, bool]:
    """At ring step ``step``: (rank whose block is held, local query rows, block key rows,
    whether the block is the causal diagonal). See the module docstring for why."""
    rank = mesh.cp_rank
    src, everything, half = (rank - step) % mesh.cp_size, slice(None), seq_local // 2
    if not causal:
        return src, everything, everything, False
    if step == 0:
        return src, everything, everything, True
    if src < rank:
        return src, everything, slice(0, half), False
    return src, slice(half, None), everything, False


def _ring_block(kv: torch.Tensor, docs: torch.Tensor | None, step: int, mesh: Mesh, causal: bool):
    """The block in hand at ring step ``step`` (``kv`` [2, b, s_local, kv_heads, d]): the local
    query rows it serves, its key rows, its k and v in the math layout, and the mask."""
    seq = kv.shape[2]
    src, rows, cols, diagonal = _ring_step(step, mesh, seq, causal)
    k5, v5 = _grouped_kv(kv[:, :, cols])
    q_docs, k_docs = (None, None) if docs is None else (docs[mesh.cp_rank][:, rows], docs[src][:, cols])
    mask = _block_mask(q_docs, k_docs, diagonal, len(range(seq)[rows]), k5.shape[-2], kv.device)
    return rows, cols, k5, v5, mask


def _gather_documents(document_ids: torch.Tensor | None, mesh: Mesh) -> torch.Tensor | None:
    """Every cp rank's local document ids, [cp, b, s_local] (None without documents)."""
    if document_ids is None:
        return None
    if mesh.cp_size == 1:
        return document_ids[None]
    parts = [torch.empty_like(document_ids) for _ in range(mesh.cp_size)]
    dist.all_gather(parts, document_ids.contiguous(), group=mesh.cp_group)
    return torch.stack(parts)


class _RingAttention(torch.autograd.Function):
    """Ring attention with its own ring backward; see ``ring_attention``."""

    @staticmethod
    def forward(ctx, q, k, v, mesh: Mesh, causal: bool, document_ids):
        n, kv_heads = mesh.cp_size, k.shape[2]
        scale = q.shape[-1] ** -0.5
        docs = _gather_documents(document_ids, mesh)
        q5 = _grouped_q(q, kv_heads)
        kv = torch.stack([k, v])  # one message per hop
        out = lse = None
        for step in range(n):
            pending = _RingExchange(kv, mesh) if step < n - 1 else None
            rows, _, k5, v5, mask = _ring_block(kv, docs, step, mesh, causal)
            block_out, block_lse = _block_forward(q5[..., rows, :], k5, v5, mask, scale)
            if out is None:  # step 0 covers every query, each seeing at least itself
                out, lse = block_out, block_lse
            else:
                _merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
            if pending is not None:
                kv = pending.wait()
        result = _ungroup(out, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.mesh, ctx.causal, ctx.docs, ctx.scale = mesh, causal, docs, scale
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mesh, docs, scale = ctx.mesh, ctx.docs, ctx.scale
        n, seq, kv_heads = mesh.cp_size, q.shape[1], k.shape[2]
        q5, dout5 = _grouped_q(q, kv_heads), _grouped_q(dout, kv_heads)
        delta = (dout5 * _grouped_q(out, kv_heads)).sum(dim=-1)
        dq = torch.zeros_like(q5)
        kv = torch.stack([k, v])
        # dk and dv of the block in hand ([2, b, kv_heads, s, d], fp32) follow it around the ring;
        # each rank adds its queries' share, and after n hops they are back with their owner.
        dkv_in_flight = None
        for step in range(n):
            pending_kv = _RingExchange(kv, mesh) if step < n - 1 else None
            rows, cols, k5, v5, mask = _ring_block(kv, docs, step, mesh, ctx.causal)
            dq_block, dk_block, dv_block = _block_backward(
                q5[..., rows, :], k5, v5, mask, scale, dout5[..., rows, :], lse[..., rows], delta[..., rows]
            )
            dq[..., rows, :] += dq_block
            if dkv_in_flight is None:
                dkv = q5.new_zeros((2, *k5.shape[:2], seq, k5.shape[-1]))
            else:
                dkv = dkv_in_flight.wait()
            dkv[0, ..., cols, :] += dk_block.squeeze(2)
            dkv[1, ..., cols, :] += dv_block.squeeze(2)
            if n > 1:
                dkv_in_flight = _RingExchange(dkv, mesh)
            if pending_kv is not None:
                kv = pending_kv.wait()
        if dkv_in_flight is not None:
            dkv = dkv_in_flight.wait()
        dk, dv = dkv.transpose(-3, -2).to(k.dtype)
        return _ungroup(dq, q.dtype), dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh, causal: bool = True,
                   document_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Attention of this cp rank's queries over the whole sequence, the k/v blocks passed around
    the cp ring.

    q [b, s_local, heads, d], k/v [b, s_local, kv_heads, d] (heads a multiple of kv_heads;
    under tensor parallelism, this rank's heads), each the load-balanced shard that
    ``shard_batch_for_cp`` cuts, after RoPE. ``document_ids`` [b, s_local] (sharded alike) keeps
    attention inside documents. Returns [b, s_local, heads, d] in q's dtype; fp32 inside.
    """
    return _RingAttention.apply(q, k, v, mesh, causal, document_ids)


def allgather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh, causal: bool = True,
                           document_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``ring_attention``'s result by all-gathering k/v over cp and one masked attention.

    Backward is autograd's; the all-gather's backward reduce-scatters the k/v gradients, each
    rank having contributed its queries' share to every block.
    """
    n, seq, kv_heads = mesh.cp_size, q.shape[1], k.shape[2]
    k_all = all_gather_sequence(k, mesh.cp_group, dim=1)
    v_all = all_gather_sequence(v, mesh.cp_group, dim=1)
    mask = None
    if causal:
        q_pos = cp_token_index(seq * n, n, mesh.cp_rank, q.device)
        k_pos = torch.cat([cp_token_index(seq * n, n, r, q.device) for r in range(n)])
        mask = k_pos[None, :] <= q_pos[:, None]
    if document_ids is not None:
        docs_all = all_gather_sequence(document_ids, mesh.cp_group, dim=1)
        same_doc = (document_ids[:, :, None] == docs_all[:, None, :])[:, None, None]
        mask = same_doc if mask is None else mask & same_doc
    out, _ = _block_forward(_grouped_q(q, kv_heads), _grouped_kv(k_all), _grouped_kv(v_all), mask, q.shape[-1] ** -0.5)
    return _ungroup(out, q.dtype)


# ---------------------------------------------------------------------- applying it to a model


def _is_causal_mask(mask: torch.Tensor) -> bool:
    s_q, s_k = mask.shape[-2:]
    return s_q == s_k and torch.equal(mask, torch.ones(s_q, s_k, dtype=torch.bool, device=mask.device).tril().expand_as(mask))


class ContextParallelAttention:
    """The core attention of a context-parallel model, installed as each attention module's
    ``core_attention`` (q, k, v after RoPE -> output, on [b, heads, s, d]).

    A plain callable rather than an ``nn.Module``, so that it lands in the instance's
    ``__dict__`` and takes the place of the class's method (a submodule would be shadowed by it).
    The mask the module builds describes one process's sequence; this builds its own from the
    chunk layout and ``document_ids``.
    """

    def __init__(self, mesh: Mesh, algorithm: str = "p2p"):
        if algorithm not in ALGORITHMS:
            raise ConfigError(f"unknown context-parallel algorithm '{algorithm}': use one of {ALGORITHMS}")
        self.mesh, self.algorithm = mesh, algorithm
        self._attention = ring_attention if algorithm == "p2p" else allgather_kv_attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float,
                 document_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if k.shape[-2] != q.shape[-2]:
            raise NotImplementedError(
                "context-parallel attention has no KV cache; generate with a model built without context parallelism"
            )
        if document_ids is None and mask is not None and not _is_causal_mask(mask):
            raise NotImplementedError(
                "packed documents under context parallelism need the document ids: Attention.forward must pass "
                "document_ids to core_attention"
            )
        out = self._attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.mesh, True, document_ids)
        return out.transpose(1, 2)

    def __repr__(self) -> str:
        return f"ContextParallelAttention(cp={self.mesh.cp_size}, algorithm={self.algorithm})"


def apply_context_parallel(model: nn.Module, mesh: Mesh, algorithm: str = "p2p") -> nn.Module:
    """Route the core attention of every layer of ``model`` (a ``Decoder``, tensor-parallel or not)
    through cp-wide attention, in place. At cp 1 the model is returned as it is.

    Only attention changes: every other layer works on whatever tokens it is given, and the
    batch's ``position_ids`` (from ``shard_batch_for_cp``) place them in the sequence.
    """
    if mesh.cp_size == 1:
        return model
    if model.cfg.attention_dropout > 0:
        raise ConfigError("attention dropout is not supported with context parallelism; set --attention-dropout 0")
    core = ContextParallelAttention(mesh, algorithm)
    for layer in model.layers:
        attn = layer.self_attention
        if not callable(getattr(attn, "core_attention", None)):
            raise NotImplementedError(
                f"{type(attn).__name__} has no core_attention(q, k, v, mask, dropout) to replace; context "
                f"parallelism needs one"
            )
        attn.core_attention = core
    return model
