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

Measured on 2 H200 with the cuDNN blocks (benchmarks/RESULTS.md, "Context parallelism"): the ring
is faster, 1-13 % per attention layer at 128K-32K tokens and 2-4 % per training step, so ``p2p``
stays the default; the all-gather peaked lower in memory at 128K (46.7 vs 57.8 GiB).

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

Keys and values travel as one ``[k | v]`` tensor (last dim), so value heads may be narrower than
query/key heads (MLA: 192 and 128); the softmax scale is the core's own (MLA's has YaRN's factor).

Per block, two implementations of the same contract (output and log-sum-exp forward; dq/dk/dv
given the merged output and log-sum-exp backward): plain PyTorch in fp32 (``_MathBlocks``: any
device and dtype, packed documents; the reference, tested on the CPU), and PyTorch's fused GPU
kernels (``_FusedBlocks`` over ``FlashKernel`` or ``CudnnKernel``: bf16/fp16 on CUDA). The fused
path is taken on CUDA with bf16/fp16 inputs and no ``document_ids``; packed documents stay on the
math path (the fused kernels take no per-block mask without a materialized bias). The fp32 math
path materializes a block's scores, so it is for short sequences and tests only.

How training uses it: the runner's ``shard_batch_for_cp`` gives each rank its tokens (with their
global positions, so RoPE and learned positions stay right); the parallel plan puts
``ContextParallelAttention`` in place of each attention module's core; losses come out for the
local tokens only, so the runner divides the loss sums by the count all-reduced over ``dp x cp``,
and gradients are summed over ``mesh.dp_cp_group`` (the data-parallel buffer's group).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from meshtron.errors import ConfigError
from meshtron.parallel import cp_block_kernels
from meshtron.parallel.cp_block_kernels import KERNEL_CHOICES
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.tensor_parallel import all_gather_sequence, reduce_scatter_sequence

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
    if mesh.cp == 1:
        return batch
    tokens = batch["tokens"]
    seq_len = tokens.shape[seq_dim]
    index = cp_token_index(seq_len, mesh.cp, mesh.cp_rank, tokens.device)
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


# ---------------------------------------------------------------------- attention of one block


class _Block(NamedTuple):
    """One block of work: local query ``rows`` against key ``cols`` of the k/v block in hand,
    either the causal diagonal (square: the same tokens) or unmasked (packed documents aside)."""

    rows: slice
    cols: slice
    diagonal: bool
    src: int = 0  # the cp rank whose k/v block it is (its document ids, on the math path)


# The math path. Layout: q [b, kv_heads, group, s_q, d] against k/v [b, kv_heads, 1, s_k, d], so a
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


def _split_kv(kv: torch.Tensor, k_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of a ``[k | v]`` tensor (last dim: k_dim, then the value dims)."""
    return kv[..., :k_dim], kv[..., k_dim:]


class _MathBlocks:
    """Blocks in plain PyTorch, fp32, in the grouped layout above; with packed documents (ids of
    every cp rank, [cp, b, s_local]) each block gets its same-document mask."""

    def __init__(self, kv_heads: int, k_dim: int, scale: float, docs: torch.Tensor | None, rank: int):
        self.kv_heads, self.k_dim, self.scale, self.docs, self.rank = kv_heads, k_dim, scale, docs, rank

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        return _grouped_q(x, self.kv_heads)

    def unlayout(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return _ungroup(x, dtype)

    def _kv_mask(self, kv: torch.Tensor, block: _Block, s_q: int):
        k, v = _split_kv(_grouped_kv(kv[:, block.cols]), self.k_dim)
        q_docs = k_docs = None
        if self.docs is not None:
            q_docs, k_docs = self.docs[self.rank][:, block.rows], self.docs[block.src][:, block.cols]
        return k, v, _block_mask(q_docs, k_docs, block.diagonal, s_q, k.shape[-2], kv.device)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, block: _Block) -> tuple[torch.Tensor, torch.Tensor]:
        q = q[..., block.rows, :]
        k, v, mask = self._kv_mask(kv, block, q.shape[-2])
        return _block_forward(q, k, v, mask, self.scale)

    def backward_inputs(self, q, out, dout, lse) -> tuple:
        q, dout = self.layout(q), self.layout(dout)
        return q, dout, lse, (dout * self.layout(out)).sum(dim=-1)

    def backward(self, state: tuple, kv: torch.Tensor, block: _Block):
        """(dq of the block's rows, dk, dv of its cols [b, kv_heads, s_k, d]), fp32."""
        q, dout, lse, delta = state
        r = block.rows
        k, v, mask = self._kv_mask(kv, block, q[..., r, :].shape[-2])
        dq, dk, dv = _block_backward(q[..., r, :], k, v, mask, self.scale, dout[..., r, :], lse[..., r], delta[..., r])
        return dq, dk.squeeze(2), dv.squeeze(2)


class _FusedBlocks:
    """Blocks through a fused kernel on [b, heads, s, d] views of the [b, s, heads, d] tensors.
    Each block's output comes in q's dtype and is merged in fp32; its gradients come in q's dtype
    and are added into fp32 sums in place (no fp32 copies of them)."""

    def __init__(self, kernel, k_dim: int, scale: float):
        self.kernel, self.k_dim, self.scale, self.aux = kernel, k_dim, scale, None

    def _kv(self, kv: torch.Tensor, block: _Block) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t.transpose(1, 2) for t in _split_kv(kv[:, block.cols], self.k_dim))

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)

    def unlayout(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype).transpose(1, 2).contiguous()

    def forward(self, q: torch.Tensor, kv: torch.Tensor, block: _Block) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._kv(kv, block)
        out, lse, self.aux = self.kernel.forward(q[:, :, block.rows], k, v, block.diagonal, self.scale)
        return out.float(), lse

    def backward_inputs(self, q, out, dout, lse) -> tuple:
        return self.layout(q), self.layout(out), self.layout(dout), lse

    def backward(self, state: tuple, kv: torch.Tensor, block: _Block):
        q, out, dout, lse = state
        r = block.rows
        k, v = self._kv(kv, block)
        return self.kernel.backward(
            dout[:, :, r], q[:, :, r], k, v, out[:, :, r], lse[..., r].contiguous(), self.aux, block.diagonal, self.scale
        )


# ---------------------------------------------------------------------- ring attention


class _RingExchange:
    """Send a tensor to the next cp rank and receive one of the same shape from the previous, in
    the background; ``wait()`` gives the received one. Holds the sent tensor until then."""

    def __init__(self, send: torch.Tensor, mesh: Mesh):
        group, n, rank = mesh.cp_group, mesh.cp, mesh.cp_rank
        self.send, self.recv = send, torch.empty_like(send)
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % n), group),
            dist.P2POp(dist.irecv, self.recv, dist.get_global_rank(group, (rank - 1) % n), group),
        ])  # fmt: skip

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.recv


def _ring_step(step: int, mesh: Mesh, seq_local: int, causal: bool) -> _Block:
    """The block of ring step ``step``: the k/v block held then is rank ``src``'s. See the module
    docstring for why these rows and columns."""
    rank = mesh.cp_rank
    src, everything, half = (rank - step) % mesh.cp, slice(None), seq_local // 2
    if not causal:
        return _Block(everything, everything, False, src)
    if step == 0:
        return _Block(everything, everything, True, src)
    if src < rank:
        return _Block(everything, slice(0, half), False, src)
    return _Block(slice(half, None), everything, False, src)


def _gather_documents(document_ids: torch.Tensor | None, mesh: Mesh) -> torch.Tensor | None:
    """Every cp rank's local document ids, [cp, b, s_local] (None without documents)."""
    if document_ids is None:
        return None
    if mesh.cp == 1:
        return document_ids[None]
    parts = [torch.empty_like(document_ids) for _ in range(mesh.cp)]
    dist.all_gather(parts, document_ids.contiguous(), group=mesh.cp_group)
    return torch.stack(parts)


class _RingAttention(torch.autograd.Function):
    """Ring attention with its own ring backward; see ``ring_attention``."""

    @staticmethod
    def forward(ctx, q, k, v, mesh: Mesh, causal: bool, document_ids, kernel, scale: float):
        n = mesh.cp
        fused = cp_block_kernels.block_kernel(kernel, q, v, document_ids)
        if fused is None:
            blocks = _MathBlocks(k.shape[2], k.shape[-1], scale, _gather_documents(document_ids, mesh), mesh.cp_rank)
        else:
            blocks = _FusedBlocks(fused, k.shape[-1], scale)
        q_blocks = blocks.layout(q)
        kv = torch.cat([k, v], dim=-1)  # one message per hop
        out = lse = None
        for step in range(n):
            pending = _RingExchange(kv, mesh) if step < n - 1 else None
            block = _ring_step(step, mesh, q.shape[1], causal)
            block_out, block_lse = blocks.forward(q_blocks, kv, block)
            if out is None:  # step 0 covers every query, each seeing at least itself
                out, lse = block_out, block_lse
            else:
                _merge(out[..., block.rows, :], lse[..., block.rows], block_out, block_lse)
            if pending is not None:
                kv = pending.wait()
        result = blocks.unlayout(out, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.mesh, ctx.causal, ctx.blocks = mesh, causal, blocks
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mesh, blocks = ctx.mesh, ctx.blocks
        n, seq = mesh.cp, q.shape[1]
        state = blocks.backward_inputs(q, out, dout, lse)
        dq = torch.zeros(state[0].shape, dtype=torch.float32, device=q.device)
        kv, k_dim = torch.cat([k, v], dim=-1), k.shape[-1]
        # dk and dv of the block in hand ([b, kv_heads, s, dk + dv], fp32) follow it around the
        # ring; each rank adds its queries' share, and after n hops they are back with their owner.
        dkv_in_flight = None
        for step in range(n):
            pending_kv = _RingExchange(kv, mesh) if step < n - 1 else None
            block = _ring_step(step, mesh, seq, ctx.causal)
            dq_block, dk_block, dv_block = blocks.backward(state, kv, block)
            dq[..., block.rows, :] += dq_block
            if dkv_in_flight is None:
                dkv = dq.new_zeros((*dk_block.shape[:2], seq, k_dim + dv_block.shape[-1]))
            else:
                dkv = dkv_in_flight.wait()
            dkv[..., block.cols, :k_dim] += dk_block
            dkv[..., block.cols, k_dim:] += dv_block
            if n > 1:
                dkv_in_flight = _RingExchange(dkv, mesh)
            if pending_kv is not None:
                kv = pending_kv.wait()
        if dkv_in_flight is not None:
            dkv = dkv_in_flight.wait()
        dk, dv = _split_kv(dkv.transpose(-3, -2).to(k.dtype), k_dim)
        return blocks.unlayout(dq, q.dtype), dk, dv, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh, causal: bool = True,
                   document_ids: torch.Tensor | None = None, kernel="auto", scale: float | None = None) -> torch.Tensor:  # fmt: skip
    """Attention of this cp rank's queries over the whole sequence, the k/v blocks passed around
    the cp ring.

    q [b, s_local, heads, d], k [b, s_local, kv_heads, d], v [b, s_local, kv_heads, dv] (heads a
    multiple of kv_heads; under tensor parallelism, this rank's heads), each the load-balanced
    shard that ``shard_batch_for_cp`` cuts, after RoPE. ``document_ids`` [b, s_local] (sharded
    alike) keeps attention inside documents. ``kernel`` picks the per-block implementation
    (``cp_block_kernels.block_kernel``); ``scale`` multiplies the scores (None: 1/sqrt(d)). Returns
    [b, s_local, heads, dv] in q's dtype; merged in fp32.
    """
    return _RingAttention.apply(q, k, v, mesh, causal, document_ids, kernel, scale or q.shape[-1] ** -0.5)


# ---------------------------------------------------------------------- all-gather attention


def _gathered_blocks(mesh: Mesh, seq_local: int, causal: bool) -> list[_Block]:
    """The blocks of the local queries against the gathered k/v in sequence order: each local
    chunk against the keys before it (unmasked) and against itself (the causal diagonal)."""
    if not causal:
        return [_Block(slice(None), slice(None), False)]
    half, blocks = seq_local // 2, []
    for rows, chunk in ((slice(0, half), mesh.cp_rank), (slice(half, None), 2 * mesh.cp - 1 - mesh.cp_rank)):
        start = chunk * half
        if start:
            blocks.append(_Block(rows, slice(0, start), False))
        blocks.append(_Block(rows, slice(start, start + half), True))
    return blocks


def _rank_order(mesh: Mesh, seq_local: int, device) -> torch.Tensor:
    """Global positions of the all-gathered tokens (rank 0's, then rank 1's, ...)."""
    n = mesh.cp
    return torch.cat([cp_token_index(seq_local * n, n, r, device) for r in range(n)])


class _AllGatherAttention(torch.autograd.Function):
    """``allgather_kv_attention`` through a fused kernel: k/v all-gathered once and put in sequence
    order, then ``_gathered_blocks`` merged; backward reduce-scatters the k/v gradients (each rank
    holds its queries' share of every token's)."""

    @staticmethod
    def forward(ctx, q, k, v, mesh: Mesh, causal: bool, kernel, scale: float):
        seq = q.shape[1]
        order = _rank_order(mesh, seq, q.device)
        kv = all_gather_sequence(torch.cat([k, v], dim=-1), mesh.cp_group, dim=1)
        kv = kv.index_select(1, order.argsort())  # [b, s, kv_heads, dk + dv] in sequence order
        blocks = _FusedBlocks(kernel, k.shape[-1], scale)
        q_blocks, specs = blocks.layout(q), _gathered_blocks(mesh, seq, causal)
        out = q_blocks.new_zeros((*q_blocks.shape[:-1], v.shape[-1]), dtype=torch.float32)  # v's dim (MLA: < q's)
        lse = out.new_full(out.shape[:-1], float("-inf"))
        for block in specs:
            _merge(out[..., block.rows, :], lse[..., block.rows], *blocks.forward(q_blocks, kv, block))
        result = blocks.unlayout(out, q.dtype)
        ctx.save_for_backward(q, result, lse, kv, order)
        ctx.mesh, ctx.blocks, ctx.specs = mesh, blocks, specs
        return result

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, kv, order = ctx.saved_tensors
        blocks, k_dim = ctx.blocks, ctx.blocks.k_dim
        state = blocks.backward_inputs(q, out, dout, lse)
        dq = torch.zeros(state[0].shape, dtype=torch.float32, device=q.device)
        b, s, kv_heads, d = kv.shape
        dkv = dq.new_zeros((b, kv_heads, s, d))
        for block in ctx.specs:
            dq_block, dk_block, dv_block = blocks.backward(state, kv, block)
            dq[..., block.rows, :] += dq_block
            dkv[..., block.cols, :k_dim] += dk_block
            dkv[..., block.cols, k_dim:] += dv_block
        dkv = reduce_scatter_sequence(dkv.index_select(2, order), ctx.mesh.cp_group, dim=2)
        dk, dv = _split_kv(dkv.transpose(-3, -2).to(kv.dtype), k_dim)
        return blocks.unlayout(dq, q.dtype), dk, dv, None, None, None, None


def allgather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh, causal: bool = True,
                           document_ids: torch.Tensor | None = None, kernel="auto", scale: float | None = None) -> torch.Tensor:  # fmt: skip
    """``ring_attention``'s result by all-gathering k/v over cp and attending to all of them.

    With a fused kernel (``cp_block_kernels.block_kernel``): ``_AllGatherAttention``. On the math path one masked
    attention over the gathered sequence, backward by autograd: the all-gather's backward
    reduce-scatters the k/v gradients, each rank having contributed its queries' share.
    """
    scale = scale or q.shape[-1] ** -0.5
    fused = cp_block_kernels.block_kernel(kernel, q, v, document_ids)
    if fused is not None:
        return _AllGatherAttention.apply(q, k, v, mesh, causal, fused, scale)
    n, seq, kv_heads = mesh.cp, q.shape[1], k.shape[2]
    k_all = all_gather_sequence(k, mesh.cp_group, dim=1)
    v_all = all_gather_sequence(v, mesh.cp_group, dim=1)
    mask = None
    if causal:
        q_pos = cp_token_index(seq * n, n, mesh.cp_rank, q.device)
        mask = _rank_order(mesh, seq, q.device)[None, :] <= q_pos[:, None]
    if document_ids is not None:
        docs_all = all_gather_sequence(document_ids, mesh.cp_group, dim=1)
        same_doc = (document_ids[:, :, None] == docs_all[:, None, :])[:, None, None]
        mask = same_doc if mask is None else mask & same_doc
    out, _ = _block_forward(_grouped_q(q, kv_heads), _grouped_kv(k_all), _grouped_kv(v_all), mask, scale)
    return _ungroup(out, q.dtype)


# ---------------------------------------------------------------------- applying it to a model


def _is_causal_mask(mask: torch.Tensor) -> bool:
    s_q, s_k = mask.shape[-2:]
    return s_q == s_k and torch.equal(mask, torch.ones(s_q, s_k, dtype=torch.bool, device=mask.device).tril().expand_as(mask))


class ContextParallelAttention(nn.Module):
    """The core attention of a context-parallel model (q, k, v after RoPE -> output, on
    [b, heads, s, d]), put in place of each attention module's core by the parallel plan's
    ``ContextParallelCore`` style. The mask the attention module builds describes one process's
    sequence; this builds its own from the chunk layout and ``document_ids``. ``block_kernel`` is one of ``KERNEL_CHOICES`` (``auto``:
    the fused kernel where the inputs allow, else the fp32 math). ``scale``: the replaced core's
    softmax scale (None: 1/sqrt(qk head dim)).
    """

    def __init__(self, mesh: Mesh, algorithm: str = "p2p", block_kernel: str = "auto", scale: float | None = None):
        super().__init__()
        if algorithm not in ALGORITHMS:
            raise ConfigError(f"unknown context-parallel algorithm '{algorithm}': use one of {ALGORITHMS}")
        if block_kernel not in KERNEL_CHOICES:
            raise ConfigError(f"unknown context-parallel block kernel '{block_kernel}': use one of {KERNEL_CHOICES}")
        self.mesh, self.algorithm, self.block_kernel, self.scale = mesh, algorithm, block_kernel, scale
        self._attention = ring_attention if algorithm == "p2p" else allgather_kv_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float,
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
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return self._attention(q, k, v, self.mesh, True, document_ids, self.block_kernel, self.scale).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"cp={self.mesh.cp}, algorithm={self.algorithm}, block_kernel={self.block_kernel}"
