"""The device mesh: which global ranks share each parallel dimension, built once and passed down.

Ranks are laid out on a grid whose coordinates vary, fastest to slowest, as tp, cp, dp, pp::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a tensor-parallel group (the chattiest, one collective per layer) is made of neighbouring ranks,
which launchers place on one node. Gradients of dense parameters are reduced over dp and cp
together (``dp_cp``): each context-parallel rank saw a different part of the sequences.

Experts have a grid of their own over the same ranks, as in Megatron-Core ("MoE parallel
folding"): inside one pipeline stage (its ``tp * cp * dp`` ranks, numbered ``j = rank mod
tp*cp*dp``) the coordinates vary, fastest to slowest, as etp, ep, edp::

    j = etp_rank + etp * (ep_rank + ep * edp_rank)

An ``etp`` group splits each expert's FFN, an ``ep`` group holds the experts in slices (each rank
``E / ep`` of them), an ``edp`` (expert data parallel) group holds the same expert slices and
reduces their gradients together, and ``etp_ep`` is the ranks holding the other slices (over which
an expert gradient norm is completed). The two grids share only pp: with etp = tp an etp group is
a tp group and ep / edp are carved out of dp x cp; with etp < tp the etp groups are runs of a tp
group, with etp > tp they take tp groups of neighbouring dp (or cp) ranks.

The grid itself is pure Python (``group_ranks``, ``coords``) so that it can be printed and tested
without processes; ``init_process_groups`` turns it into ``torch.distributed`` groups. A mesh of
one process never touches ``torch.distributed``: every group is None, every size 1, every rank 0.
In a run of several processes every dimension has a real group, even one of size 1, so a group
accessor never returns None there (None given to a collective would mean the whole world).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshtron.config import ParallelConfig
from meshtron.errors import ConfigError

# Every group the mesh builds, in the order every rank creates them (new_group is collective).
GROUP_DIMS = ("tp", "cp", "dp", "pp", "dp_cp", "etp", "ep", "edp", "etp_ep")
# The grid's own axes, fastest-varying first.
GRID_DIMS = ("tp", "cp", "dp", "pp")
# The expert grid's axes inside one pipeline stage, fastest-varying first.
EXPERT_DIMS = ("etp", "ep", "edp")
# Per dimension, the coordinates its members share (a group is the ranks agreeing on them).
_FIXED = {
    "tp": ("cp", "dp", "pp"), "cp": ("tp", "dp", "pp"), "dp": ("tp", "cp", "pp"), "pp": ("tp", "cp", "dp"),
    "dp_cp": ("tp", "pp"), "etp": ("ep", "edp", "pp"), "ep": ("etp", "edp", "pp"), "edp": ("etp", "ep", "pp"),
    "etp_ep": ("edp", "pp"),
}  # fmt: skip


def _accessors(dim: str):
    """(rank, group) properties of one mesh dimension, so each reads ``mesh.tp_rank`` etc.; the
    size is the field of the same name (``mesh.tp``), or a property for the derived groups."""
    return (
        property(lambda self: self.coords()[dim], doc=f"this rank's index inside its {dim} group"),
        property(lambda self: self.group(dim), doc=f"torch.distributed group over {dim} (None in a one-process run)"),
    )


@dataclass
class Mesh:
    """Parallel sizes and this process's place among them. ``world_size = tp * cp * dp * pp``."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    rank: int = 0
    local_rank: int = 0
    _groups: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for dim in ("tp", "cp", "dp", "pp", "ep", "etp"):
            if getattr(self, dim) < 1:
                raise ConfigError(f"parallel size {dim} must be at least 1, got {getattr(self, dim)}")
        stage = self.tp * self.cp * self.dp
        if stage % (self.ep * self.etp):
            raise ConfigError(
                f"expert parallel size {self.ep} x expert tensor parallel size {self.etp} must divide the {stage} ranks "
                f"of a pipeline stage (tp x cp x dp); change --expert-model-parallel-size, --expert-tensor-parallel-size "
                "or the number of processes"
            )
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a world of {self.world_size} processes")

    @classmethod
    def from_config(
        cls, parallel_cfg: ParallelConfig, world_size: int | None = None, rank: int | None = None, local_rank: int | None = None
    ) -> "Mesh":
        """The mesh of this process; unset world size and ranks come from the launcher's environment."""
        env_world, env_rank, env_local = launch_env()
        world_size = env_world if world_size is None else world_size
        rank = env_rank if rank is None else rank
        local_rank = env_local if local_rank is None else local_rank
        p = parallel_cfg
        model_parallel = p.tensor_parallel * p.context_parallel * p.pipeline_parallel
        if model_parallel < 1 or world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not a multiple of tp {p.tensor_parallel} x cp {p.context_parallel} x "
                f"pp {p.pipeline_parallel} = {model_parallel}; change the parallel sizes or the number of processes"
            )
        return cls(
            tp=p.tensor_parallel,
            cp=p.context_parallel,
            dp=world_size // model_parallel,
            pp=p.pipeline_parallel,
            ep=p.expert_parallel,
            etp=p.expert_tensor_parallel,
            rank=rank,
            local_rank=local_rank,
        )

    # ------------------------------------------------------------------ the grid (pure Python)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """Coordinates of ``rank`` (default: this process) on every dimension of ``GROUP_DIMS``."""
        rank = self.rank if rank is None else rank
        out = {}
        rest = rank
        for dim in GRID_DIMS:
            out[dim] = rest % getattr(self, dim)
            rest //= getattr(self, dim)
        out["dp_cp"] = out["cp"] + self.cp * out["dp"]
        rest = rank % (self.tp * self.cp * self.dp)  # place inside the pipeline stage
        for dim in EXPERT_DIMS:
            out[dim] = rest % self.size(dim)
            rest //= self.size(dim)
        out["etp_ep"] = out["etp"] + self.etp * out["ep"]
        return out

    def group_ranks(self, dim: str) -> list[list[int]]:
        """Every ``dim`` group as a list of global ranks (ordered by rank inside the group)."""
        if dim not in GROUP_DIMS:
            raise ValueError(f"unknown mesh dimension '{dim}': use one of {GROUP_DIMS}")
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            groups.setdefault(tuple(c[d] for d in _FIXED[dim]), []).append((c[dim], r))
        return sorted([r for _, r in sorted(members)] for members in groups.values())

    def size(self, dim: str) -> int:
        if dim in ("tp", "cp", "dp", "pp", "ep", "etp"):
            return getattr(self, dim)
        if dim == "dp_cp":
            return self.dp * self.cp
        if dim == "edp":
            return self.tp * self.cp * self.dp // (self.ep * self.etp)
        if dim == "etp_ep":
            return self.etp * self.ep
        raise ValueError(f"unknown mesh dimension '{dim}': use one of {GROUP_DIMS}")

    def describe(self) -> str:
        """The layout in words: sizes, then which global ranks form each group, then this rank."""
        lines = [
            f"mesh: world {self.world_size} = tp {self.tp} x cp {self.cp} x dp {self.dp} x pp {self.pp}"
            f" (experts: etp {self.etp} x ep {self.ep} x edp {self.edp} x pp {self.pp});"
            " rank order fastest to slowest: tp, cp, dp, pp and etp, ep, edp, pp"
        ]
        for dim in GROUP_DIMS:
            lines.append(f"  {dim:>6} groups: " + " ".join(str(g) for g in self.group_ranks(dim)))
        c = self.coords()
        lines.append(f"  rank {self.rank} (local {self.local_rank}): " + ", ".join(f"{d} {c[d]}" for d in GROUP_DIMS))
        return "\n".join(lines)

    # ------------------------------------------------------------------ process groups

    def init_process_groups(self, backend: str | None = None) -> None:
        """Create a ``torch.distributed`` group for every dimension (a no-op in a one-process run).

        Every rank creates every group of every dimension in the same order, as ``new_group``
        requires, and keeps the one it belongs to. Dimensions with identical partitions (dp and
        dp_cp when cp is 1, say) share one group object.
        """
        if self.world_size == 1:
            return
        if not dist.is_initialized():
            raise RuntimeError("init_process_groups needs torch.distributed initialized first (see init_distributed)")
        if dist.get_world_size() != self.world_size:
            raise ConfigError(
                f"the mesh describes {self.world_size} processes but torch.distributed has {dist.get_world_size()}"
            )
        created: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for dim in GROUP_DIMS:
            for ranks in self.group_ranks(dim):
                key = tuple(ranks)
                if key not in created:
                    created[key] = dist.new_group(ranks, backend=backend, group_desc=dim)  # the name flight-recorder dumps show
                if self.rank in ranks:
                    self._groups[dim] = created[key]

    def group(self, dim: str) -> dist.ProcessGroup | None:
        if self.world_size == 1:
            return None
        if dim not in self._groups:
            raise RuntimeError(f"the {dim} process group does not exist yet: call mesh.init_process_groups() first")
        return self._groups[dim]

    tp_rank, tp_group = _accessors("tp")
    cp_rank, cp_group = _accessors("cp")
    dp_rank, dp_group = _accessors("dp")
    pp_rank, pp_group = _accessors("pp")
    etp_rank, etp_group = _accessors("etp")
    ep_rank, ep_group = _accessors("ep")
    edp_rank, edp_group = _accessors("edp")
    etp_ep_rank, etp_ep_group = _accessors("etp_ep")
    dp_cp_rank, dp_cp_group = _accessors("dp_cp")

    @property
    def dp_cp(self) -> int:
        """Ranks that reduce a dense parameter's gradient together (data x context parallel)."""
        return self.size("dp_cp")

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (expert data parallel)."""
        return self.size("edp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0



@dataclass(frozen=True)
class ShapeGroup:
    """A group's size and this rank's place in it, standing in for a process group where none
    exists (``ShapeMesh``): the parallel modules read both (``tensor_parallel.group_size``)."""

    size: int
    rank: int


@dataclass
class ShapeMesh(Mesh):
    """A mesh of sizes with no process group: rank 0's place in the grid, each group a
    ``ShapeGroup``. The plan applied over it to a model on the meta device gives the shards'
    shapes and records a rank of that layout would hold (``parallel/sizes.py``), with no
    process started; nothing on it may communicate."""

    def group(self, dim: str) -> ShapeGroup:
        return ShapeGroup(self.size(dim), self.coords()[dim])


def launch_env() -> tuple[int, int, int]:
    """(world size, rank, local rank) from torchrun's variables, else SLURM's, else one process."""
    env = os.environ
    if "WORLD_SIZE" in env and "RANK" in env:
        return int(env["WORLD_SIZE"]), int(env["RANK"]), int(env.get("LOCAL_RANK", "0"))
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        return int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0"))
    return 1, 0, 0


def restart_store_note() -> str | None:
    """torchrun --max-restarts sharing its agent's store with the workers (PyTorch's default since
    2.5): the store outlives an attempt, so restarted workers can read the dead attempt's keys (a
    peer's old address: connection refused, or a hang). pytorch/pytorch#135712, #167288."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) < 1:
        return None
    return ("note: torchrun keeps its store across restarts here, so a restarted job may fail to connect or hang on the last "
            "attempt's keys; start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch/pytorch#135712)")  # fmt: skip


def end_distributed() -> None:
    """Destroy the process groups once a run is over. Left to the interpreter's exit, the backends'
    threads could be torn down still joinable and abort the process ("terminate called without an
    active exception", SIGABRT) after a run that had saved and stopped well: 4 of 8 tries of
    ``tests/e2e/test_agreed_stop.py`` on gloo did, 0 of 8 with this."""
    if dist.is_initialized():
        dist.destroy_process_group()


def init_distributed(parallel_cfg: ParallelConfig, device_type: str) -> Mesh:
    """Start ``torch.distributed`` for this launch (nccl/rccl on GPUs, gloo on the CPU) and build the mesh.

    On a GPU the process's device is set from its local rank first, so that NCCL communicators
    and every later ``.cuda()`` land on the GPU this process owns. One process: no
    ``torch.distributed`` at all.
    """
    world_size, rank, local_rank = launch_env()
    mesh = Mesh.from_config(parallel_cfg, world_size, rank, local_rank)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if world_size > 1 and not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise ConfigError(
                "MASTER_ADDR and MASTER_PORT must be set for a multi-process run (torchrun sets them; under srun "
                "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) and a free MASTER_PORT)"
            )
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(minutes=parallel_cfg.distributed_timeout_minutes))
    mesh.init_process_groups()
    return mesh

