"""Data parallelism, Megatron style: one contiguous fp32 gradient buffer, reduced bucket by bucket
while backward still runs.

Why a flat buffer: every parameter's gradient is a view (``param.main_grad``) into one fp32
tensor, so micro batches accumulate in fp32 whatever the model's dtype, the optimizer reads the
views with no copy, and a bucket of many small gradients goes over the wire as one collective.

Why buckets in reverse order of registration: backward produces the last layers' gradients
first, so buckets fill in layout order and each bucket's collective is launched
(``async_op=True``) as soon as its last gradient lands, overlapping the rest of backward.

Why SUM, not average: the trainer divides every micro batch's masked loss sum by the token count
of the whole global batch (all data-parallel ranks together), so each rank's gradient is already
its share of the global mean; the global gradient is the plain sum over ranks. (Context-parallel
ranks hold different tokens of the same sequences, so they are summed too: pass the mesh's
``dp_cp_group``.)

With the distributed optimizer each bucket is reduce-scattered instead: rank ``r`` of the group
keeps the sum only in its ``1/dp`` slice of every bucket (``shard_range``), which is all its
optimizer shard needs.

With ``reduce_dtype=torch.bfloat16`` (``--grad-reduce-in-bf16``) each bucket goes over the wire
as a bf16 copy, half the bytes, and the reduced copy is written back into the fp32 buffer; micro
batches still accumulate in fp32, so only the one rounding of the communicated sum is lost (Megatron
instead keeps the whole buffer in bf16).

Parameters may reduce over different groups (``ParamMeta.grad_group``: routed experts over the
expert-data-parallel group, the rest over dp x cp): each bucket holds parameters of one group
and reduces (or shards) over it. Buckets of the groups interleave in backward order, each
launched in layout order, which every rank of every group shares.

Why the buffer is not cleared each step: a memset of every fp32 gradient and then an add of
each bf16 gradient into zeros costs 4 + 10 bytes per parameter, a large share of a step whose
optimizer moves ~30 (2.2 B parameters: ~6 ms of ~100 on an H100). Instead each low-precision
parameter's first gradient of the step is *written* (a copy, or a fused GEMM's output with
beta 0) and later ones added; the few no backward reached are zeroed before anything reads the
buffer (``finish_grad_sync``). fp32 parameters, whose ``.grad`` autograd adds into in place, are
zeroed at the start of the step as before.

Only the last micro batch of a step communicates: earlier ones run inside ``no_sync()`` and just
accumulate. With one process (``group=None``) the buffer never communicates; it is then only the
fp32 accumulator of ``MixedPrecisionOptimizer``.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

# torch 2.13 renamed these two (the old names now warn); older releases have only the old names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

# Megatron's default: large enough that per-collective latency is amortized, small enough that
# the first bucket is ready early in backward.
DEFAULT_BUCKET_SIZE = 40_000_000
# Sharded buckets are padded to a multiple of dp x this many elements, so that every rank's
# shard starts 256-byte aligned (fp32), which NCCL's and the kernels' fast paths want.
_SHARD_ALIGN = 64


@dataclass
class Bucket:
    """Buffer elements ``[start, end)`` (``end`` includes padding) and the params laid out in them."""

    start: int
    end: int
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None = None  # the ranks it reduces over (None: none to reduce with)
    pending: int = 0  # params whose gradient has not landed yet in this step's synced backward
    handle: object = None  # the in-flight collective
    launched_in_backward: bool = False
    reduced_copy: tuple[torch.Tensor, torch.Tensor] | None = None  # (bf16 result, fp32 elements it goes back to)
    sent: torch.Tensor | None = None  # the low-precision copy being reduced: held until the wait, not freed under gloo's thread


@dataclass
class SyncStats:
    """How the last step's gradient communication went.

    ``overlapped_fraction``: share of the buffer's elements whose collective was launched from a
    backward hook (so it could overlap the rest of backward) rather than from
    ``finish_grad_sync``. ``wait_s``: host time ``finish_grad_sync`` spent waiting for the
    collectives, the communication backward did not hide. On a GPU ``wait()`` only orders
    streams, so there the exposed time shows in the step time rather than in ``wait_s``.
    """

    buckets: int = 0
    overlapped_fraction: float = 0.0
    wait_s: float = 0.0


class GradBuffer:
    """fp32 gradients of ``named_params`` in one flat tensor, reduced over ``group``, or over
    ``groups[grad_group_of[name]]`` for the params named in ``grad_group_of``.

    Every param gets ``param.main_grad``, its view of the buffer. fp32 params also keep
    ``param.grad`` pointing at that view, so autograd accumulates into it in place; a
    low-precision param's gradient is written (first of the step, see ``take_first_write``) or added
    into it by a post-accumulate-grad hook and freed. A linear with gradient-accumulation fusion
    (``meshtron.kernels.grad_accum_fusion``) writes into ``main_grad`` itself and reports through
    ``fused_grad_ready`` (found as ``param.grad_buffer``).
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        *,
        group: dist.ProcessGroup | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        shard: bool = False,
        own_bucket: frozenset[str] = frozenset(),
        groups: dict[str, dist.ProcessGroup | None] | None = None,
        grad_group_of: dict[str, str] | None = None,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        if not named_params:
            raise ValueError("the model has no trainable parameters")
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be positive, got {bucket_size}")
        owned = [name for name, param in named_params if hasattr(param, "main_grad")]
        if owned:
            # A second buffer's hooks would fight the first's over every .grad.
            raise ValueError(f"parameters {owned[:3]} already have a gradient buffer: build one optimizer per model")
        self.groups = {"dp_cp": group, **(groups or {})}
        grad_group_of = grad_group_of or {}
        self.shard, self.reduce_dtype = shard, reduce_dtype
        self.names = {param: name for name, param in named_params}
        self.key_of = {param: grad_group_of.get(name, "dp_cp") for name, param in named_params}
        self.buckets = self._layout([p for _, p in reversed(named_params)], bucket_size, own_bucket)
        self.communicates = any(b.group is not None for b in self.buckets)
        device = named_params[0][1].device
        self.numel = self.buckets[-1].end
        self.data = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.ranges: dict[nn.Parameter, tuple[int, int]] = {}  # each param's elements [start, end)
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        for bucket in self.buckets:
            offset = bucket.start
            for param in bucket.params:
                self.ranges[param] = (offset, offset + param.numel())
                self._bucket_of[param] = bucket
                param.main_grad = self.data[offset : offset + param.numel()].view_as(param)
                param.grad = param.main_grad if param.dtype == torch.float32 else None
                param.grad_buffer = self
                param.register_post_accumulate_grad_hook(_WeakHook(self._on_grad))
                offset += param.numel()
        self._sync = True
        self._next_launch = 0
        self._fused: set[nn.Parameter] = set()  # reported by a fused linear, its hook not yet run
        low = [p for p in self.ranges if p.dtype != torch.float32]
        self._lazy = frozenset(low)  # params whose first gradient of a step is written, not added
        self._zeroed_each_step = [p.main_grad for p in self.ranges if p.dtype == torch.float32] if low else []
        self._unwritten: set[nn.Parameter] = set()
        self.stats = SyncStats()
        self.zero_()

    def _layout(self, params: list[nn.Parameter], bucket_size: int, own_bucket: frozenset[str]) -> list[Bucket]:
        """Consecutive params of one reduction group into buckets of at least ``bucket_size``
        elements (never splitting a param), each padded so it shards evenly over its group when
        ``shard``; a bucket is placed when it closes, so buckets of different groups interleave
        in backward order. A param named in ``own_bucket`` (a tied embedding two pipeline stages
        hold) gets a bucket of its own, so its shard ranges are the same on both stages and their
        gradients can be summed."""
        buckets: list[Bucket] = []
        open_params: dict[str, list[nn.Parameter]] = {}
        open_size: dict[str, int] = {}

        def close(key: str) -> None:
            group, size = self.groups[key], open_size.pop(key)
            multiple = _group_size(group) * _SHARD_ALIGN if self.shard else 1
            start = buckets[-1].end if buckets else 0
            buckets.append(Bucket(start, start + -(-size // multiple) * multiple, open_params.pop(key), group))

        for param in params:
            key = self.key_of[param]
            alone = self.names[param] in own_bucket
            if alone and key in open_params:
                close(key)
            open_params.setdefault(key, []).append(param)
            open_size[key] = open_size.get(key, 0) + param.numel()
            if alone or open_size[key] >= bucket_size:
                close(key)
        for key in list(open_params):
            close(key)
        return buckets

    # ------------------------------------------------------------------ what the optimizer reads

    def grad_of(self, param: nn.Parameter) -> torch.Tensor:
        return param.main_grad

    def bucket_of(self, param: nn.Parameter) -> Bucket:
        return self._bucket_of[param]

    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """Buffer elements ``[lo, hi)`` of ``bucket`` that this rank reduces and owns when sharded."""
        size = (bucket.end - bucket.start) // _group_size(bucket.group)
        lo = bucket.start + _group_rank(bucket.group) * size
        return lo, lo + size

    # ------------------------------------------------------------------ a step

    def zero_(self) -> None:
        """Start a step: every gradient counts as zero and the buckets re-arm. Call after the last
        step's ``finish_grad_sync`` (the optimizer's ``step`` calls it), never while collectives run.

        Only fp32 params' gradients are cleared here; the others are marked unwritten (see the
        module docstring), so their stale values must never be read before ``finish_grad_sync``."""
        if not self._lazy:
            self.data.zero_()
        elif self._zeroed_each_step:
            torch._foreach_zero_(self._zeroed_each_step)
        self._unwritten = set(self._lazy)
        self._fused.clear()
        for bucket in self.buckets:
            bucket.pending, bucket.handle, bucket.launched_in_backward = len(bucket.params), None, False
        self._next_launch = 0

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate: wrap every micro batch but a step's last."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def take_first_write(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s ``main_grad`` holds nothing of this step yet, so the caller must write
        its gradient rather than add it; the param counts as written from now on."""
        if param in self._unwritten:
            self._unwritten.discard(param)
            return True
        return False

    def finish_grad_sync(self) -> SyncStats:
        """Zero the gradients no backward wrote, launch what backward did not (unused params), wait
        for every collective; idempotent."""
        if self._unwritten:
            torch._foreach_zero_([p.main_grad for p in self._unwritten])
            self._unwritten.clear()
        if not self.communicates:
            return self.stats
        self._launch_ready(force=True)
        start = time.perf_counter()
        waited = [b for b in self.buckets if b.handle is not None]
        for bucket in waited:
            bucket.handle.wait()
            bucket.handle, bucket.sent = None, None
            if bucket.reduced_copy is not None:
                reduced, target = bucket.reduced_copy
                target.copy_(reduced)
                bucket.reduced_copy = None
        if waited:
            overlapped = sum(b.end - b.start for b in self.buckets if b.launched_in_backward)
            self.stats = SyncStats(len(self.buckets), overlapped / self.numel, time.perf_counter() - start)
        return self.stats

    # ------------------------------------------------------------------ hooks and collectives

    @torch.no_grad()
    def _on_grad(self, param: nn.Parameter) -> None:
        if param in self._fused:  # a fused linear already accumulated and reported this gradient
            self._fused.discard(param)
            return
        if param.grad is not param.main_grad:  # low precision, or an fp32 .grad someone set to None
            if self.take_first_write(param):
                param.main_grad.copy_(param.grad)
            else:
                param.main_grad.add_(param.grad)
            param.grad = param.main_grad if param.dtype == torch.float32 else None
        self._grad_ready(param)

    def fused_grad_ready(self, param: nn.Parameter) -> None:
        """Called by a fused linear's backward once it has accumulated ``param``'s gradient into
        ``main_grad``: count it for its bucket now, and let the hook autograd still runs for the
        param (with no gradient) pass. Torch releases that skip that hook leave the mark, which
        the next step's ``zero_`` clears."""
        self._fused.add(param)
        self._grad_ready(param)

    def grad_deferred(self, param: nn.Parameter) -> None:
        """Called in a zero-bubble schedule's input-gradient pass by a linear that kept ``param``'s
        gradient for later (``kernels.deferred_wgrad``): the hook autograd still runs for the param
        now (with no gradient) passes; ``grad_landed`` reports the gradient when it is in."""
        self._fused.add(param)

    def grad_landed(self, param: nn.Parameter) -> None:
        """A deferred gradient of ``param`` is in ``main_grad`` (no autograd hook follows): count
        it for its bucket."""
        self._grad_ready(param)

    def _grad_ready(self, param: nn.Parameter) -> None:
        """One gradient of this backward is in ``main_grad``: launch its bucket once it is full."""
        if not self._sync or not self.communicates:
            return
        bucket = self._bucket_of[param]
        if bucket.pending == 0:
            raise RuntimeError(
                f"gradient of '{self.names[param]}' arrived after its bucket was reduced this step: run every "
                "micro batch but the last inside optimizer.no_sync(), and zero_grad() before the next step"
            )
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready(force=False)

    def _launch_ready(self, force: bool) -> None:
        """Launch buckets strictly in layout order, so every rank issues the same collectives in
        the same order even if its hooks fire in another; ``force`` launches the rest too."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending and not force:
                return
            bucket.launched_in_backward = not force
            if bucket.group is not None:  # None: no other rank holds these params, nothing to add
                self._reduce(bucket)
            bucket.pending = 0
            self._next_launch += 1

    def _reduce(self, bucket: Bucket) -> None:
        """Start the bucket's collective: reduce-scatter into this rank's shard, or all-reduce; in
        ``reduce_dtype`` through a copy when that is not the buffer's fp32."""
        region = self.data[bucket.start : bucket.end]
        target = self.data[slice(*self.shard_range(bucket))] if self.shard else region
        if self.reduce_dtype != region.dtype:  # reduce a low-precision copy, written back after the wait
            region = region.to(self.reduce_dtype)
            out = torch.empty_like(target, dtype=self.reduce_dtype) if self.shard else region
            bucket.reduced_copy, bucket.sent, target = (out, target), region, out
        if self.shard:
            bucket.handle = reduce_scatter_single(target, region, group=bucket.group, async_op=True)
        else:
            bucket.handle = dist.all_reduce(region, group=bucket.group, async_op=True)


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


class _WeakHook:
    """A parameter's gradient hook that calls its buffer without keeping it alive. autograd holds
    the hook where the garbage collector cannot see it, so a bound method there (buffer -> its
    params -> hook -> buffer) made a cycle nothing frees: a dropped trainer kept every parameter,
    gradient and buffer, and ``benchmarks/host_times.py``'s repeated cut models of
    DeepSeek-V2-Lite ran one H200 out of memory. The trainer's runner holds the buffer while it
    trains."""

    def __init__(self, method) -> None:
        self.method = weakref.WeakMethod(method)

    def __call__(self, param: nn.Parameter) -> None:
        method = self.method()
        if method is not None:
            method(param)
