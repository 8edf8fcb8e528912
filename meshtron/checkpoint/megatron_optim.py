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

Not read, with the reason printed (the weights are then written alone): the distributed
optimizer's default ``dp_reshardable`` format (flat buffers cut by Megatron's gradient buckets,
which depend on its data-parallel size and parameter order) and a legacy torch checkpoint's
optimizer (keyed by position in Megatron's parameter groups).
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
                "lr_warmup_iters", "lr_decay_iters", "lr_wsd_decay_iters", "micro_batch_size", "global_batch_size")  # fmt: skip


def model_space_kinds(ckpt: DistCheckpoint | LegacyCheckpoint) -> tuple[set[str], str | None]:
    """The optimizer tensors the checkpoint holds in model space (``exp_avg``, ``fp32_param``, ...)
    when both moments are there, and otherwise why its optimizer state is not imported (None: it
    has none)."""
    if isinstance(ckpt, LegacyCheckpoint):
        return set(), ("a legacy torch checkpoint keys its optimizer state by position in Megatron's parameter groups, "
                       "which is not read here" if ckpt.has_optimizer else None)  # fmt: skip
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


def megatron_step(ckpt: DistCheckpoint) -> int:
    """Adam's step count: Megatron keeps one for all params (``common_step``, or each param
    group's ``step`` for the distributed optimizer)."""
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
