"""AdamW over fp32 master weights, with fp32 gradient accumulation, loss scaling and clipping.

Why masters: a bf16/fp16 weight cannot absorb an update much smaller than itself (bf16 keeps 8
bits of mantissa), so the model's low-precision weights are only a rounded view of fp32 masters
that the optimizer owns and updates. Why fp32 accumulation: summing the gradients of many micro
batches in bf16 loses the small ones.

Gradients live in a grad storage object: by default a ``GradBuffer`` (one flat fp32 tensor, each
param's ``main_grad`` a view of it) that never communicates; data parallelism passes one that
reduces over the data-parallel group, FSDP passes its own. The optimizer's masters read their
``.grad`` from it with no copy. In fp32 mode the master *is* the parameter and its ``.grad`` the
buffer view, so the step is exactly ``clip_grad_norm_`` + ``torch.optim.AdamW``.

Where masters live is behind ``_build_masters`` / ``_master_params`` / ``_copy_masters_to_model``
so that the distributed optimizer (masters sharded over data-parallel ranks) can override
placement and keep ``step``'s logic.

Two implementations of the update (``--optimizer-impl``): ``reference``, the multiply of the
gradients by the clip coefficient, ``torch.optim.AdamW`` and the copy into the model; and
``fused``, one Triton kernel per flat stretch of parameters (``meshtron/kernels/fused_adamw.py``)
doing all three in one pass. The fused one needs flat tensors, so it lays the model's params,
the masters and the moments out in the gradient buffer's layout (``FlatSegment``), as the
distributed optimizer always does.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from meshtron.kernels import interpreted, triton_available
from meshtron.models.contract import ParamMeta, default_meta
from meshtron.optim.grad_buffer import GradBuffer
from meshtron.optim.loss_scaler import ConstantLossScaler, DynamicLossScaler
from meshtron.optim.muon import MuonSettings, plan_matrix
from meshtron.optim.update_rules import RuleSettings, build_rules, rule_of_param, run_rules

OPTIMIZER_IMPLS = ("auto", "fused", "reference")
# Storage of the Adam moments (``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``, with Megatron's
# --use-precision-aware-optimizer): the fused step reads them, updates in fp32 and rounds back.
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does (keeps fp32 runs identical to it).
_CLIP_EPS = 1e-6


@dataclass
class ParamState:
    """This rank's optimizer state of one parameter, as live tensors, for the sharded checkpoint.

    ``tensors`` (``master``, ``exp_avg``, ``exp_avg_sq``) hold the flat elements ``[start, start +
    numel)`` of the parameter's local (tensor-parallel) tensor of ``shape`` — all of it, or the
    distributed optimizer's slice; FSDP's are DTensors that carry their own placement. ``step`` is
    0-d. ``dp_replicated``: every data-parallel rank holds the same state (one of them writes it).
    """

    name: str
    shape: tuple[int, ...]
    start: int
    tensors: dict[str, torch.Tensor]
    step: torch.Tensor
    dp_replicated: bool


@dataclass
class FlatSegment:
    """Equal-length flat views of one stretch of parameters in the gradient buffer's layout, what
    the fused step updates: gradient, fp32 master and moments, the model's copy (None where the
    master is the model's own fp32 parameter) and each element's parameter-group index (uint8)."""

    grad: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    model: torch.Tensor | None
    group_index: torch.Tensor
    block_group: torch.Tensor | None = None  # the kernel's per-block summary of group_index, made at the first step


def fused_step_runs(device: torch.device) -> bool:
    """The fused step can run here: Triton installed, and a GPU (or its interpreter on the CPU)."""
    return triton_available() and (device.type == "cuda" or interpreted())


def flatten_params(buf: GradBuffer) -> torch.Tensor:
    """One flat tensor of the buffer's params in its layout (padding zero); each param becomes a
    view of it, so one flat write updates the model."""
    first = next(iter(buf.ranges))
    flat = torch.zeros(buf.numel, dtype=first.dtype, device=first.device)
    for param, (a, b) in buf.ranges.items():
        flat[a:b].copy_(param.detach().reshape(-1))
        param.data = flat[a:b].view_as(param)
    return flat


def group_index_of(buf: GradBuffer, param_groups: list[dict[str, Any]]) -> torch.Tensor:
    """[buffer elements] uint8: the index in ``param_groups`` (at most two: with and without weight
    decay) of the param each element belongs to."""
    if len(param_groups) > 2:
        raise ValueError(f"the fused optimizer step takes at most two parameter groups, got {len(param_groups)}")
    index = torch.zeros(buf.numel, dtype=torch.uint8, device=buf.data.device)
    for i, group in enumerate(param_groups):
        for _, param in group["params"]:
            a, b = buf.ranges[param]
            index[a:b] = i
    return index


@dataclass
class StepResult:
    """What one ``step`` did: the pre-clip global gradient norm (inf/nan when skipped), whether the
    update was skipped for an overflow, and the loss scale after the scaler's update (what Megatron logs)."""

    grad_norm: float
    skipped: bool
    loss_scale: float


class GradStorage(Protocol):
    """Where the gradients of a step accumulate and how they are synchronized (``GradBuffer``, or
    FSDP's own sharded ``.grad``)."""

    def grad_of(self, param: nn.Parameter) -> torch.Tensor | None: ...
    def zero_(self) -> None: ...
    def no_sync(self) -> contextlib.AbstractContextManager: ...
    def finish_grad_sync(self) -> Any: ...


def build_param_groups(model: nn.Module, weight_decay: float, metas: dict[str, ParamMeta] | None = None,
                       optimizer: str = "adam", decoupled: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """Weight decay where each parameter's record says (Megatron's split by default: every matrix,
    embeddings included, and no 1-D bias or norm gain), none elsewhere; each group names its
    update rule (``"optimizer"``: ``update_rules.rule_of_param``). With ``decoupled``
    (``--decoupled-lr``) the word embeddings and output layer (``ParamMeta.embedding_or_output``)
    form groups of their own, marked ``"decoupled_lr"``.

    Params are given as ``(name, tensor)`` pairs so torch keeps their names (``param_names``) in
    each group for logging. Frozen params are left out.
    """
    groups: dict[tuple[str, bool, bool], list] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            meta = metas[name] if metas is not None else default_meta(name, param)
            key = (rule_of_param(optimizer, meta.matrix), meta.weight_decay, decoupled and meta.embedding_or_output)
            groups.setdefault(key, []).append((name, param))
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0, "optimizer": rule, "decoupled_lr": own}
            for (rule, decay, own), params in sorted(groups.items(), key=lambda kv: (kv[0][0] != "muon", not kv[0][1], kv[0][2]))]  # fmt: skip


def config_param_groups(model: nn.Module, train_cfg: Any, metas: dict[str, ParamMeta] | None = None) -> list[dict[str, Any]]:
    """``build_param_groups`` as a run's train config asks: its weight decay, update rule and ``--decoupled-lr``."""
    return build_param_groups(model, train_cfg.weight_decay, metas, train_cfg.optimizer, bool(train_cfg.decoupled_lr))


class MixedPrecisionOptimizer:
    """The update rules of its groups (AdamW, SGD, Muon: ``update_rules.py``) on fp32 masters of a
    model whose params are fp32, bf16 or fp16.

    Per iteration the caller does: ``zero_grad()``; for each micro batch
    ``optimizer.scale_loss(loss).backward()``, every micro batch but the last inside
    ``optimizer.no_sync()``; then ``step(lr)``.

    ``grads``: the grad storage (default: a one-process ``GradBuffer`` of the params).
    ``metas``: each parameter's record (default: whole on one process). ``tp_group`` / ``pp_group``:
    the groups over which the grad norm is completed, each value counted once: split params on
    every tp rank, whole ones on tp rank 0, kv rows copied over tp on their first copy, a weight
    two pipeline stages hold on the first (``ParamMeta.counted_in_norm``, ``replicas``).
    ``expert_group``: the ranks holding the other slices of the routed experts (``grad_group``
    "edp"; the mesh's etp x ep group), over which their squares are summed instead of over tp
    (their grid is the expert one), before they join the rest over pp. ``impl``: "reference" or "fused" (the Triton step;
    needs a ``GradBuffer``, a device it runs on and AdamW in every group). ``rules``: SGD's and
    Muon's settings (Muon gathers tp-split matrices over ``tp_group``).
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        clip_grad: float,
        loss_scaler: ConstantLossScaler | DynamicLossScaler,
        grads: GradStorage | None = None,
        metas: dict[str, ParamMeta] | None = None,
        tp_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
        expert_group: dist.ProcessGroup | None = None,
        impl: str = "reference",
        moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
        rules: RuleSettings | None = None,
    ) -> None:
        named = [pair for group in param_groups for pair in group["params"]]
        metas = metas if metas is not None else {name: default_meta(name, p) for name, p in named}
        if not named:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ValueError(f"all trainable parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.mixed_precision = dtypes != {torch.float32}
        self.clip_grad = float(clip_grad)
        self.loss_scaler = loss_scaler
        self.grads = GradBuffer(named) if grads is None else grads
        if impl not in ("fused", "reference"):
            raise ValueError(f"--optimizer-impl must be fused or reference here, got '{impl}'")
        self.fused = impl == "fused"
        if self.fused and not (isinstance(self.grads, GradBuffer) and fused_step_runs(self.grads.data.device)):
            raise ValueError("--optimizer-impl fused needs Triton, a GPU and meshtron's gradient buffer (not FSDP); use reference")
        if self.fused and any(group["optimizer"] != "adam" for group in param_groups):
            raise ValueError("--optimizer-impl fused is AdamW's kernel; with --optimizer sgd or muon use --optimizer-impl reference (or auto)")
        if self.fused and any(group.get("decoupled_lr") for group in param_groups):
            raise ValueError("--optimizer-impl fused takes one learning rate; with --decoupled-lr use --optimizer-impl reference (or auto)")
        self.moment_dtypes = moment_dtypes
        if not self.fused and moment_dtypes != (torch.float32, torch.float32):
            raise ValueError("--exp-avg-dtype / --exp-avg-sq-dtype other than fp32 need the fused optimizer step (a GPU with Triton)")
        self._weight_decays = [group["weight_decay"] for group in param_groups]
        self._segments: list[FlatSegment] = []  # what the fused step updates (filled by _build_masters)
        self._host_step: int | None = None  # the fused step's count, read from the state once after a load

        master_groups = self._build_masters(param_groups)
        settings = rules or RuleSettings()
        self.rules = build_rules(master_groups, lr=lr, betas=betas, eps=eps, settings=settings,
                                 plan_of=lambda name, m: plan_matrix(metas[name], tuple(m.shape), settings.muon, tp_group))  # fmt: skip
        self.adamw = self.rules.get("adam")
        self._rule_of = {id(m): rule for rule in self.rules.values() for g in rule.param_groups for m in g["params"]}
        if self.adamw is not None:
            self._init_adam_state()
        self._norm_groups = [pp_group] if pp_group is not None else []
        # Per gradient group, the groups completing its partial sum of squares; keys from every
        # parameter (not only this rank's shards), so all ranks issue the same collectives.
        keys = sorted({metas[name].grad_group for name, _ in named})
        self._partial_norm_groups = {k: [g] if (g := expert_group if k == "edp" else tp_group) is not None else [] for k in keys}
        names = self._master_names()
        self._grad_group_of = [metas[name].grad_group for name in names]
        self._in_norm = [metas[name].counted_in_norm() for name in names]
        # Key/value rows copied to several tp ranks (fewer kv heads than ranks) count on their first copy only.
        self._norm_excluded = [self._replica_copies(metas[n], p, m) for n, p, m in zip(names, self._master_owners(), self._master_params())]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every rule's groups (``lr``, ``weight_decay``, ``param_names``, ``optimizer``), for logging."""
        return [group for rule in self.rules.values() for group in rule.param_groups]

    def _state(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state its rule keeps for ``master`` (AdamW's moments, SGD's or Muon's momentum, ``step``)."""
        return self._rule_of[id(master)].state[master]

    def zero_grad(self) -> None:
        self.grads.zero_()

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward passes inside accumulate without communicating (all micro batches but the last)."""
        return self.grads.no_sync()

    def finish_grad_sync(self) -> Any:
        """Wait for the gradient collectives (``step`` does it too); call it first when something
        must read the reduced gradients before the step (tensor-parallel fix-ups)."""
        return self.grads.finish_grad_sync()

    def start_param_sync(self) -> None:
        """Launch the parameter gathers the last step owes (``--overlap-param-gather``; nothing here)."""

    def finish_param_sync(self) -> None:
        """Make the model whole before something other than the training forward reads it: wait for
        the parameter gathers of ``--overlap-param-gather`` (nothing here)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        scale = self.loss_scaler.scale
        return loss if scale == 1.0 else loss * scale

    @torch.no_grad()
    def step(self, lr: float, decoupled_lr: float | None = None) -> StepResult:
        """Unscale, measure, maybe skip, clip, update the masters at ``lr`` (the groups marked
        ``"decoupled_lr"`` at ``decoupled_lr``), refresh the model.

        One reduction serves both the norm and the overflow check: the norm is inf/nan exactly
        when some gradient is. It is taken on the still-scaled gradients and divided by the scale,
        so unscaling and clipping become a single multiply of every gradient.
        """
        self.finish_grad_sync()
        grads = self._master_grads()
        scale = self.loss_scaler.scale
        norm = self._total_grad_norm(grads)
        if scale != 1.0:
            norm = norm / scale
        grad_norm = norm.item()
        found_inf = not math.isfinite(grad_norm)
        self.loss_scaler.update(found_inf)
        if found_inf:
            return StepResult(grad_norm, True, self.loss_scaler.scale)

        coef = None  # what every gradient is multiplied by: clip coefficient / loss scale, on the device
        if self.clip_grad > 0:
            coef = torch.clamp(self.clip_grad / (norm + _CLIP_EPS), max=1.0)
            coef = coef if scale == 1.0 else coef / scale
        elif scale != 1.0 or self.fused:
            coef = torch.full((), 1.0 / scale, device=norm.device)
        if self.fused:
            self._fused_step(coef, lr)
        else:
            if coef is not None:
                self._scale_grads(grads, coef)
            run_rules(self.rules, lr, decoupled_lr)
            self._copy_masters_to_model()
        return StepResult(grad_norm, False, self.loss_scaler.scale)

    def _fused_step(self, coef: torch.Tensor, lr: float) -> None:
        """AdamW over every flat segment in one kernel each; the step counters advance as AdamW's would."""
        from meshtron.kernels.fused_adamw import block_groups, fused_adamw  # Triton stays optional

        steps = [self.adamw.state[m]["step"] for m in self._master_params()]
        if self._host_step is None:
            self._host_step = int(steps[0].item()) if steps else 0
        self._host_step += 1
        torch._foreach_add_(steps, 1.0)
        for group in self.adamw.param_groups:
            group["lr"] = lr
        group = self.adamw.param_groups[0]
        decay = [1 - lr * wd for wd in self._weight_decays]
        for s in self._segments:
            if s.block_group is None:
                s.block_group = block_groups(s.group_index)
            fused_adamw(s.grad, s.master, s.exp_avg, s.exp_avg_sq, s.model, s.group_index, s.block_group, coef=coef,
                        decay=decay, step=self._host_step, lr=lr, betas=group["betas"], eps=group["eps"])  # fmt: skip
        self._publish_model()

    def _publish_model(self) -> None:
        """After the fused step wrote this rank's model copy: make it every rank's (nothing here)."""

    def _scale_grads(self, grads: list[torch.Tensor], factor: torch.Tensor | float) -> None:
        """Multiply every gradient by ``factor`` (FSDP's optimizer does it per sharding group)."""
        torch._foreach_mul_(grads, factor)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the masters from the model, after the model's weights were loaded without
        the optimizer's state (``--no-load-optim``); otherwise the next step would write the
        stale masters back over the loaded weights."""
        if self.mixed_precision:
            for _, param, master in self._params:
                master.copy_(param)

    def memory_bytes(self) -> int:
        """Bytes of fp32 masters and the rules' state this rank holds (masters counted even where they
        are the model's own fp32 params; the 4-byte step counters left out), and the fused step's
        per-element parameter-group index."""
        moments = [t for m in self._master_params() for k, t in self._state(m).items() if k != "step"]
        index = [s.group_index for s in self._segments] if self.fused else []
        return sum(t.numel() * t.element_size() for t in self._master_params() + moments + index)

    # -- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Tensors only, keyed by parameter name so a checkpoint survives reordering and resharding.

        ``{"master": {name: fp32}, "state": {name: {"step", "exp_avg", "exp_avg_sq"}},
        "loss_scaler": {key: 0-d float64}}``. Masters are saved in fp32 mode too (they are the
        params then), so a run may resume in another precision. The tensors are the live ones:
        DCP reads them to save and writes into them to load; deep-copy to keep a snapshot.
        """
        return {
            "master": {name: master for name, _, master in self._params},
            "state": {name: dict(self._state(master)) for name, _, master in self._params},
            "loss_scaler": self._scaler_state(),
        }

    def param_states(self) -> list[ParamState]:
        """Every parameter's master and moments, whole on this rank (``checkpoint/sharded.py``)."""
        return [self._param_state(name, param, master, 0, True) for name, param, master in self._params]

    def _param_state(self, name: str, param: nn.Parameter, master: torch.Tensor, start: int, dp_replicated: bool) -> ParamState:
        state = self._state(master)
        tensors = {"master": master, **{k: t for k, t in state.items() if k != "step"}}
        return ParamState(name, tuple(param.shape), start, tensors, state["step"], dp_replicated)

    @torch.no_grad()
    def finish_load(self, loss_scaler_state: dict[str, float]) -> None:
        """After a checkpoint was read into ``param_states()``' tensors in place: restore the loss
        scaler and write the masters into the model."""
        self._host_step = None
        self.loss_scaler.load_state_dict(loss_scaler_state)
        self._copy_masters_to_model()

    def _scaler_state(self) -> dict[str, torch.Tensor]:
        return {k: torch.tensor(float(v), dtype=torch.float64) for k, v in self.loss_scaler.state_dict().items()}

    @staticmethod
    def _check_names(state_dict: dict[str, Any], names: list[str]) -> None:
        for section in ("master", "state"):
            given = state_dict[section].keys()
            missing, extra = [n for n in names if n not in given], sorted(set(given) - set(names))
            if missing or extra:
                raise ValueError(
                    f"optimizer state '{section}' does not match the model: missing {missing[:5]}, "
                    f"unexpected {extra[:5]} (was it saved from another model?)"
                )

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a ``state_dict()`` into this optimizer in place (sources may alias its own tensors)."""
        self._check_names(state_dict, [name for name, _, _ in self._params])
        for name, _, master in self._params:
            master.copy_(state_dict["master"][name])
            current, saved = self._state(master), state_dict["state"][name]
            if current.keys() != saved.keys():
                raise ValueError(f"optimizer state of '{name}' has keys {sorted(saved)}, expected {sorted(current)}")
            for key, value in saved.items():
                current[key].copy_(value)
        self.finish_load({k: v.item() for k, v in state_dict["loss_scaler"].items()})

    # -- placement (the distributed optimizer overrides these) --------------------------------

    def _build_masters(self, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Make ``self._params`` [(name, model param, fp32 master)] and return AdamW's groups of
        masters. In fp32 mode the master is the param; either way its ``.grad`` is the storage's.
        The fused step's flat layout: params, masters and moments are views of flat tensors."""
        self._params: list[tuple[str, nn.Parameter, torch.Tensor]] = []
        self._owner_of: dict[int, nn.Parameter] = {}
        if self.fused:
            model_flat = flatten_params(self.grads)
            master_flat = model_flat.float() if self.mixed_precision else model_flat
            exp_avg, exp_avg_sq = (torch.zeros_like(master_flat, dtype=d) for d in self.moment_dtypes)
            self._segments = [FlatSegment(self.grads.data, master_flat, exp_avg, exp_avg_sq,
                                          model_flat if self.mixed_precision else None, group_index_of(self.grads, param_groups))]  # fmt: skip
        master_groups = []
        for group in param_groups:
            pairs = []
            for name, param in group["params"]:
                if self.fused and self.mixed_precision:
                    master = self._flat_view(self._segments[0].master, param)
                else:
                    master = param.detach().to(torch.float32, copy=True) if self.mixed_precision else param
                master.grad = self.grads.grad_of(param)
                self._params.append((name, param, master))
                self._owner_of[id(master)] = param
                pairs.append((name, master))
            master_groups.append({**group, "params": pairs})
        return master_groups

    def _replica_copies(self, meta: ParamMeta, param: nn.Parameter, master: torch.Tensor) -> torch.Tensor | None:
        """Flat indices into ``master`` of the kv rows this rank holds as a non-counted copy."""
        rep = meta.replicas()
        if rep is None or rep.counted:
            return None
        row = param[0].numel() if param.dim() > 1 else 1
        flat = (rep.local.to(master.device)[:, None] * row + torch.arange(row, device=master.device)).reshape(-1)
        lo, hi = self._param_span(master)
        flat = flat[(flat >= lo) & (flat < hi)] - lo
        return flat if flat.numel() else None

    def _param_span(self, master: torch.Tensor) -> tuple[int, int]:
        """The flat elements ``[lo, hi)`` of its param that ``master`` holds (all of them here)."""
        return 0, master.numel()

    def _master_params(self) -> list[torch.Tensor]:
        return [master for _, _, master in self._params]

    def _master_owners(self) -> list[nn.Parameter]:
        """The model param each of ``_master_params()`` belongs to."""
        return [param for _, param, _ in self._params]

    def _master_names(self) -> list[str]:
        """The name of the model param each of ``_master_params()`` belongs to."""
        return [name for name, _, _ in self._params]

    def _master_grads(self) -> list[torch.Tensor]:
        """fp32 gradients, already accumulated over micro batches (and reduced over data parallel)."""
        return [m.grad for m in self._master_params() if m.grad is not None]

    def _total_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm, as a 0-d fp32 tensor (no host sync here).

        With reduction groups (tensor parallel; the data-parallel shards of the distributed
        optimizer; expert parallel) each rank sums the squares of the gradients it counts and the
        sums are all-reduced; a param replicated over tp counts on tp rank 0 only. Each gradient
        group's sum is completed over its own groups (routed experts over etp x ep, and over edp
        when sharded; the rest over tp, and over dp x cp when sharded), then the total over pp.
        """
        if not self._norm_groups and not any(self._partial_norm_groups.values()):
            if self.fused:  # the flat buffer whole (its padding is zero): one pass, not a kernel per param
                from meshtron.kernels.fused_adamw import sum_of_squares

                return sum_of_squares([s.grad for s in self._segments]).sqrt()
            return torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        masters = self._master_params()
        total = torch.zeros((), dtype=torch.float32, device=masters[0].device)
        for key, groups in self._partial_norm_groups.items():
            mine = [(m, excluded) for m, k, keep, excluded in zip(masters, self._grad_group_of, self._in_norm, self._norm_excluded)
                    if k == key and keep and m.grad is not None]  # fmt: skip
            squares = torch.zeros((), dtype=torch.float32, device=masters[0].device)
            if mine:
                squares += torch.stack(torch._foreach_norm([m.grad for m, _ in mine])).square().sum()
            for master, excluded in mine:
                if excluded is not None:
                    squares -= master.grad.reshape(-1)[excluded].square().sum()
            for group in groups:
                dist.all_reduce(squares, group=group)
            total += squares
        for group in self._norm_groups:
            dist.all_reduce(total, group=group)
        return total.sqrt()

    @torch.no_grad()
    def _copy_masters_to_model(self) -> None:
        if self.mixed_precision:
            torch._foreach_copy_([p for _, p, _ in self._params], self._master_params())

    def _init_adam_state(self) -> None:
        """Allocate AdamW's state now, exactly as its lazy first-step init would (zero moments,
        ``step`` a 0-d fp32 tensor, on the device only for fused/capturable), so a checkpoint
        can be loaded in place before the first step and every param has state to save."""
        for group in self.adamw.param_groups:
            step_on_device = group["fused"] or group["capturable"]
            for master in group["params"]:
                exp_avg, exp_avg_sq = self._new_moments(master)
                self.adamw.state[master] = {
                    "step": torch.zeros((), dtype=torch.float32, device=master.device if step_on_device else "cpu"),
                    "exp_avg": exp_avg,
                    "exp_avg_sq": exp_avg_sq,
                }

    def _new_moments(self, master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero first and second moments for ``master`` (AdamW updates them in place); views of
        the flat moments for the fused step."""
        if self.fused:
            param = self._owner_of[id(master)]
            return self._flat_view(self._segments[0].exp_avg, param), self._flat_view(self._segments[0].exp_avg_sq, param)
        return tuple(torch.zeros_like(master, memory_format=torch.preserve_format) for _ in range(2))

    def _flat_view(self, flat: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        """``param``'s elements of a flat tensor in the gradient buffer's layout, shaped like it."""
        a, b = self.grads.ranges[param]
        return flat[a:b].view_as(param)


def build_loss_scaler(train_cfg: Any, param_dtype: torch.dtype) -> ConstantLossScaler | DynamicLossScaler:
    """fp16 needs a dynamic scaler (its gradients underflow); bf16 and fp32 need none."""
    if param_dtype != torch.float16:
        return ConstantLossScaler(1.0)
    return DynamicLossScaler(
        initial_scale=train_cfg.initial_loss_scale,
        min_scale=train_cfg.min_loss_scale,
        growth_interval=train_cfg.loss_scale_window,
        hysteresis=train_cfg.hysteresis,
    )


def muon_settings(t: Any) -> MuonSettings:
    """Muon's settings from the train config (its ``muon_*`` fields)."""
    return MuonSettings(momentum=t.muon_momentum, nesterov=t.muon_nesterov, split_qkv=t.muon_split_qkv, num_ns_steps=t.muon_num_ns_steps,
                        coefficient_type=t.muon_coefficient_type, scale_mode=t.muon_scale_mode, extra_scale_factor=t.muon_extra_scale_factor,
                        fp32_matmul_prec=t.muon_fp32_matmul_prec, tp_mode=t.muon_tp_mode)  # fmt: skip


def optimizer_settings(train_cfg: Any, compute_dtype: torch.dtype) -> dict[str, Any]:
    """The rules' hyper-parameters (AdamW's, SGD's, Muon's), clipping and the loss scaler, from the train config."""
    t = train_cfg
    return dict(
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        clip_grad=t.clip_grad,
        loss_scaler=build_loss_scaler(t, compute_dtype),
        rules=RuleSettings(sgd_momentum=t.sgd_momentum, muon=muon_settings(t)),
    )
