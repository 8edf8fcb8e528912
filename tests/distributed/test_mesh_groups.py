"""The mesh's torch.distributed groups connect exactly the ranks its grid says (4 gloo processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from launcher import run_distributed
from meshtron.config import ParallelConfig
from meshtron.parallel.mesh import GROUP_DIMS, Mesh, init_distributed

PARALLEL = ParallelConfig(tensor_parallel=2, expert_parallel=2)  # world 4: tp 2 x dp 2, ep 2 inside dp


def _sum_of_ranks_per_group(rank: int, world_size: int) -> dict[str, int]:
    mesh = init_distributed(PARALLEL, "cpu")  # torch.distributed is up already: builds the groups
    out = {}
    for dim in GROUP_DIMS:
        t = torch.tensor([2**rank])  # a bit per rank: the sum says exactly who took part
        dist.all_reduce(t, group=mesh.group(dim))
        out[dim] = int(t)
    return out


def test_groups_reduce_over_the_grid_ranks():
    results = run_distributed(_sum_of_ranks_per_group, 4)
    mesh = Mesh.from_config(PARALLEL, world_size=4, rank=0)
    for rank, got in enumerate(results):
        for dim in GROUP_DIMS:
            (members,) = [g for g in mesh.group_ranks(dim) if rank in g]
            assert got[dim] == sum(2**r for r in members), f"rank {rank}: {dim} group is not {members}"
