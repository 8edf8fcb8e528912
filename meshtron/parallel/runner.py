"""The runner: runs a step's micro batches through a parallel model and completes its gradients.

It is the one place that knows the layout when training: it cuts each micro batch (with what
the model derives from whole sequences, ``prepare_batch``) to this context-parallel rank's
tokens, runs the pipeline schedule over this rank's stages (one stage and a plain
forward-then-backward per micro batch when pp is 1: the same code), builds the
objective from the model's ``LossOutput`` and auxiliary terms, and after backward completes what
tensor and pipeline parallelism leave partial. The trainer sees ``forward_backward`` and
``finalize_grads`` only.

The objective of one micro batch is ``total / (global count) + sum(aux) / (micro batches x dp x cp)``:
the loss sum is divided by the count of the whole global batch (all data-parallel ranks), so
gradients summed over ranks equal the one-process gradient; auxiliary terms (the blocks', on any
stage, and the loss's own, on the last) are per-micro-batch means, averaged over every micro batch
of the global batch the same way. As micro batches hold equally many samples, a per-sample mean
over a micro batch (BERT's sentence-order loss) becomes exactly the global batch's per-sample mean.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from meshtron.kernels import step_cache
from meshtron.models import contract as mc
from meshtron.parallel.context_parallel import shard_batch_for_cp
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.pipeline import Stage, forward_backward, last_stage_rank, sum_stage_copies
from meshtron.parallel.pipeline_balance import PipelineCosts, describe_split
from meshtron.parallel.pipeline_schedules import bubble_fraction
from meshtron.parallel.plan import ParamMetas, finalize_tensor_parallel_grads


@dataclass
class Runner:
    """A parallel model ready to train: ``model`` (this rank's part, one-process parameter
    names), its records ``metas``, its pipeline ``stages`` (one when pp is 1), ``optimizer``,
    the layout, the compute ``dtype``, the ``schedule`` (``setup.schedule_kind``), and the
    pipeline ``split`` (every model chunk's blocks) with the modeled ``costs`` it balanced."""

    model: mc.ModelFamily
    metas: ParamMetas
    stages: list[Stage]
    optimizer: Any
    mesh: Mesh
    dtype: torch.dtype
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    split: list[range] = field(default_factory=list)
    costs: PipelineCosts | None = None
    # Every stage's auxiliary term (and metric) names, learnt at the first step.
    _names: dict[str, list[str]] = field(default_factory=dict, init=False, repr=False)

    def forward_backward(self, micro_batches: list[mc.Batch], forward_only: bool = False,
                         timed: Callable[[str], ContextManager] | None = None) -> mc.LossOutput:  # fmt: skip
        """Forward (and unless ``forward_only``, backward) every micro batch of this rank's share
        of a global batch; gradients accumulate into the optimizer's storage, reduced over data
        parallel during the last backward. Returns the global batch's loss on every rank: the
        loss sum over all its micro batches and ranks, its count (``total / count`` is the mean),
        and each auxiliary term's and metric's mean. ``timed``: the pipeline walk's section timer."""
        mesh, model = self.mesh, self.model
        batches = [shard_batch_for_cp(model.prepare_batch(b), mesh) for b in micro_batches]
        device = next(iter(batches[0].values())).device
        count = sum(model.loss_count(b) for b in batches).float()
        # Summed asynchronously, waited at the first loss: a data-parallel collective waited here would
        # make the forward wait for the parameter gathers queued before it (--overlap-param-gather).
        summing = dist.all_reduce(count, group=mesh.dp_cp_group, async_op=True) if mesh.dp_cp > 1 else None

        def global_count() -> torch.Tensor:
            if summing is not None:
                summing.wait()  # at once after the first time
            return count.clamp(min=1)

        num_micro_total = len(batches) * mesh.dp_cp
        totals: list[torch.Tensor] = []
        aux_logged: dict[str, torch.Tensor] = {}
        metrics_logged: dict[str, torch.Tensor] = {}

        def step(stage: Stage, carry: mc.Carry | None, mb: int) -> tuple[mc.Carry | None, torch.Tensor | None]:
            out, aux = stage.forward(carry, batches[mb])
            objective = None
            if stage.is_last:
                loss = model.loss(batches[mb], out)
                totals.append(loss.total.detach())
                objective = loss.total / global_count()
                aux = {**aux, **loss.aux}  # the loss's own terms (BERT's sentence order) count as the blocks' do
                for name, value in loss.metrics.items():
                    metrics_logged[name] = metrics_logged.get(name, 0.0) + value.detach().float() / num_micro_total
                out = None
            for name, term in aux.items():
                share = term / num_micro_total
                aux_logged[name] = aux_logged.get(name, 0.0) + share.detach()
                objective = share if objective is None else objective + share
            if objective is not None and not forward_only:
                objective = self.optimizer.scale_loss(objective)
            return out, objective

        seq_shards = mesh.tp if self.sequence_parallel else 1
        no_sync = None if forward_only else self.optimizer.no_sync
        # Several micro batches: values derived from the (unchanging) parameters, the FP8 linears'
        # and experts' weight copies, are made once for all of them (kernels.step_cache).
        with step_cache.scope() if len(batches) > 1 else contextlib.nullcontext():
            forward_backward(self.schedule, self.stages, batches, mesh, step, self.dtype, seq_shards,
                             no_sync=no_sync, forward_only=forward_only, timed=timed)  # fmt: skip
        total = torch.stack(totals).sum().float() if totals else torch.zeros((), device=device)
        if mesh.pp > 1:
            dist.broadcast(total, src=last_stage_rank(self.schedule, mesh, len(self.stages)), group=mesh.pp_group)
        aux = self._sum_terms("aux", aux_logged, device)
        metrics = self._sum_terms("metrics", metrics_logged, device)
        return mc.LossOutput(total=self._sum_over_dp(total), count=global_count(), aux=aux, metrics=metrics)

    def describe(self, num_micro_batches: int) -> str:
        """The schedule, with its theoretical bubble, and the split with its modeled costs, for
        the start-up log."""
        virtual = len(self.stages)
        bubble = bubble_fraction(self.schedule, self.mesh.pp, num_micro_batches, virtual)
        return (f"pipeline: {self.schedule} schedule, pp {self.mesh.pp} x {virtual} virtual stages, "
                f"{num_micro_batches} micro batches: theoretical bubble {100 * bubble:.1f}%\n"
                + describe_split(self.split, self.costs, self.schedule, self.mesh.pp, num_micro_batches))  # fmt: skip

    def finalize_grads(self) -> None:
        """Wait for the data-parallel reduction, then complete what tp and pp leave partial:
        sequence-parallel partial sums and replicated kv rows over tp, and the two pipeline copies
        of a tied embedding. Call after ``forward_backward``, before the optimizer's step."""
        self.optimizer.finish_grad_sync()
        grads = {}
        for name, param in self.model.named_parameters():
            grad = self.optimizer.grads.grad_of(param) if param.requires_grad else None
            if grad is not None:
                grads[name] = grad
        finalize_tensor_parallel_grads(grads, self.metas, self.mesh)
        sum_stage_copies([grads[n] for n in sorted(grads) if self.metas[n].pipeline_copy], self.mesh)

    @torch.no_grad()
    def after_step(self) -> None:
        """After the optimizer step: the model's per-step updates that are not gradients (a
        router's expert bias). Each ``StepStatistics`` module's tensor is summed over the ranks
        that saw other tokens of the step (dp x cp, and tp under sequence parallelism), all of
        them in one all-reduce, and handed back to it."""
        pending = [(m, m.step_statistics()) for m in self.model.modules() if isinstance(m, mc.StepStatistics)]
        pending = [(m, s) for m, s in pending if s is not None]
        if not pending:
            return
        flat = self._sum_over_dp(torch.cat([s.reshape(-1).double() for _, s in pending]))
        if self.sequence_parallel:
            dist.all_reduce(flat, group=self.mesh.tp_group)
        for (module, stats), total in zip(pending, flat.split([s.numel() for _, s in pending])):
            module.apply_step_statistics(total.view_as(stats).to(stats.dtype))

    def _sum_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        if self.mesh.dp_cp > 1:
            dist.all_reduce(value, group=self.mesh.dp_cp_group)
        return value

    def _sum_terms(self, kind: str, logged: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
        """Each auxiliary term's (or metric's) mean over the global batch, on every rank: terms
        arise on whichever stage holds their layer, so names are gathered over pp first."""
        names = self._names.get(kind)
        if names is None:
            names = sorted(logged)
            if self.mesh.pp > 1:  # once: a host round trip the steady state should not pay
                everyone: list[list[str]] = [[] for _ in range(self.mesh.pp)]
                dist.all_gather_object(everyone, names, group=self.mesh.pp_group)
                names = sorted({n for part in everyone for n in part})
            self._names[kind] = names
        if not names:
            return {}
        values = torch.stack([torch.as_tensor(logged.get(n, 0.0), device=device, dtype=torch.float32) for n in names])
        if self.mesh.pp > 1:
            dist.all_reduce(values, group=self.mesh.pp_group)
        return dict(zip(names, self._sum_over_dp(values)))
