"""Expert parallelism: each rank of an ep group holds ``E / ep`` consecutive routed experts of a
layer, and the rows routed to an expert travel to the rank holding it and back.

The mixture-of-experts layer is unchanged by it: it routes, sorts its tokens' copies by global
expert and hands its ``experts`` module those rows with the per-expert counts [E]. The plan
replaces that module by ``ExpertParallelExperts``, which keeps the interface (rows grouped by
global expert in, outputs in the same rows out) and brings each rank's rows to their experts in
one of two ways (``--moe-token-dispatcher-type``):

- ``alltoall``: the per-expert counts are exchanged first (a fixed-size all-to-all of the [ep,
  E/ep] count table), then one variable-size ``all_to_all_single`` sends each rank exactly the
  rows of its experts. They arrive ordered [source rank][local expert] and are regrouped to
  [local expert][source rank] for the grouped GEMM; the way back is the exact reverse.
- ``allgather``: every rank gathers every rank's rows (padded to the longest), picks its own
  experts' rows, and a reduce-scatter hands each source its rows back (each row computed by one
  owner, zeros elsewhere, so the sum is exact). It moves ep times the rows of ``alltoall``; it
  needs no variable-size collective. Megatron's allgather gathers tokens before permutation
  (k times fewer bytes than the permuted rows gathered here); this one reuses the layer's
  permutation so that both dispatchers share everything but the transport.

Both transports are autograd functions whose backward runs the reverse collective, and both give
the experts the same rows in the same order, so the two dispatchers compute bit-identical
results. A rank that sends or receives no row, or an expert that gets none, still takes part in
every collective with empty buffers (its weights get a zero gradient, as at one process).

Expert tensor parallelism (etp) then splits every local expert's FFN over the mesh's etp group
(``Mesh``: the expert grid etp x ep x edp, Megatron-Core's, over the same ranks as tp x cp x dp):
``weight1``'s fc1 rows column-parallel (SwiGLU's gate and up halves kept in pairs, ``Halves(2)``),
``weight2``'s ffn columns row-parallel, so each rank computes a partial output that the group
sums. The ranks of an etp group routed different tokens (other sequence shards, batches or
chunks): after the ep exchange the rows of the whole group are gathered (counts first, variable
sizes), regrouped by local expert, and the partial outputs reduce-scattered back to the ranks
they came from, as Megatron-Core's dispatcher does over its etp group.

The expert grid wants every rank's rows to be its own. Under sequence parallelism (or tp 1) they
are. Without it the tp ranks routed the same tokens: when etp = tp (the etp group is the tp
group) the shared rows enter as a column-parallel input (gradient all-reduced) and the partial
outputs are all-reduced, with no gather; otherwise each tp rank first keeps its 1/tp of the rows
and the outputs are gathered back over tp at the end (gradients: the adjoints), so that ep, etp
and edp see each row once whatever they have in common with tp.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshtron.errors import ConfigError
from meshtron.layers.moe.experts import expert_ffn
from meshtron.models.contract import Contiguous, Layout
from meshtron.optim.grad_buffer import all_gather_single
from meshtron.parallel.expert_overlap import chunk_bounds, exchange_in_chunks, runs_in_order, unpermute_rows, weight_chunks
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.tensor_parallel import (
    all_gather_sequence,
    copy_to_tp_region,
    gather_from_sequence_parallel,
    group_rank,
    group_size,
    reduce_from_tp_region,
    reduce_scatter_sequence,
    scatter_to_sequence_parallel,
)

DISPATCHERS = ("alltoall", "allgather")


def expert_tensor_parallel_split(pname: str, fc1_layout: Layout) -> tuple[int, Layout]:
    """(dim, layout) along which expert tensor parallelism splits the stacked expert weight
    ``pname``: fc1 rows of ``weight1`` [E, fc1, h], ffn columns of ``weight2`` [E, h, ffn]."""
    return (1, fc1_layout) if pname == "weight1" else (2, Contiguous())


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows ``send[j]`` to rank j, ``recv[i]`` from rank i; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def source_major_to_expert_major(received: torch.Tensor, total: int) -> torch.Tensor:
    """Row order that regroups a buffer of ``total`` rows in chunks [source][local expert] (sizes
    ``received`` [ep, L]) into [local expert][source]: ``buffer[index]`` has each local expert's
    rows contiguous."""
    chunk_order = torch.arange(received.numel(), device=received.device).view(received.shape).t().reshape(-1)
    return runs_in_order(received.reshape(-1), chunk_order, total)


def _by_local_expert(rows: torch.Tensor, received: torch.Tensor, ffn) -> torch.Tensor:
    """``ffn(rows grouped by local expert, group sizes)`` for rows ordered [source][local expert]
    (chunk sizes ``received`` [sources, L]); outputs back in the rows' order."""
    index = source_major_to_expert_major(received, rows.shape[0])
    out = ffn(rows.index_select(0, index), received.sum(0))
    return unpermute_rows(out, index)


def experts_communicate(mesh: Mesh, sequence_parallel: bool) -> bool:
    """Whether the routed experts need ``ExpertParallelExperts`` on ``mesh``: experts split (ep,
    etp) or rows the tp ranks share (no sequence parallelism) to split among them; otherwise
    every rank holds every expert whole and its own rows."""
    return mesh.ep > 1 or mesh.etp > 1 or (mesh.tp > 1 and not sequence_parallel)


class ExpertParallelExperts(nn.Module):
    """The routed experts of one layer on one rank of ``mesh``'s expert grid: experts ``ep_rank *
    L .. + L`` of ``experts`` (L = E / ep), same parameter names, rows exchanged over the ep group
    by ``dispatcher``; with etp > 1, this rank's slice of each expert's FFN (``fc1_layout`` for
    ``weight1``'s rows). The rows are this rank's own under ``sequence_parallel``, else shared by
    the tp group (see the module docstring)."""

    def __init__(self, experts: nn.Module, mesh: Mesh, dispatcher: str = "alltoall", fc1_layout: Layout = Contiguous(),
                 sequence_parallel: bool = False, overlap_chunks: int = 0):  # fmt: skip
        super().__init__()
        num_experts = experts.weight1.shape[0]
        ep, etp = mesh.ep, mesh.etp
        if num_experts % ep:
            raise ConfigError(f"--num-experts {num_experts} does not split over --expert-model-parallel-size {ep}; change either")
        if dispatcher not in DISPATCHERS:
            raise ConfigError(f"--moe-token-dispatcher-type must be one of {', '.join(DISPATCHERS)}, got '{dispatcher}'")
        self.cfg, self.group, self.ep, self.dispatcher = experts.cfg, mesh.ep_group, ep, dispatcher
        self.etp, self.etp_group = etp, mesh.etp_group
        shared_over_tp = mesh.tp > 1 and not sequence_parallel
        self.rows_shared_by_etp = shared_over_tp and etp == mesh.tp  # the etp group is then the tp group
        self.split_group = mesh.tp_group if shared_over_tp and etp != mesh.tp else None
        self.num_local, self.ep_rank = num_experts // ep, mesh.ep_rank
        if overlap_chunks and not (ep > 1 and dispatcher == "alltoall" and 2 <= overlap_chunks <= self.num_local):
            raise ConfigError(f"--overlap-moe-expert-parallel-comm needs ep > 1 (got {ep}), the alltoall dispatcher (got "
                              f"{dispatcher}) and 2 to {self.num_local} chunks of local experts (got {overlap_chunks})")  # fmt: skip
        self.bounds = chunk_bounds(self.num_local, overlap_chunks) if overlap_chunks else None
        self.grad_accum_fusion = experts.grad_accum_fusion  # set later by apply_gradient_accumulation_fusion
        first = self.ep_rank * self.num_local
        with torch.no_grad():
            for name, param in experts.named_parameters(recurse=False):
                local = param[first : first + self.num_local]
                if etp > 1:
                    dim, layout = expert_tensor_parallel_split(name, fc1_layout)
                    if not layout.divisible(param.shape[dim], etp):
                        raise ConfigError(f"the experts' {param.shape[dim]}-wide {name} does not split over "
                                          f"--expert-tensor-parallel-size {etp}; change --moe-ffn-hidden-size or etp")  # fmt: skip
                    local = local.index_select(dim, layout.local_index(param.shape[dim], etp, mesh.etp_rank).to(param.device))
                self.register_parameter(name, nn.Parameter(local.clone(), requires_grad=param.requires_grad))

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor, beside: Callable[[], torch.Tensor] | None = None):
        """x [R, h] grouped by global expert (``group_sizes`` [E]) -> their outputs [R, h]; with
        ``beside`` (``Experts``'), (outputs, its result): it runs while the first chunk's rows
        travel when the exchange is overlapped, else after the experts."""
        out, side = self._experts_of_own_rows(x, group_sizes, beside)
        return out if beside is None else (out, side)

    def _experts_of_own_rows(self, x: torch.Tensor, group_sizes: torch.Tensor, beside) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.split_group is None:
            return self._dispatch(x, group_sizes, beside)
        # Rows every tp rank holds: each keeps a run of 1/tp of them (padded to equal runs of at
        # least one row), computes those, and the outputs are gathered back.
        tp, rank, total = group_size(self.split_group), group_rank(self.split_group), x.shape[0]
        run = max(1, -(-total // tp))
        lo, hi = min(rank * run, total), min((rank + 1) * run, total)
        mine = scatter_to_sequence_parallel(F.pad(x, (0, 0, 0, run * tp - total)), self.split_group, dim=0)[: hi - lo]
        ends = torch.cumsum(group_sizes, 0)
        my_sizes = (ends.clamp(max=hi) - (ends - group_sizes).clamp(min=lo)).clamp(min=0)
        out, side = self._dispatch(mine, my_sizes, beside)
        return gather_from_sequence_parallel(F.pad(out, (0, 0, 0, run - (hi - lo))), self.split_group, dim=0)[:total], side

    def _dispatch(self, x: torch.Tensor, group_sizes: torch.Tensor, beside) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.bounds is not None:
            return self._alltoall_in_chunks(x, group_sizes, beside)
        if self.ep == 1:
            out = self._ffn(x, group_sizes)
        else:
            out = self._alltoall(x, group_sizes) if self.dispatcher == "alltoall" else self._allgather(x, group_sizes)
        return out, (beside() if beside is not None else None)

    def _ffn(self, rows: torch.Tensor, group_sizes: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Rows grouped by local expert (``group_sizes`` [L]) -> outputs, whole experts or split over
        etp; ``weights``: (weight1, weight2) of a chunk of the local experts instead of all."""
        weight1, weight2 = weights or (self.weight1, self.weight2)
        if self.etp == 1:
            return expert_ffn(rows, weight1, weight2, group_sizes, self.cfg, self.grad_accum_fusion)
        if self.rows_shared_by_etp:  # every etp rank holds these same rows
            partial = expert_ffn(copy_to_tp_region(rows, self.etp_group), weight1, weight2, group_sizes, self.cfg,
                                 self.grad_accum_fusion)
            return reduce_from_tp_region(partial, self.etp_group)
        counts = group_sizes.to(torch.int64).contiguous()
        table = counts.new_empty(self.etp * counts.numel())
        all_gather_single(table, counts, group=self.etp_group)
        table = table.view(self.etp, -1)  # every etp rank's rows per local expert
        mine, theirs = [rows.shape[0]] * self.etp, table.sum(1).tolist()
        gathered = _AllToAll.apply(rows.repeat(self.etp, 1), mine, theirs, self.etp_group)
        ffn = lambda r, sizes: expert_ffn(r, weight1, weight2, sizes, self.cfg, self.grad_accum_fusion)  # noqa: E731
        partial = _by_local_expert(gathered, table, ffn)
        return _AllToAll.apply(partial, theirs, mine, self.etp_group).view(self.etp, *rows.shape).sum(0)

    def _alltoall(self, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        counts = group_sizes.to(torch.int64).view(self.ep, self.num_local).contiguous()
        received = torch.empty_like(counts)  # received[i, l]: rows rank i sends to my expert l
        dist.all_to_all_single(received, counts, group=self.group)
        send, recv = counts.sum(1).tolist(), received.sum(1).tolist()  # the one host sync: split sizes
        rows = _AllToAll.apply(x, send, recv, self.group)
        return _AllToAll.apply(_by_local_expert(rows, received, self._ffn), recv, send, self.group)

    def _alltoall_in_chunks(self, x: torch.Tensor, group_sizes: torch.Tensor, beside) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``_alltoall`` pipelined over chunks of local experts (``parallel/expert_overlap.py``)."""
        counts = group_sizes.to(torch.int64).view(self.ep, self.num_local).contiguous()
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        chunks = list(zip(weight_chunks(self.weight1, self.bounds), weight_chunks(self.weight2, self.bounds)))

        def compute(rows: torch.Tensor, c: int) -> torch.Tensor:
            lo, hi = self.bounds[c]
            return _by_local_expert(rows, received[:, lo:hi], lambda r, sizes: self._ffn(r, sizes, chunks[c]))

        return exchange_in_chunks(x, counts, received, self.bounds, compute, self.group, beside)

    def _allgather(self, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        counts = group_sizes.to(torch.int64).contiguous()
        table = counts.new_empty(self.ep * counts.numel())
        all_gather_single(table, counts, group=self.group)
        table = table.view(self.ep, -1)  # every rank's per-expert counts
        longest = max(1, int(table.sum(1).max()))  # at least a row: collectives over empty buffers cannot be split
        gathered = all_gather_sequence(F.pad(x, (0, 0, 0, longest - x.shape[0])), self.group, dim=0)
        mine = slice(self.ep_rank * self.num_local, (self.ep_rank + 1) * self.num_local)
        received = table[:, mine]
        # Row positions of my experts' chunks in the gathered buffer, in [source][local expert] order.
        before_mine = table[:, : mine.start].sum(1)
        source_rows = [torch.arange(int(n), device=x.device) + i * longest + int(b) for i, (b, n) in enumerate(zip(before_mine, received.sum(1)))]
        index = torch.cat(source_rows)
        out = _by_local_expert(gathered.index_select(0, index), received, self._ffn)
        full = out.new_zeros(gathered.shape).index_copy(0, index, out)
        return reduce_scatter_sequence(full, self.group, dim=0)[: x.shape[0]]

    def extra_repr(self) -> str:
        overlap = f", overlapped in {len(self.bounds)} chunks" if self.bounds else ""
        return f"{self.num_local} of {self.num_local * self.ep} experts, ep {self.ep}, etp {self.etp}, {self.dispatcher}{overlap}"
