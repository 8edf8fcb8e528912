"""``--fsdp``: fully sharded data parallelism through PyTorch's FSDP2 (``fully_shard``).

Why offer it beside the distributed optimizer: FSDP shards the parameters and gradients too,
not only the optimizer state, at the price of gathering each block's weights in forward and
backward. Each transformer block is its own FSDP unit (its all-gather overlaps the previous
block's compute), then the root takes what is left (embedding, final norm, output layer).

Precision: the sharded params stay fp32 and *are* the optimizer's masters (DTensors); FSDP
casts the gathered copy to ``param_dtype`` for compute and reduce-scatters gradients in
``reduce_dtype`` (fp32). So with ``--fsdp`` the model is not cast to bf16 by the caller.

Gradients are summed over the data-parallel ranks, not averaged (the divide factor is set to
1): the trainer already divides each micro batch's loss by the token count of the whole global
batch, as for ``GradBuffer``.

With expert parallelism the routed experts are FSDP units of their own, sharded over the
expert-data-parallel group (a DeviceMesh of its own: the ranks holding the same experts), while
the rest of each block is sharded over dp x cp as without experts; FSDP then reduce-scatters the
experts' gradients over edp only, and ``FSDPOptimizer`` sums their squares over etp x ep so the
gradient norm counts every expert slice once. (FSDP2 excludes tp, not etp: with etp > 1 the
experts' slices are etp shards of the expert grid, each sharded again over its edp group.)

Runs on gloo too (checked with torch 2.13 on the CPU: all-gather, reduce-scatter and bf16
mixed precision), so the same equivalence tests as the other data-parallel paths hold it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshtron.errors import ConfigError
from meshtron.models.contract import ParamMeta
from meshtron.optim.optimizer import MixedPrecisionOptimizer, ParamState, config_param_groups, optimizer_settings
from meshtron.parallel.mesh import Mesh

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
except ImportError:  # torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method


def apply_fsdp(model: nn.Module, mesh: Mesh, param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype = torch.float32,
               metas: dict[str, ParamMeta] | None = None, device_type: str = "") -> nn.Module:  # fmt: skip
    """Shard ``model`` (fp32, on its device, or on the meta device with ``device_type`` naming
    where it will run) over ``mesh.dp_cp_group``, block by block, in place; under expert
    parallelism the modules holding parameters ``metas`` reduce over "edp" (routed experts) over
    ``mesh.edp_group`` first.

    With one data-parallel rank the model is returned as it is (nothing to shard).
    """
    if mesh.tp > 1:
        raise ConfigError(
            f"--fsdp shards whole parameters over data parallel and does not combine with tensor parallelism "
            f"(tp {mesh.tp}); use --use-distributed-optimizer with tensor parallelism, or set tp to 1"
        )
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise ValueError(f"apply_fsdp wants an fp32 model (its shards are the fp32 masters), got {sorted(map(str, dtypes))}")
    if mesh.dp_cp == 1:
        return model
    from torch.distributed.device_mesh import DeviceMesh

    device_type = device_type or next(model.parameters()).device.type
    device_mesh = DeviceMesh.from_group(mesh.dp_cp_group, device_type)
    # Inputs keep their dtypes, as without FSDP (the RoPE tables stay fp32). FSDP's own cast runs in
    # its pre-forward hook, which it skips when activation recompute reruns a block in backward:
    # the rerun would then differ from the forward it replays.
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    if mesh.ep * mesh.etp > 1:  # experts reduce over edp, not dp x cp
        expert_mesh = DeviceMesh.from_group(mesh.edp_group, device_type)
        experts = _routed_expert_modules(model, metas or {})
        if not experts:
            raise ValueError("apply_fsdp under expert parallelism needs the plan's records (metas) to find the routed experts")
        for module in experts:
            fully_shard(module, mesh=expert_mesh, mp_policy=policy)
    for block in model.blocks():
        fully_shard(block, mesh=device_mesh, mp_policy=policy)
    fully_shard(model, mesh=device_mesh, mp_policy=policy)
    # The runner enters the model through ``run_stage``, not ``forward``: FSDP's root hooks
    # (gather the embedding, norm and output layer; reduce their gradients) must run around it.
    register_fsdp_forward_method(model, "run_stage")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A factor other than dp would become NCCL's PREMUL_SUM, which gloo lacks; plain SUM
            # (the factor 1 then needs no scaling at all) runs on both. Newer torch only.
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
    return model


def _routed_expert_modules(model: nn.Module, metas: dict[str, ParamMeta]) -> list[nn.Module]:
    """The modules whose own parameters are routed experts (gradients reduced over "edp")."""
    found = []
    for name, module in model.named_modules():
        own = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
        if own and all(n in metas and metas[n].grad_group == "edp" for n in own):
            found.append(module)
    return found


def _by_grad_group(pairs) -> list[tuple[str, list]]:
    """``(gradient group, item)`` pairs -> the items of each group, groups in first-seen order."""
    out: dict[str, list] = {}
    for key, item in pairs:
        out.setdefault(key, []).append(item)
    return list(out.items())


class FSDPGrads:
    """The optimizer's grad storage for an FSDP model: FSDP itself reduce-scatters every block's
    gradients during backward into the sharded params' fp32 ``.grad`` (and waits for them before
    backward returns), so this only zeroes them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def grad_of(self, param: nn.Parameter) -> torch.Tensor | None:
        return param.grad

    def zero_(self) -> None:
        for param in self.model.parameters():
            param.grad = None

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Does not skip the reduction: FSDP would then keep every unsharded gradient, in bf16, until
        the last micro batch, losing both its memory saving and fp32 accumulation. Each micro
        batch is reduce-scattered in fp32 and accumulated into the fp32 shards (as torchtitan does)."""
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        return None


class FSDPOptimizer(MixedPrecisionOptimizer):
    """AdamW over the FSDP-sharded fp32 params (DTensors): masters, moments and grads are 1/dp."""

    def _total_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The norm of DTensor shards is a DTensor; ``full_tensor`` completes it over the shards'
        mesh, per gradient group (dense over dp x cp, routed experts over edp); the experts' sum
        of squares is then completed over etp x ep, where each rank holds other expert slices."""
        masters = self._master_params()
        total = torch.zeros((), dtype=torch.float32, device=masters[0].device)
        for key, groups in self._partial_norm_groups.items():
            mine = [m.grad for m, k in zip(masters, self._grad_group_of) if k == key and m.grad is not None]
            if not mine:
                continue
            norm = torch.nn.utils.get_total_norm(mine, norm_type=2.0)
            squares = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float().square()
            for group in groups:
                dist.all_reduce(squares, group=group)
            total = total + squares
        return total.sqrt()

    def _scale_grads(self, grads: list[torch.Tensor], factor: torch.Tensor | float) -> None:
        """One foreach per gradient group: a foreach op cannot mix DTensors of two meshes. ``grads``
        are every master's gradient; they are taken again from the masters to know their groups."""
        for _, group_grads in _by_grad_group(zip(self._grad_group_of, [m.grad for m in self._master_params()])):
            present = [g for g in group_grads if g is not None]
            if present:
                torch._foreach_mul_(present, factor)

    def param_states(self) -> list[ParamState]:
        """Masters and moments are DTensor shards: each data-parallel rank holds (and writes) its own."""
        return [self._param_state(name, param, master, 0, False) for name, param, master in self._params]


def build_fsdp_optimizer(model: nn.Module, train_cfg: Any, compute_dtype: torch.dtype = torch.float32,
                         metas: dict[str, ParamMeta] | None = None, expert_group: dist.ProcessGroup | None = None) -> FSDPOptimizer:  # fmt: skip
    """The optimizer for a model that went through ``apply_fsdp`` (same weight-decay and
    ``--decoupled-lr`` groups as ``build_optimizer``; ``compute_dtype``, FSDP's ``param_dtype``, picks the loss scaler;
    ``expert_group`` the ranks holding other expert slices (etp x ep), None without them)."""
    # AdamW runs one foreach per parameter group: routed experts (DTensors over edp) get their own.
    grad_group = {name: metas[name].grad_group for name in metas} if metas is not None else {}
    groups = [{**group, "params": params} for group in config_param_groups(model, train_cfg, metas)
              for _, params in _by_grad_group((grad_group.get(name, "dp_cp"), (name, p)) for name, p in group["params"])]  # fmt: skip
    settings = optimizer_settings(train_cfg, compute_dtype)
    return FSDPOptimizer(groups, **settings, grads=FSDPGrads(model), metas=metas, expert_group=expert_group)
