"""Layout-invariant initialization, shared by every model family, and the materialization of a
model built on the ``meta`` device: each rank draws only the tensors, and the rows or columns of
them, that it keeps.

A weight's values depend on nothing but the seed, its name and its global shape: not on
construction order, on how many random numbers were drawn before, on which other layers exist,
or on the layout. It is drawn in chunks of whole rows (dim 0), each chunk from its own generator
keyed by (seed, name, chunk), so a rank holding some rows draws only their chunks, and one holding
some columns draws its rows chunk by chunk and keeps its columns: never more than a chunk
(``CHUNK_ELEMENTS``) beyond its shard. Stacked experts draw each global expert as a tensor of its
own (``name[e]``), so expert parallelism changes nothing either. Values are those of the device
drawn on (the CPU's and a GPU's generators differ), identical across layouts on one kind of device.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch
from torch import nn

from meshtron.layers.norms import FullWidthRMSNorm, RMSNorm
from meshtron.models.contract import ParamMeta

CHUNK_ELEMENTS = 1 << 18  # elements per generator draw (1 MiB in fp32): the most a rank draws beyond its shard


@dataclasses.dataclass(frozen=True)
class WeightInit:
    """A family's rule, by parameter name (Megatron's): N(0, ``std``) weights, ``residual_std``
    for names ending in ``residual_suffixes`` (the blocks' output projections, so the residual
    stream's variance does not grow with depth), zero biases, unit norm gains. Names ending in
    ``expert_suffixes`` are stacked experts [E, ...], drawn expert by expert."""

    std: float
    residual_std: float
    residual_suffixes: tuple[str, ...]
    expert_suffixes: tuple[str, ...] = ()

    @classmethod
    def scaled_by_depth(cls, std: float, num_layers: int, residual_suffixes: tuple[str, ...],
                        expert_suffixes: tuple[str, ...] = ()) -> "WeightInit":  # fmt: skip
        """``residual_std = std / sqrt(2 * num_layers)``, as GPT-2 and Megatron scale it."""
        return cls(std, std / math.sqrt(2 * num_layers), residual_suffixes, expert_suffixes)

    def std_of(self, name: str) -> float:
        return self.residual_std if name.endswith(self.residual_suffixes) else self.std


@torch.no_grad()
def init_weights(model: nn.Module, rule: WeightInit, seed: int | None = None) -> None:
    """Initialize every parameter of ``model`` that has storage, whole, by ``rule`` (``seed``
    default: the one given to ``torch.manual_seed``). A ``meta`` model is left undrawn."""
    seed = torch.initial_seed() if seed is None else seed
    norms = norm_parameters(model)
    for name, param in model.named_parameters():
        if not param.is_meta:
            _fill(name, id(param) in norms, param, rule, seed, ParamMeta(tuple(param.shape)))


@torch.no_grad()
def materialize(model: nn.Module, metas: dict[str, ParamMeta], rule: WeightInit, device: torch.device, seed: int) -> None:
    """Give every ``meta`` parameter of ``model`` (built on the meta device, then cut to this
    rank's shards and stages) storage on ``device`` and its values: this rank's part of the tensor
    the whole model would hold, where ``metas`` place it. Meta buffers (a router's statistics)
    start at zero. Parameters that already have storage are left as they are."""
    norms = norm_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    made: dict[int, nn.Parameter] = {}  # a parameter two modules share becomes one again
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                name = names[id(param)]
                local = torch.empty(param.shape, dtype=param.dtype, device=device)
                _fill(name, id(param) in norms, local, rule, seed, metas.get(name, ParamMeta(tuple(param.shape))))
                made[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
            module._parameters[key] = made[id(param)]
        for key, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[key] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)


@torch.no_grad()
def materialize_fully_sharded(model: nn.Module, metas: dict[str, ParamMeta], rule: WeightInit, device: torch.device, seed: int) -> None:
    """``materialize`` for a meta model already under FSDP2 (``fully_shard``): storage for this
    rank's FSDP shards only (``to_empty``, as FSDP2 wants), each drawn as the rows FSDP gives this
    rank (``torch.chunk`` of dim 0 over its mesh) of the tensor ``metas`` places here."""
    zeroed = [(m, key) for m in model.modules() for key, b in m._buffers.items() if b is not None and b.is_meta]
    norms, names = norm_parameters(model), {id(p): n for n, p in model.named_parameters()}
    model.to_empty(device=device)
    for module, key in zeroed:
        module._buffers[key].zero_()
    for module in model.modules():
        for param in module._parameters.values():
            if param is None or id(param) not in names:
                continue
            name = names.pop(id(param))
            local = param.to_local() if hasattr(param, "to_local") else param
            rows = None
            if hasattr(param, "device_mesh"):  # dim 0 cut by torch.chunk over the FSDP mesh
                per_rank = -(-param.shape[0] // param.device_mesh.size())
                start = param.device_mesh.get_local_rank() * per_rank
                rows = torch.arange(start, start + local.shape[0])
            _fill(name, id(param) in norms, local, rule, seed, metas.get(name, ParamMeta(tuple(param.shape))), rows)


def norm_parameters(model: nn.Module) -> set[int]:
    """The norms' gains and biases (unit gains, zero biases), full-width q/k norms (OLMoE's) included."""
    return {id(p) for m in model.modules() if isinstance(m, (nn.LayerNorm, RMSNorm, FullWidthRMSNorm)) for p in m.parameters()}


def _fill(name: str, is_norm: bool, out: torch.Tensor, rule: WeightInit, seed: int, meta: ParamMeta,
          rows: torch.Tensor | None = None) -> None:  # fmt: skip
    """Write this rank's part of parameter ``name`` into ``out`` (its local tensor); ``rows``: of
    the tensor ``meta`` places here, only these positions along dim 0 (an FSDP shard)."""
    if is_norm:
        out.fill_(1.0 if name.endswith("weight") else 0.0)
        return
    if name.endswith("bias"):
        out.zero_()
        return
    std, shape = rule.std_of(name), meta.global_shape
    index = meta.local_index() if meta.tp_size > 1 else None  # at tp 1 a split dim is whole
    if not (rule.expert_suffixes and name.endswith(rule.expert_suffixes)):
        if rows is not None and index is not None and meta.tp_size > 1:
            raise ValueError(f"{name}: FSDP's rows of a tensor-parallel shard are not drawn here (FSDP2 runs at tp 1)")
        _draw(name, seed, std, shape, *((meta.tp_dim, index) if rows is None else (0, rows)), out)
        return
    experts = meta.expert_index()
    experts = list(range(shape[0])) if experts is None else experts.tolist()
    experts = experts if rows is None else [experts[r] for r in rows.tolist()]
    inner = None if meta.tp_dim is None else meta.tp_dim - 1  # the dim within one expert's weight
    for i, expert in enumerate(experts):
        _draw(f"{name}[{expert}]", seed, std, shape[1:], inner, index, out[i])


def _draw(name: str, seed: int, std: float, shape: tuple[int, ...], dim: int | None, index: torch.Tensor | None,
          out: torch.Tensor) -> None:  # fmt: skip
    """Write into ``out`` the ``N(0, std)`` tensor of global ``shape`` keyed by (``seed``,
    ``name``), cut to ``index`` along ``dim`` (None: whole): drawn chunk of rows by chunk on
    ``out``'s device, so no more than a chunk exists beyond ``out``."""
    dim = None if index is None else dim
    shape = tuple(shape) or (1,)
    flat = out.view(shape) if dim is None else out
    rows, row_numel = shape[0], math.prod(shape[1:])
    per_chunk = max(1, CHUNK_ELEMENTS // max(1, row_numel))
    wanted = index.cpu() if dim == 0 else torch.arange(rows)
    chunk_of = wanted // per_chunk
    generator = torch.Generator(device=out.device)  # reseeded per chunk: making one per chunk costs more than the draw
    for chunk in torch.unique(chunk_of).tolist():
        start = chunk * per_chunk
        block = torch.empty((min(per_chunk, rows - start), *shape[1:]), device=out.device)
        block.normal_(0.0, std, generator=generator.manual_seed((seed * 1_000_003 + zlib.crc32(f"{name}#{chunk}".encode())) % 2**63))
        if dim is None:
            flat[start : start + block.shape[0]] = block
        elif dim != 0:
            flat[start : start + block.shape[0]] = block.index_select(dim, index.to(out.device))
        else:
            at = (chunk_of == chunk).nonzero().flatten()
            first, count = int(at[0]), len(at)
            picked = wanted[at] - start
            if int(at[-1]) - first + 1 == count and int(picked[-1]) - int(picked[0]) + 1 == count:  # one run of rows
                flat[first : first + count] = block[int(picked[0]) : int(picked[0]) + count]
            else:
                flat[at.to(out.device)] = block[picked.to(out.device)].to(out.dtype)
