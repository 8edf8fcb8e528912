"""Build the optimizer of a model: its gradient storage, its parameter groups and the class that
fits the layout (replicated masters, or sharded over data parallel)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshtron.models.contract import ParamMeta
from meshtron.optim.distributed_optimizer import DistributedOptimizer
from meshtron.optim.grad_buffer import DEFAULT_BUCKET_SIZE, GradBuffer
from meshtron.optim.layer_wise import LayerWiseOptimizer
from meshtron.optim.optimizer import MOMENT_DTYPES, MixedPrecisionOptimizer, config_param_groups, fused_step_runs, optimizer_settings


def build_optimizer(
    model: nn.Module,
    train_cfg: Any,
    param_dtype: torch.dtype,
    *,
    metas: dict[str, ParamMeta] | None = None,
    dp_group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
    expert_group: dist.ProcessGroup | None = None,
    edp_group: dist.ProcessGroup | None = None,
    distributed: bool = False,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    reduce_dtype: torch.dtype = torch.float32,
    overlap_param_gather: bool = False,
) -> MixedPrecisionOptimizer:
    """The optimizer for a model already cast to ``param_dtype``.

    With a ``dp_group`` (several data-parallel x context-parallel ranks), gradients are summed
    over it in buckets of ``bucket_size`` elements during backward; ``distributed``
    (``--use-distributed-optimizer``) shards masters and the rules' state over those ranks instead
    of replicating them: AdamW's by flat ranges, Muon's and SGD's by whole parameters
    (``layer_wise.py``). The grad norm is completed over ``tp_group`` and ``pp_group`` (None: one rank).
    Parameters whose record says ``grad_group`` "edp" (routed experts) are reduced and sharded
    over ``edp_group`` instead, and their norm summed over ``expert_group`` (etp x ep) instead of tp.
    ``overlap_param_gather`` (with ``distributed``): the sharded step's parameter all-gathers run
    during the next forward of ``model``, each bucket waited by the first module that uses it.
    """
    if overlap_param_gather and not distributed:
        raise ValueError("--overlap-param-gather overlaps the distributed optimizer's parameter all-gather: add --use-distributed-optimizer")
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if dtypes != {param_dtype}:
        raise ValueError(
            f"the model's trainable parameters are {sorted(map(str, dtypes))} but param_dtype is {param_dtype}; "
            "cast the model before building the optimizer"
        )
    # Layout in registration order (GradBuffer reverses it to follow backward), not group order.
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    own_bucket = frozenset(n for n, _ in trainable if metas is not None and metas[n].pipeline_copy)
    grad_group_of = {n: metas[n].grad_group for n, _ in trainable} if metas is not None else {}
    # Muon and SGD shard over dp by whole parameters (``layer_wise.py``), AdamW by flat ranges (reduce-scattered).
    layer_wise = distributed and train_cfg.optimizer != "adam"
    grads = GradBuffer(trainable, group=dp_group, bucket_size=bucket_size, shard=distributed and not layer_wise, own_bucket=own_bucket,
                       groups={"edp": edp_group}, grad_group_of=grad_group_of, reduce_dtype=reduce_dtype)  # fmt: skip
    impl = train_cfg.optimizer_impl
    if impl == "auto":  # AdamW's fused step where it runs (one learning rate); a CPU under Triton's interpreter is for tests only
        fused = train_cfg.optimizer == "adam" and not train_cfg.decoupled_lr and grads.data.is_cuda and fused_step_runs(grads.data.device)
        impl = "fused" if fused else "reference"
    sharding = {"overlap_in": model if overlap_param_gather else None} if distributed and not layer_wise else {}
    cls = LayerWiseOptimizer if layer_wise else DistributedOptimizer if distributed else MixedPrecisionOptimizer
    return cls(
        config_param_groups(model, train_cfg, metas),
        **optimizer_settings(train_cfg, param_dtype),
        grads=grads,
        metas=metas,
        tp_group=tp_group,
        pp_group=pp_group,
        expert_group=expert_group,
        impl=impl,
        moment_dtypes=(MOMENT_DTYPES[train_cfg.exp_avg_dtype], MOMENT_DTYPES[train_cfg.exp_avg_sq_dtype]),
        **sharding,
    )
