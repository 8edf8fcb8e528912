"""The distributed optimizer (``--use-distributed-optimizer``, Megatron's ZeRO-1): fp32 masters
and Adam moments only for this rank's 1/dp of the parameters.

Why: masters and moments are 12 bytes per parameter, replicated on every data-parallel rank
they dominate memory; split over dp they shrink dp-fold, for the price of turning the gradient
all-reduce into a reduce-scatter plus a parameter all-gather (the same bytes on the wire).

Layout: the ``GradBuffer`` (built with ``shard=True``) cuts each bucket into dp equal slices;
rank r owns slice r of every bucket. Slice boundaries fall anywhere, through parameters too, so
each parameter this rank touches has one *piece*: the elements ``[start, end)`` of the flat
buffer that lie in its slice. AdamW runs on the pieces, which are views into per-bucket flat
tensors (masters, moments, and the reduced gradients in the buffer), so a step moves no data.
The model's params become views of one flat tensor in the buffer's layout, so after the step one
in-place all-gather per bucket writes every rank's updated slice into every rank's model: at once,
or with ``--overlap-param-gather`` during the next forward (``param_gather.py``).

The grad norm is the true global one: each rank sums the squares of its slices' gradients and the
sums are all-reduced over dp (then tp); an inf or nan anywhere makes it non-finite everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshtron.optim.optimizer import FlatSegment, MixedPrecisionOptimizer, ParamState, StepResult, flatten_params, group_index_of
from meshtron.optim.grad_buffer import GradBuffer, all_gather_single
from meshtron.optim.param_gather import ParamGather

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class _Piece:
    """The part of ``param`` this rank owns: buffer elements ``[start, end)``; ``offset`` is
    where ``param`` starts in the buffer, ``bucket`` the index of its bucket."""

    name: str
    param: nn.Parameter
    offset: int
    start: int
    end: int
    bucket: int
    master: torch.Tensor


class DistributedOptimizer(MixedPrecisionOptimizer):
    """``MixedPrecisionOptimizer`` whose masters and AdamW state are sharded over each bucket's
    group (dp x cp; the expert-data-parallel group for routed experts).

    Build it after the model is cast and placed: its params are re-pointed into a flat tensor.
    ``overlap_in``: the model (this rank's part) whose next forward waits each bucket's parameter
    gather (``--overlap-param-gather``); None: every step ends with the gathers done.
    """

    def __init__(self, param_groups: list[dict[str, Any]], *, grads: GradBuffer, overlap_in: nn.Module | None = None, **kwargs: Any) -> None:
        if not isinstance(grads, GradBuffer) or not grads.shard:
            raise ValueError("the distributed optimizer needs a GradBuffer built with shard=True (reduce-scatter)")
        if any(group["optimizer"] != "adam" for group in param_groups):
            raise ValueError("flat-range sharding cuts through matrices: Muon and SGD shard by whole parameters (LayerWiseOptimizer)")
        super().__init__(param_groups, grads=grads, **kwargs)
        self._param_gather = ParamGather(grads, self._param_flat, overlap_in)
        self._overlapped = overlap_in is not None
        for key, groups in self._partial_norm_groups.items():  # each rank holds 1/n of a group's gradients
            if grads.groups.get(key) is not None:
                groups.insert(0, grads.groups[key])

    # -- placement -----------------------------------------------------------------------------

    def _build_masters(self, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        buf = self.grads
        self._param_flat = flatten_params(buf)

        # Per bucket, this rank's slice [lo, hi) and its fp32 masters: in fp32 mode the model's own
        # slice (updated in place, then gathered), else an fp32 copy of it.
        self._slices = []
        for bucket in buf.buckets:
            lo, hi = buf.shard_range(bucket)
            own = self._param_flat[lo:hi]
            self._slices.append((lo, hi, own.float().clone() if self.mixed_precision else own))
        self._flat_moments = [{k: torch.zeros_like(m, dtype=d) for k, d in zip(_MOMENTS, self.moment_dtypes)} for _, _, m in self._slices]
        if self.fused:
            index = group_index_of(buf, param_groups)
            self._segments = [FlatSegment(buf.data[lo:hi], masters, moments["exp_avg"], moments["exp_avg_sq"],
                                          self._param_flat[lo:hi] if self.mixed_precision else None, index[lo:hi].clone())
                              for (lo, hi, masters), moments in zip(self._slices, self._flat_moments)]  # fmt: skip

        group_of = {id(param): i for i, group in enumerate(param_groups) for _, param in group["params"]}
        self._pieces: list[_Piece] = []
        for index, bucket in enumerate(buf.buckets):
            lo, hi, masters = self._slices[index]
            for param in bucket.params:
                a, b = buf.ranges[param]
                start, end = max(a, lo), min(b, hi)
                if start < end:
                    master = masters[start - lo : end - lo]
                    master.grad = buf.data[start:end]
                    self._pieces.append(_Piece(buf.names[param], param, a, start, end, index, master))
        self._piece_of = {id(p.master): p for p in self._pieces}
        master_groups = []
        for i, group in enumerate(param_groups):
            pairs = [(p.name, p.master) for p in self._pieces if group_of[id(p.param)] == i]
            if pairs:
                master_groups.append({**group, "params": pairs})
        return master_groups

    def _master_params(self) -> list[torch.Tensor]:
        return [p.master for p in self._pieces]

    def _master_owners(self) -> list[nn.Parameter]:
        return [p.param for p in self._pieces]

    def _master_names(self) -> list[str]:
        return [p.name for p in self._pieces]

    def _param_span(self, master: torch.Tensor) -> tuple[int, int]:
        piece = self._piece_of[id(master)]
        return piece.start - piece.offset, piece.end - piece.offset

    def _new_moments(self, master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views into per-bucket flat moments, so a checkpoint gathers each with one collective."""
        piece = self._piece_of[id(master)]
        lo = self._slices[piece.bucket][0]
        flat = self._flat_moments[piece.bucket]
        return tuple(flat[k][piece.start - lo : piece.end - lo] for k in _MOMENTS)

    def step(self, lr: float, decoupled_lr: float | None = None) -> StepResult:
        self.finish_param_sync()  # the step rewrites the slices the last step's gathers read
        return super().step(lr, decoupled_lr)

    def start_param_sync(self) -> None:
        self._param_gather.start()

    def finish_param_sync(self) -> None:
        self._param_gather.finish()

    def _copy_masters_to_model(self) -> None:
        self._publish_model(copy_masters=True)

    @torch.no_grad()
    def _publish_model(self, copy_masters: bool = False) -> None:
        """All-gather every bucket of the model in place from this rank's updated slice, first
        written from the masters with ``copy_masters`` (the fused step wrote it itself); with
        ``--overlap-param-gather`` the gathers are only owed, launched by ``start_param_sync``."""
        self._param_gather.finish()
        if copy_masters and self.mixed_precision:
            for lo, hi, masters in self._slices:
                self._param_flat[lo:hi].copy_(masters)
        self._param_gather.mark_due()
        if not self._overlapped:
            self._param_gather.finish()

    def finish_load(self, loss_scaler_state: dict[str, float]) -> None:
        super().finish_load(loss_scaler_state)
        self.finish_param_sync()  # a loaded model is whole at once, whatever reads it next

    @torch.no_grad()
    def reload_model_params(self) -> None:
        self.finish_param_sync()
        if self.mixed_precision:
            for lo, hi, masters in self._slices:
                masters.copy_(self._param_flat[lo:hi])

    # -- checkpointing ---------------------------------------------------------------------------

    def param_states(self) -> list[ParamState]:
        """This rank's pieces: each the slice ``[start, end)`` of its parameter it owns."""
        return [self._param_state(p.name, p.param, p.master, p.start - p.offset, False) for p in self._pieces]

    @torch.no_grad()
    def _gather(self, slices: list[torch.Tensor]) -> torch.Tensor:
        """The full flat fp32 tensor (buffer layout) from every rank's per-bucket ``slices``."""
        full = torch.zeros(self.grads.numel, dtype=torch.float32, device=self._param_flat.device)
        for bucket, (lo, hi, _), own in zip(self.grads.buckets, self._slices, slices):
            full[lo:hi].copy_(own)
            if bucket.group is not None:
                all_gather_single(full[bucket.start : bucket.end], full[lo:hi], group=bucket.group)
        return full

    def state_dict(self) -> dict[str, Any]:
        """The same form as ``MixedPrecisionOptimizer.state_dict`` (full fp32 tensors keyed by
        parameter name), for comparing or copying whole optimizer states; checkpoints do not use
        it (they write each rank's slices through ``param_states``).

        Cost: collective over dp, and every rank briefly holds the full masters and moments
        (3 x 4 bytes per parameter). The tensors are fresh copies, not live views: load through
        ``load_state_dict``, which keeps only this rank's slices.
        """
        full = {"master": self._gather([m for _, _, m in self._slices])}
        for key in _MOMENTS:
            full[key] = self._gather([flat[key] for flat in self._flat_moments])
        step = self.adamw.state[self._pieces[0].master]["step"]
        out: dict[str, Any] = {"master": {}, "state": {}, "loss_scaler": self._scaler_state()}
        for param, (a, b) in self.grads.ranges.items():
            name = self.grads.names[param]
            out["master"][name] = full["master"][a:b].view(param.shape)
            out["state"][name] = {"step": step.clone(), **{k: full[k][a:b].view(param.shape) for k in _MOMENTS}}
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep this rank's slice of each full tensor of ``state_dict``, then refresh the model.
        Collective over dp (the parameter all-gather)."""
        self.finish_param_sync()  # in fp32 the masters are the model slices an owed gather reads
        self._check_names(state_dict, list(self.grads.names.values()))
        for piece in self._pieces:
            lo, hi = piece.start - piece.offset, piece.end - piece.offset
            saved = state_dict["state"][piece.name]
            piece.master.copy_(state_dict["master"][piece.name].reshape(-1)[lo:hi])
            current = self.adamw.state[piece.master]
            current["step"].copy_(saved["step"])
            for key in _MOMENTS:
                current[key].copy_(saved[key].reshape(-1)[lo:hi])
        self.finish_load({k: v.item() for k, v in state_dict["loss_scaler"].items()})
