"""Sequence-parallel communication overlapped with the GEMMs it feeds or drains (``--tp-comm-overlap``).

Under sequence parallelism a column-parallel linear all-gathers its sequence-sharded input before
its GEMM and a row-parallel linear reduce-scatters its partial output after it; done whole, each
collective waits for (or holds up) the whole GEMM. Here both are cut into the tp sequence chunks
the collective moves anyway:

- **gather, then multiply** (column forward, row backward's input gradient): every rank sends its
  chunk to every other rank at once (one send/recv pair per peer, launched before any GEMM), and
  multiplies its own chunk first, then each peer's as it arrives;
- **multiply, then scatter** (row forward, column backward's input gradient): the product rows of
  peer t's chunk are computed and sent to t while the next chunk's are computed; this rank's own
  chunk comes last and the received partial sums are added to it. The column backward defers
  that wait past its weight-gradient GEMM, which then hides the last transfer (as Megatron
  overlaps the input-gradient reduce-scatter with the wgrad GEMM).

Sends and receives go through ``dist.batch_isend_irecv``: on NCCL and RCCL they run on the process
group's own stream, ordered after the compute stream's work at launch, and ``Work.wait`` makes the
compute stream wait for them, so no CUDA-only code is involved; on gloo (the CPU tests) the same
chunked arithmetic runs synchronously. The gathered input is kept for the weight gradient, as the
plain path's linear keeps it, so backward moves no more bytes than before.

Backend ``bulk`` keeps one collective per op (``all_gather_into_tensor`` / ``reduce_scatter_tensor``,
as the plain path) and overlaps only where Megatron's default path does: the column backward's
input-gradient reduce-scatter runs (``async_op``, on the process group's stream) while the
weight-gradient GEMM computes. One NCCL kernel per op instead of ``p2p``'s 2 (tp - 1), so nothing
competes with the GEMMs for SMs, and no per-op barrier as in ``symm_mem``.

Backend ``symm_mem`` uses PyTorch's async-TP ops instead (``torch.ops.symm_mem.fused_all_gather_matmul``
and ``fused_matmul_reduce_scatter``: copy-engine transfers through symmetric memory, no SMs taken
from the GEMM), where ``symmetric_memory_usable`` finds them: NCCL (RCCL on ROCm) on a GPU whose
symmetric memory PyTorch supports (NVIDIA; AMD gfx942 and gfx950).
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshtron.kernels import platform
from meshtron.kernels.grad_accum_fusion import accumulate_wgrad_of

SEQ_DIM = 1
BACKENDS = ("p2p", "bulk", "symm_mem")


def symmetric_memory_usable(group) -> bool:
    """Whether PyTorch's fused async-TP ops can serve ``group``: a GPU whose symmetric memory
    PyTorch supports (``platform.symmetric_memory_arch``: NVIDIA, or AMD gfx942/gfx950), an NCCL
    (RCCL) group, and ``torch.distributed._symmetric_memory`` registering the ops."""
    if not torch.cuda.is_available() or not platform.symmetric_memory_arch() or dist.get_backend(group) != "nccl":
        return False
    try:  # importing the module defines the torch.ops.symm_mem ops
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return False
    ops = torch.ops.symm_mem
    return hasattr(ops, "fused_all_gather_matmul") and hasattr(ops, "fused_matmul_reduce_scatter")


def resolve_backend(requested: str, group) -> str:
    """The backend to run: ``requested``, or ``p2p`` (with a warning) when ``symm_mem`` is asked for
    where ``symmetric_memory_usable`` says no."""
    if requested == "symm_mem" and not symmetric_memory_usable(group):
        warnings.warn("--tp-comm-overlap-backend symm_mem: PyTorch's symmetric-memory async-TP ops are not usable here "
                      "(they need NCCL on an NVIDIA GPU or AMD gfx942/gfx950); overlapping with the portable p2p backend instead", stacklevel=2)  # fmt: skip
        return "p2p"
    return requested


def _exchange(send: torch.Tensor, recv: torch.Tensor, to: int, frm: int, group) -> list[dist.Work]:
    """Send ``send`` to group rank ``to`` and receive into ``recv`` from ``frm``, as one group of
    point-to-point calls (so two ranks that send to each other first cannot deadlock)."""
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=to), dist.P2POp(dist.irecv, recv, group=group, group_peer=frm)]
    return dist.batch_isend_irecv(ops)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``out = a @ b (+ bias)`` over the last dim, written in place (``out`` and ``a`` contiguous)."""
    a2, out2 = a.view(-1, a.shape[-1]), out.view(-1, out.shape[-1])
    if bias is None:
        torch.mm(a2, b, out=out2)
    else:
        torch.addmm(bias, a2, b, out=out2)


def _chunk_major_to_sequence(chunks: torch.Tensor) -> torch.Tensor:
    """``[tp, b, s/tp, d]`` (chunk j = sequence rows j*s/tp...) -> ``[b, s, d]``; a view at b = 1."""
    n, b, c, d = chunks.shape
    return chunks.transpose(0, 1).reshape(b, n * c, d)


def gather_matmul(shard: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(gathered, gathered @ b + bias)`` where ``gathered`` is ``shard`` ([batch, s/tp, k])
    all-gathered along the sequence and ``b`` is ``[k, n]``: each peer's chunk is multiplied as
    it arrives, this rank's own first."""
    if backend == "symm_mem":  # the ops want the gathered dim first and contiguous: [s/tp, batch, k] (a view at batch 1)
        seq_first = shard.transpose(0, 1).contiguous()
        gathered, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(seq_first, [b], 0, group.group_name, return_A=True)
        out = out.transpose(0, 1).contiguous()  # as the plain path's: consumers view it by heads
        return gathered.transpose(0, 1), out if bias is None else out + bias
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = shard.contiguous()
    chunks = shard.new_empty((n, *shard.shape))
    if backend == "bulk":  # one all-gather into rank-major chunks, then one GEMM
        dist.all_gather_into_tensor(chunks.flatten(0, 1), shard, group=group)
        gathered = _chunk_major_to_sequence(chunks)
        out = gathered.new_empty((*gathered.shape[:-1], b.shape[1]))
        _mm_into(out, gathered.contiguous(), b, bias)
        return gathered, out
    works = [_exchange(shard, chunks[(rank - k) % n], (rank + k) % n, (rank - k) % n, group) for k in range(1, n)]
    out = shard.new_empty((n, *shard.shape[:-1], b.shape[1]))
    _mm_into(out[rank], shard, b, bias)
    chunks[rank].copy_(shard)
    for k, step in enumerate(works, start=1):
        for work in step:
            work.wait()
        src = (rank - k) % n
        _mm_into(out[src], chunks[src], b, bias)
    return _chunk_major_to_sequence(chunks), _chunk_major_to_sequence(out)


@dataclass
class PendingScatter:
    """A ``matmul_scatter`` in flight: this rank's own partial sums, the peers' partial sums of
    this rank's chunk being received, and the sends and receives still to wait for."""

    own: torch.Tensor
    received: list[torch.Tensor] = field(default_factory=list)
    works: list[dist.Work] = field(default_factory=list)
    sent: list[torch.Tensor] = field(default_factory=list)  # kept alive until their sends complete

    def wait(self) -> torch.Tensor:
        """This rank's sequence chunk of the product summed over the group."""
        for work in self.works:
            work.wait()
        for part in self.received:
            self.own.add_(part)
        self.sent.clear()
        return self.own


def matmul_scatter(a: torch.Tensor, b: torch.Tensor, group, backend: str) -> PendingScatter:
    """Start ``reduce_scatter(a @ b)`` along the sequence (``a`` [batch, s, k], ``b`` [k, n]):
    peer t's chunk of the product is sent to t while the next chunk is computed, this rank's own
    chunk last. ``wait()`` on the result gives this rank's summed chunk."""
    if backend == "symm_mem":  # sequence first, as for gather_matmul
        return PendingScatter(_symm_mem_matmul_scatter(a.transpose(0, 1), b, group).transpose(0, 1).contiguous())
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if a.shape[SEQ_DIM] % n:
        raise ValueError(f"cannot reduce-scatter a sequence of {a.shape[SEQ_DIM]} over {n} tensor-parallel ranks")
    if backend == "bulk":
        return _bulk_matmul_scatter(a, b, group)
    chunks = a.chunk(n, dim=SEQ_DIM)
    sent, received, works = [], [], []
    for k in range(1, n):
        to, frm = (rank + k) % n, (rank - k) % n
        sent.append(torch.matmul(chunks[to], b))
        received.append(torch.empty_like(sent[-1]))
        works += _exchange(sent[-1], received[-1], to, frm, group)
    return PendingScatter(torch.matmul(chunks[rank], b), received, works, sent)


def _bulk_matmul_scatter(a: torch.Tensor, b: torch.Tensor, group) -> PendingScatter:
    """The whole product, then one reduce-scatter left in flight (``async_op``): the caller's next
    GEMM runs while it moves. gloo lacks ``reduce_scatter_tensor``: an all-reduce, kept whole."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = torch.matmul(a, b).unflatten(SEQ_DIM, (n, -1)).movedim(SEQ_DIM, 0).contiguous()  # rank-major; a view at batch 1
    if dist.get_backend(group) == "gloo":
        return PendingScatter(chunks[rank], works=[dist.all_reduce(chunks, group=group, async_op=True)], sent=[chunks])
    own = chunks.new_empty(chunks.shape[1:])
    work = dist.reduce_scatter_tensor(own, chunks.flatten(0, 1), group=group, async_op=True)
    return PendingScatter(own, works=[work], sent=[chunks])


def _symm_mem_matmul_scatter(a: torch.Tensor, b: torch.Tensor, group) -> torch.Tensor:
    """``fused_matmul_reduce_scatter(a, b, "sum", 0)`` (``a`` [s, batch, k], sequence first) whose
    final sum of the peers' partials is one elementwise add at tp 2. The op sums them with a
    reduction kernel over a leading dim of 2: 77 µs a call at Llama-3-8B's [4096, 4096] bf16 on an
    H200, 4 calls a layer and micro batch, 2 % of B5's tp2 step. Uses the op's own pipelined
    producer; where this torch lacks it, the op."""
    from torch.distributed import _symmetric_memory

    produce = getattr(_symmetric_memory, "_pipelined_produce_and_all2all", None)
    n = dist.get_world_size(group)
    if produce is None or n != 2:
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group.group_name)
    rows = a.flatten(0, -2)
    shards = rows.chunk(n)
    partials = rows.new_empty(rows.shape[0], b.shape[1])
    produce(lambda rank, out: torch.mm(shards[rank], b, out=out), partials, group.group_name)
    first, second = partials.view(n, -1).unbind(0)
    return torch.add(first, second).view(a.shape[0] // n, *a.shape[1:-1], b.shape[1])


def _weight_grad(grad: torch.Tensor, inp: torch.Tensor, fused_param: torch.Tensor | None) -> torch.Tensor | None:
    """``grad^T @ inp`` over all tokens; accumulated into ``fused_param.main_grad`` instead (and None
    returned) when the layer fuses its weight gradient (``grad_accum_fusion``): the parameter
    object itself, kept on the context, as a saved tensor comes back detached from a recompute."""
    grad_2d, inp_2d = grad.reshape(-1, grad.shape[-1]), inp.reshape(-1, inp.shape[-1])
    if fused_param is not None:
        accumulate_wgrad_of(fused_param, grad_2d, inp_2d)
        return None
    return grad_2d.t() @ inp_2d


def _fuses(weight: torch.Tensor, fuse_wgrad: bool) -> bool:
    return fuse_wgrad and hasattr(weight, "main_grad") and weight.requires_grad


class _GatherLinear(torch.autograd.Function):
    """Column-parallel linear of a sequence-sharded input: ``all_gather(x) @ W^T + b``. Backward:
    the input gradient ``grad @ W`` reduce-scattered, its transfers overlapping the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, backend, fuse):
        gathered, y = gather_matmul(x, weight.t(), bias, group, backend)
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.backend, ctx.has_bias = group, backend, bias is not None
        ctx.fused_param = weight if fuse else None
        return y

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        pending = matmul_scatter(grad, weight, ctx.group, ctx.backend) if ctx.needs_input_grad[0] else None
        grad_weight = _weight_grad(grad, gathered, ctx.fused_param) if ctx.needs_input_grad[1] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (pending.wait() if pending else None), grad_weight, grad_bias, None, None, None


class _LinearScatter(torch.autograd.Function):
    """Row-parallel linear into sequence shards: ``reduce_scatter(y @ W^T)``. Backward: the output
    gradient all-gathered chunk by chunk into the input-gradient GEMM, then the weight gradient."""

    @staticmethod
    def forward(ctx, y, weight, group, backend, fuse):
        ctx.save_for_backward(y, weight)
        ctx.group, ctx.backend = group, backend
        ctx.fused_param = weight if fuse else None
        return matmul_scatter(y, weight.t(), group, backend).wait()

    @staticmethod
    def backward(ctx, grad):
        y, weight = ctx.saved_tensors
        gathered_grad, grad_y = gather_matmul(grad, weight, None, ctx.group, ctx.backend)
        grad_weight = _weight_grad(gathered_grad, y, ctx.fused_param) if ctx.needs_input_grad[1] else None
        return grad_y, grad_weight, None, None, None


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group, backend: str,
                  fuse_wgrad: bool = False) -> torch.Tensor:  # fmt: skip
    """The column-parallel linear of sequence shards ``x`` [batch, s/tp, k], overlapped: the full
    sequence's ``x @ W_shard^T + b_shard``. ``fuse_wgrad``: the weight gradient goes to ``main_grad``."""
    return _GatherLinear.apply(x, weight, bias, group, backend, _fuses(weight, fuse_wgrad))


def linear_scatter(y: torch.Tensor, weight: torch.Tensor, group, backend: str, fuse_wgrad: bool = False) -> torch.Tensor:
    """The row-parallel linear of ``y`` [batch, s, k/tp], overlapped: this rank's sequence shard of
    ``y @ W^T`` summed over the group (no bias: the caller adds it once, after the sum)."""
    return _LinearScatter.apply(y, weight, group, backend, _fuses(weight, fuse_wgrad))
