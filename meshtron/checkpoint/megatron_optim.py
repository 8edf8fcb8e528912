"""Megatron-LM's Adam state into meshtron's optimizer, where Megatron keeps it in model space.

Megatron-Core's torch_dist checkpoint holds the optimizer's tensors in the weights' own space
(``optimizer.state.{exp_avg,exp_avg_sq}.{the weight's key}``, same shape and layer stacking) for
its plain optimizers (fp32; bf16/fp16 add the fp32 main params as ``fp32_param``) and for the
distributed optimizer's ``fully_reshardable`` and ``fully_sharded_model_space`` formats (main
params as ``param`` / ``fp32_param``); the step is one count for all params in the common state
(``common_step``, or the param groups' ``step``). That is read by the weights' names into a
one-process meshtron optimizer saved beside them, so a resumed run takes the steps Megatron's
would have taken: the main params become the weights (they are the precise ones), the moments and
step Adam's state. Adam's settings (lr schedule, betas, eps, weight decay, clipping) come from
``args`` into the saved config.

A legacy torch checkpoint keeps each rank's optimizer ``state_dict()`` in its
``model_optim_rng.pt``: torch's Adam state keyed by position (``legacy_adam``), the mixed-precision
optimizer's fp32 main params as ``fp32_from_fp16_params`` lists in the same order. The positions
run through Megatron's param groups in order, each group's params in the model's construction
order (``named_parameters`` over the model chunks, which is the order of the saved state dicts);
Megatron's standard groups are the weight-decayed params, then those without (``wd_mult`` 0:
biases and 1-D params). Those groups are rebuilt from the saved model state and checked against
the saved groups' sizes and every moment's shape; other group layouts (a decoupled LR, lr_mult,
expert-parallel groups) are refused with the reason printed.

Not read, with the reason printed (the weights are then written alone): the distributed
optimizer's default ``dp_reshardable`` format (flat buffers cut by Megatron's gradient buckets,
which depend on its data-parallel size and parameter order), in either format.
"""

from __future__ import annotations

from typing import Any

import torch

from meshtron.checkpoint.megatron_files import DistCheckpoint, LegacyCheckpoint
from meshtron.errors import CheckpointError
from meshtron.optim.lr_schedule import STYLES

PREFIX = "optimizer.state."
MOMENTS = ("exp_avg", "exp_avg_sq")
MASTERS = ("fp32_param", "param")  # plain mixed-precision optimizer / distributed optimizer
# Megatron's args -> meshtron's TrainConfig fields of the same meaning (and name).
TRAIN_FIELDS = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "train_iters",
                "lr_warmup_iters", "lr_warmup_fraction", "lr_decay_iters", "lr_wsd_decay_iters", "decoupled_lr", "decoupled_min_lr",
                "micro_batch_size", "global_batch_size")  # fmt: skip


class LegacyOptimizerUnread(CheckpointError):
    """A legacy optimizer state whose positions cannot be tied to the weights with certainty."""


def model_space_kinds(ckpt: DistCheckpoint | LegacyCheckpoint) -> tuple[set[str], str | None]:
    """The optimizer tensors the checkpoint holds in model space (``exp_avg``, ``fp32_param``, ...)
    when both moments are there, and otherwise why its optimizer state is not imported (None: it
    has none)."""
    if isinstance(ckpt, LegacyCheckpoint):
        first = ckpt.first_file()
        if "optimizer" not in first:
            return set(), None
        try:
            return set(legacy_adam(first, ckpt.chunks, ckpt.directory)) - {"step"}, None
        except LegacyOptimizerUnread as exc:
            return set(), str(exc)
    kinds = {key[len(PREFIX) :].split(".")[0] for key in ckpt.shapes if key.startswith(PREFIX)}
    if set(MOMENTS) <= kinds:
        return kinds, None
    saved = [k for k in [*ckpt.shapes, *ckpt.objects] if k.startswith("optimizer.")]
    if not saved:
        return set(), None
    layout = _find(ckpt.common.get("optimizer"), "param_state_sharding_type") or "an unknown"
    return set(), (f"it is in the distributed optimizer's {layout!r} layout, cut by Megatron's gradient buckets; "
                   "save with --dist-ckpt-optim-fully-reshardable for a portable one")  # fmt: skip


def _find(tree: Any, key: str) -> Any:
    """The first value of ``key`` in nested dicts and lists (depth first), or None."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        for item in tree:
            if (found := _find(item, key)) is not None:
                return found
    return None


def megatron_step(ckpt: DistCheckpoint | LegacyCheckpoint) -> int:
    """Adam's step count: Megatron keeps one for all params (``common_step``, or each param
    group's ``step`` for the distributed optimizer; a legacy file, torch's per-param ``step``)."""
    if isinstance(ckpt, LegacyCheckpoint):
        return legacy_adam(ckpt.first_file(), ckpt.chunks, ckpt.directory)["step"]
    state = ckpt.common.get("optimizer")
    step = _find(state, "common_step")
    if step is None:
        step = _find(_find(state, "param_groups"), "step")
    if step is None:
        raise CheckpointError(f"{ckpt.directory}: the common state's optimizer has neither 'common_step' nor a param group 'step'")
    return int(step.item() if isinstance(step, torch.Tensor) else step)


def train_fields(args: dict[str, Any]) -> dict[str, Any]:
    """meshtron's TrainConfig values of a Megatron run's optimizer and schedule ``args``."""
    values = {name: args[name] for name in TRAIN_FIELDS if isinstance(args.get(name), (int, float)) and not isinstance(args[name], bool)}
    style = str(args.get("lr_decay_style", "")).lower()
    if style in STYLES:
        values["lr_decay_style"] = style
    return values


@torch.no_grad()
def fill_optimizer(optimizer: Any, moments: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    """Put Megatron's moments (``{kind: {param name: tensor}}``) and step into a one-process
    meshtron optimizer's state, in place."""
    for ps in optimizer.param_states():
        for kind in MOMENTS:
            ps.tensors[kind].copy_(moments[kind][ps.name].reshape(ps.shape))
        ps.step.fill_(step)


def _legacy_param_order(models: list[dict[str, Any]], groups: list[dict[str, Any]], source: Any) -> list[tuple[int, str]]:
    """(chunk, model key) of each optimizer position: Megatron's standard param groups (see the
    module's docstring) rebuilt from the chunks' saved state dicts (``models``, in order)."""
    wd = [g.get("wd_mult") for g in groups]
    odd = [g for g in groups if g.get("lr_mult", 1.0) != 1.0 or g.get("is_expert_parallel") or g.get("is_decoupled_lr")]
    if odd or sorted(wd, reverse=True) != wd or not set(wd) <= {1.0, 0.0} or len(set(wd)) != len(wd):
        raise LegacyOptimizerUnread(f"{source}: its optimizer's param groups (wd_mult {wd}, lr_mult {[g.get('lr_mult') for g in groups]}) "
                                    "are not Megatron's standard two, whose order is rebuilt here")  # fmt: skip
    params = [(c, k) for c, model in enumerate(models) for k, v in model.items() if isinstance(v, torch.Tensor)]
    order = []
    for group in groups:
        decayed = group["wd_mult"] == 1.0
        members = [(c, k) for c, k in params if (k.endswith(".bias") or models[c][k].dim() == 1) != decayed]
        if len(members) != len(group.get("params", ())):
            raise LegacyOptimizerUnread(f"{source}: an optimizer param group of wd_mult {group['wd_mult']} holds "
                                        f"{len(group.get('params', ()))} params, the model's state {len(members)}")  # fmt: skip
        order += members
    return order


def legacy_adam(loaded: dict[str, Any], chunks: list[str], source: Any) -> dict[str, Any]:
    """One legacy rank's Adam state by its model keys: ``{kind: {chunk: {key: tensor}}}`` for the
    two moments (and ``fp32_param``, a mixed-precision run's main params), and ``step``."""
    optimizer, masters = loaded.get("optimizer"), None
    if isinstance(optimizer, dict) and "fp32_from_fp16_params" in optimizer:
        optimizer, masters = optimizer.get("optimizer"), optimizer["fp32_from_fp16_params"]
    if not (isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict) and isinstance(optimizer.get("param_groups"), list)):
        raise LegacyOptimizerUnread(f"{source}: its optimizer entry is not torch's Adam state (the distributed optimizer keeps "
                                    "its state apart, cut by Megatron's gradient buckets)")  # fmt: skip
    models = [loaded[c] for c in chunks]
    order = _legacy_param_order(models, optimizer["param_groups"], source)
    positions = [i for g in optimizer["param_groups"] for i in g.get("params", ())]
    out: dict[str, Any] = {kind: {c: {} for c in chunks} for kind in (*MOMENTS, *(["fp32_param"] if masters is not None else []))}
    steps = set()
    for (c, key), position in zip(order, positions, strict=True):
        entry = optimizer["state"].get(position)
        if not isinstance(entry, dict) or any(kind not in entry for kind in MOMENTS):
            raise LegacyOptimizerUnread(f"{source}: optimizer position {position} ({key}) has no Adam moments")
        for kind in MOMENTS:
            if not isinstance(entry[kind], torch.Tensor) or entry[kind].shape != models[c][key].shape:
                raise LegacyOptimizerUnread(f"{source}: optimizer position {position} has {kind} of shape "
                                            f"{list(getattr(entry[kind], 'shape', []))}, its param {key} by Megatron's group order "
                                            f"{list(models[c][key].shape)}")  # fmt: skip
            out[kind][chunks[c]][key] = entry[kind]
        steps.add(int(entry["step"].item() if isinstance(entry.get("step"), torch.Tensor) else entry.get("step", -1)))
    if masters is not None:
        flat = [t for group in masters for t in group]
        if len(flat) != len(order) or any(getattr(t, "shape", None) != models[c][k].shape for t, (c, k) in zip(flat, order, strict=False)):
            raise LegacyOptimizerUnread(f"{source}: its fp32 main params do not follow the param groups' order")
        for t, (c, key) in zip(flat, order, strict=True):
            out["fp32_param"][chunks[c]][key] = t
    if len(steps) != 1 or min(steps) < 0:
        raise LegacyOptimizerUnread(f"{source}: its params' Adam steps are {sorted(steps)}, not one count")
    out["step"] = steps.pop()
    return out
