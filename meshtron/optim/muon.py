"""Muon (``--optimizer muon``): momentum SGD whose update of each weight matrix is replaced by
its nearest semi-orthogonal matrix, found by a few Newton-Schulz iterations.

Why: the raw momentum of a weight matrix is dominated by a few directions; orthogonalizing it
(all singular values ~1) spreads the step over every direction the matrix has, which trains
language models with fewer tokens than AdamW at equal steps (Keller Jordan's Muon; Moonshot's
and Megatron-Core's at scale). Only linear layers' weights are matrices in that sense:
embeddings, the output layer, routers, norms and biases stay with AdamW (``ParamMeta.matrix``).

The update of one matrix ``W`` with gradient ``G`` (Megatron-Core's, through NVIDIA's
Emerging-Optimizers): decoupled weight decay ``W -= lr * wd * W``; momentum as an average
``M = lerp(M, G, 1 - momentum)``; with ``--muon-nesterov`` the update looks ahead
``U = lerp(G, M, momentum)``, else ``U = M``; ``W -= lr * scale * extra * NS(U)``.

What is one matrix: a fused QKV weight is three (all query rows, all key rows, all value rows of
its groups, ``--muon-no-split-qkv`` keeps it whole) and SwiGLU's fc1 two (gate, up) — each block
is a linear map of its own, and orthogonalizing the concatenation would mix them. Stacked routed
experts ``[E, out, in]`` are E matrices. Under tensor parallelism (``--muon-tp-mode``):
``duplicated`` gathers each matrix whole over tp, orthogonalizes it on every rank and keeps the
local rows, so the result does not depend on tp; ``blockwise`` orthogonalizes each shard alone.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from meshtron.models.contract import GroupedHeads, Halves, ParamMeta
from meshtron.optim.muon_batch import RUN_BYTES, Rows, block_rows, orthogonalize_blocks, runs

# The quintic iteration's (a, b, c) per step: Keller Jordan's tuned sets (modded-nanogpt),
# as Megatron-Core's default "quintic"; "simple" is Muon's original single set, repeated.
NS_COEFFICIENTS = {
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),  # fmt: skip
    "simple": ((3.4445, -4.7750, 2.0315),),
}
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("duplicated", "blockwise")
MATMUL_PRECISIONS = ("low", "medium", "high")
_NORM_EPS = 1e-7


@dataclass(frozen=True)
class MuonSettings:
    """Megatron-Core's Muon flags (``--muon-*``), with their defaults."""

    momentum: float = 0.9
    nesterov: bool = False
    split_qkv: bool = True
    num_ns_steps: int = 5
    coefficient_type: str = "quintic"
    scale_mode: str = "spectral"
    extra_scale_factor: float = 1.0
    fp32_matmul_prec: str = "medium"
    tp_mode: str = "duplicated"


def muon_settings_errors(s: MuonSettings) -> list[str]:
    """What is wrong with these settings, each with what to change."""
    errors = []
    if s.coefficient_type not in NS_COEFFICIENTS:
        errors.append(f"--muon-coefficient-type {s.coefficient_type}: one of {' | '.join(NS_COEFFICIENTS)}")
    elif s.num_ns_steps < 1 or s.num_ns_steps % len(NS_COEFFICIENTS[s.coefficient_type]):
        errors.append(f"--muon-num-ns-steps {s.num_ns_steps}: must be a positive multiple of {len(NS_COEFFICIENTS[s.coefficient_type])} "
                      f"for --muon-coefficient-type {s.coefficient_type}")  # fmt: skip
    if s.scale_mode not in SCALE_MODES:
        errors.append(f"--muon-scale-mode {s.scale_mode}: one of {' | '.join(SCALE_MODES)}")
    if s.tp_mode not in TP_MODES:
        errors.append(f"--muon-tp-mode {s.tp_mode}: one of {' | '.join(TP_MODES)} (Megatron's 'distributed' is not implemented; "
                      "duplicated gives the same result)")  # fmt: skip
    if s.fp32_matmul_prec not in MATMUL_PRECISIONS:
        errors.append(f"--muon-fp32-matmul-prec {s.fp32_matmul_prec}: one of {' | '.join(MATMUL_PRECISIONS)}")
    if not 0.0 <= s.momentum < 1.0:
        errors.append(f"--muon-momentum {s.momentum}: must be in [0, 1)")
    return errors


def newton_schulz(x: torch.Tensor, steps: int, coefficient_type: str = "quintic", in_bf16: bool = True) -> torch.Tensor:
    """The semi-orthogonal factor of each matrix of ``x`` (``[..., rows, cols]``, fp32), approximately.

    Normalized to Frobenius norm 1 (so every singular value is at most 1), the quintic
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` pushes every singular value towards ~1
    (to roughly 0.7..1.2: the tuned coefficients trade exactness for speed). Run on the smaller
    Gram side (transposed when rows > cols). ``in_bf16``: the iterations in bf16
    (``--muon-fp32-matmul-prec medium``, Megatron's default), else in fp32.
    """
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True).clamp_min(_NORM_EPS)
    x = torch.div(x, norm, out=torch.empty_like(x, dtype=torch.bfloat16 if in_bf16 else x.dtype))  # divided and cast in one pass
    fma = torch.addmm if x.dim() == 2 else torch.baddbmm  # beta * input + alpha * m1 @ m2 as one GEMM
    for a, b, c in itertools.islice(itertools.cycle(NS_COEFFICIENTS[coefficient_type]), steps):
        gram = x @ x.mT
        x = fma(x, fma(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.to(torch.float32)
    return x.mT if transpose else x


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """What the orthogonalized update is multiplied by: ``spectral`` sqrt(max(rows, cols)) (an
    update of RMS ~1 whatever the shape), ``unit_rms_norm`` sqrt(rows / cols),
    ``shape_scaling`` sqrt(max(1, rows / cols)) (Keller Jordan's)."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    return max(1.0, rows / cols) ** 0.5


def row_parts(meta: ParamMeta, rows: int, split_qkv: bool) -> torch.Tensor | None:
    """[rows] the block (0, 1, ...) each output row of the *global* weight belongs to: q / k / v
    of a fused QKV weight (``GroupedHeads``), gate / up of SwiGLU's fc1 (``Halves``); None: one block."""
    layout, row = meta.layout, torch.arange(rows)
    if isinstance(layout, GroupedHeads) and split_qkv:
        position = (row // layout.head_dim) % (layout.queries_per_group + 2)  # within its group: q heads, k, v
        return (position - layout.queries_per_group + 1).clamp_min(0)
    if isinstance(layout, Halves):
        return row // (rows // layout.parts)
    return None


@dataclass
class MatrixPlan:
    """How one master is orthogonalized: ``gather`` (tp group) when its tp shards are gathered
    whole first, each tp rank's shard at ``placed[rank]`` along the tp dim; ``blocks`` the rows of
    each block of what is orthogonalized (None: one block); ``numel`` its elements (of the whole
    matrix where gathered). Index tensors move to the update's device at the first step and stay
    (no copy or host sync per step)."""

    meta: ParamMeta
    gather: dist.ProcessGroup | None
    blocks: list[Rows] | None
    placed: list[torch.Tensor] | None
    numel: int
    device: torch.device = torch.device("cpu")  # where its index tensors are

    def on(self, device: torch.device) -> MatrixPlan:
        if device != self.device:
            if self.blocks is not None:
                self.blocks = [rows.to(device) if isinstance(rows, torch.Tensor) else rows for rows in self.blocks]
            if self.placed is not None:
                self.placed = [index.to(device) for index in self.placed]
            self.device = device
        return self


def plan_matrix(meta: ParamMeta, local_shape: tuple[int, ...], s: MuonSettings, tp_group: dist.ProcessGroup | None) -> MatrixPlan:
    """The ``MatrixPlan`` of a master of ``local_shape`` (global for an FSDP2 DTensor) whose record is ``meta``."""
    split = meta.tp_dim is not None and meta.tp_size > 1
    if split and meta.split_over != "tp":
        raise ValueError("Muon cannot gather routed experts split over --expert-tensor-parallel-size; set it to 1")
    gather = tp_group if split and s.tp_mode == "duplicated" else None
    rows_dim = len(local_shape) - 2
    global_rows = meta.global_shape[rows_dim] if split else local_shape[rows_dim]
    parts = row_parts(meta, global_rows, s.split_qkv)
    if parts is not None and split and gather is None and meta.tp_dim == rows_dim:  # blockwise: the local rows' blocks
        parts = parts[meta.local_index()]
    size = meta.global_shape[meta.tp_dim] if split else 0
    placed = [meta.layout.local_index(size, meta.tp_size, rank) for rank in range(meta.tp_size)] if gather is not None else None
    numel = math.prod(meta.global_shape if gather is not None else local_shape)
    return MatrixPlan(meta, gather, None if parts is None else block_rows(parts), placed, numel)


def _whole(update: torch.Tensor, plan: MatrixPlan) -> torch.Tensor:
    """What is orthogonalized of ``update``: an FSDP2 shard (a DTensor) gathered whole, tp shards
    gathered whole (``duplicated``: placed by the layout, copied rows twice), else itself."""
    if isinstance(update, DTensor):
        return update.full_tensor()
    if plan.gather is None:
        return update
    meta = plan.meta
    shards = [torch.empty_like(update) for _ in range(meta.tp_size)]
    dist.all_gather(shards, update.contiguous(), group=plan.gather)
    shape = list(update.shape)
    shape[meta.tp_dim] = meta.global_shape[meta.tp_dim]
    whole = update.new_empty(shape)
    for index, shard in zip(plan.placed, shards):
        whole.index_copy_(meta.tp_dim, index, shard)
    return whole


def _own_part(out: torch.Tensor, update: torch.Tensor, plan: MatrixPlan) -> torch.Tensor:
    """This rank's part of the orthogonalized whole ``out``, placed as ``update`` (an FSDP2 shard
    cut back to its placement, a local slice; tp: the local rows)."""
    if isinstance(update, DTensor):
        replicated = DTensor.from_local(out, update.device_mesh, [Replicate()] * update.device_mesh.ndim)
        return replicated.redistribute(update.device_mesh, update.placements)
    if plan.gather is None:
        return out
    return out.index_select(plan.meta.tp_dim, plan.placed[plan.meta.tp_rank])


class Muon(torch.optim.Optimizer):
    """Muon over fp32 masters, each described by its ``MatrixPlan`` (``plans``, by id). State per
    master: ``step`` (0-d, for the checkpoint) and ``momentum_buffer``, allocated at once so that a
    checkpoint loads in place before the first step.

    A step updates the momentum of every master (foreach kernels), then orthogonalizes them in
    runs of at most ``RUN_BYTES`` (``muon_batch.py``): the blocks of equal shape in a run as one
    batched Newton-Schulz."""

    def __init__(self, param_groups: list[dict[str, Any]], *, lr: float, settings: MuonSettings, plans: dict[int, MatrixPlan]) -> None:
        super().__init__(param_groups, {"lr": lr, "weight_decay": 0.0})
        self.settings, self.plans = settings, plans
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32), "momentum_buffer": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        s = self.settings
        todo: list[tuple[torch.Tensor, float]] = []  # (master, lr)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, wd = group["lr"], group["weight_decay"]
            torch._foreach_add_([self.state[p]["step"] for p in params], 1.0)
            if wd:
                torch._foreach_add_(params, params, alpha=-lr * wd)
            torch._foreach_lerp_([self.state[p]["momentum_buffer"] for p in params], [p.grad for p in params], 1 - s.momentum)
            todo += [(p, lr) for p in params]
        for run in runs([self.plans[id(p)].numel * p.element_size() for p, _ in todo], RUN_BYTES):
            self._apply([todo[i] for i in run])

    def _apply(self, todo: list[tuple[torch.Tensor, float]]) -> None:
        """Orthogonalize the updates of a run of masters together and apply them."""
        s = self.settings
        updates = [self.state[p]["momentum_buffer"] for p, _ in todo]
        if s.nesterov:
            updates = [p.grad.lerp(buf, s.momentum) for (p, _), buf in zip(todo, updates)]
        plans = [self.plans[id(p)].on(p.device) for p, _ in todo]
        wholes = [_whole(update, plan) for update, plan in zip(updates, plans)]
        outs = orthogonalize_blocks(wholes, [plan.blocks for plan in plans], self._orthogonalize)
        for (p, lr), update, plan, out in zip(todo, updates, plans, outs):
            p.add_(_own_part(out, update, plan), alpha=-lr)

    def _orthogonalize(self, stacked: torch.Tensor) -> torch.Tensor:
        """Newton-Schulz of a stack of blocks ``[n, rows, cols]``, scaled for their shape."""
        s = self.settings
        factor = scale_factor(stacked.shape[-2], stacked.shape[-1], s.scale_mode) * s.extra_scale_factor
        return newton_schulz(stacked, s.num_ns_steps, s.coefficient_type, s.fp32_matmul_prec != "high").mul_(factor)
