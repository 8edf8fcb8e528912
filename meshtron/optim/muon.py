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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from meshtron.models.contract import GroupedHeads, Halves, ParamMeta

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
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp_min(_NORM_EPS)
    if in_bf16:
        x = x.to(torch.bfloat16)
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
    each block of what is orthogonalized (None: one block). Index tensors move to the update's
    device at the first step and stay (no copy or host sync per step)."""

    meta: ParamMeta
    gather: dist.ProcessGroup | None
    blocks: list[torch.Tensor] | None
    placed: list[torch.Tensor] | None

    def on(self, device: torch.device) -> MatrixPlan:
        self.blocks, self.placed = _moved(self.blocks, device), _moved(self.placed, device)
        return self


def _moved(tensors: list[torch.Tensor] | None, device: torch.device) -> list[torch.Tensor] | None:
    if tensors is None or tensors[0].device == device:
        return tensors
    return [t.to(device) for t in tensors]


def plan_matrix(meta: ParamMeta, local_shape: tuple[int, ...], s: MuonSettings, tp_group: dist.ProcessGroup | None) -> MatrixPlan:
    """The ``MatrixPlan`` of a master of ``local_shape`` whose record is ``meta``."""
    split = meta.tp_dim is not None and meta.tp_size > 1
    if split and meta.split_over != "tp":
        raise ValueError("Muon cannot gather routed experts split over --expert-tensor-parallel-size; set it to 1")
    gather = tp_group if split and s.tp_mode == "duplicated" else None
    rows_dim = len(local_shape) - 2
    global_rows = meta.global_shape[rows_dim] if split else local_shape[rows_dim]
    parts = row_parts(meta, global_rows, s.split_qkv)
    if parts is not None and split and gather is None and meta.tp_dim == rows_dim:  # blockwise: the local rows' blocks
        parts = parts[meta.local_index()]
    blocks = None if parts is None else [(parts == part).nonzero().squeeze(1) for part in range(int(parts.max()) + 1)]
    size = meta.global_shape[meta.tp_dim] if split else 0
    placed = [meta.layout.local_index(size, meta.tp_size, rank) for rank in range(meta.tp_size)] if gather is not None else None
    return MatrixPlan(meta, gather, blocks, placed)


def _gather_whole(local: torch.Tensor, plan: MatrixPlan) -> torch.Tensor:
    """The global matrix from every tp rank's shard (placed by the layout; copied rows twice)."""
    meta = plan.meta
    shards = [torch.empty_like(local) for _ in range(meta.tp_size)]
    dist.all_gather(shards, local.contiguous(), group=plan.gather)
    shape = list(local.shape)
    shape[meta.tp_dim] = meta.global_shape[meta.tp_dim]
    whole = local.new_empty(shape)
    for index, shard in zip(plan.placed, shards):
        whole.index_copy_(meta.tp_dim, index, shard)
    return whole


def orthogonalize(update: torch.Tensor, plan: MatrixPlan, s: MuonSettings) -> torch.Tensor:
    """``update`` (this rank's part of one weight) orthogonalized block by block and scaled.

    An FSDP2 shard (a DTensor) is gathered whole, orthogonalized on every rank and cut back to
    its placement (a local slice, no communication)."""
    if isinstance(update, DTensor):
        whole = orthogonalize(update.full_tensor(), plan, s)
        replicated = DTensor.from_local(whole, update.device_mesh, [Replicate()] * update.device_mesh.ndim)
        return replicated.redistribute(update.device_mesh, update.placements)
    plan = plan.on(update.device)
    whole = _gather_whole(update, plan) if plan.gather is not None else update
    in_bf16 = s.fp32_matmul_prec != "high"

    def scaled(block: torch.Tensor) -> torch.Tensor:
        factor = scale_factor(block.shape[-2], block.shape[-1], s.scale_mode) * s.extra_scale_factor
        return newton_schulz(block, s.num_ns_steps, s.coefficient_type, in_bf16) * factor

    if plan.blocks is None:
        out = scaled(whole)
    else:
        out = torch.empty_like(whole)
        for rows in plan.blocks:
            out.index_copy_(-2, rows, scaled(whole.index_select(-2, rows)))
    if plan.gather is None:
        return out
    return out.index_select(plan.meta.tp_dim, plan.placed[plan.meta.tp_rank])


class Muon(torch.optim.Optimizer):
    """Muon over fp32 masters, each described by its ``MatrixPlan`` (``plans``, by id). State per
    master: ``step`` (0-d, for the checkpoint) and ``momentum_buffer``, allocated at once so that a
    checkpoint loads in place before the first step."""

    def __init__(self, param_groups: list[dict[str, Any]], *, lr: float, settings: MuonSettings, plans: dict[int, MatrixPlan]) -> None:
        super().__init__(param_groups, {"lr": lr, "weight_decay": 0.0})
        self.settings, self.plans = settings, plans
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32), "momentum_buffer": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        s = self.settings
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                if wd:
                    p.add_(p, alpha=-lr * wd)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - s.momentum)
                update = p.grad.lerp(buf, s.momentum) if s.nesterov else buf
                p.add_(orthogonalize(update, self.plans[id(p)], s), alpha=-lr)
