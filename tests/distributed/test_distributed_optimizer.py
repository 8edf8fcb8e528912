"""The distributed optimizer (masters and Adam state sharded over dp=2) equals the one-process run.

Same harness as ``test_data_parallel`` (the global batch split over 2 gloo processes, 2 micro
batches each, clipping active), here with reduce-scattered gradients, a sharded step and the
parameter all-gather. One spawn runs every case:

- fp32: losses, global grad norms, every gradient element (each rank checks the slices it
  owns; together they cover every parameter) and the params after 5 steps, to 1e-5 relative;
- bf16 params: against the one-process bf16 run, to a bf16 tolerance;
- memory: masters + moments per rank are half of the one-process optimizer's;
- checkpoint: a DCP save after 3 steps, loaded into a fresh model and optimizer, resumes with
  bit-identical next steps; loaded into the one-process optimizer it continues like the
  one-process run (the state dict is keyed by parameter name, whatever the dp size);
- the fused step (``--optimizer-impl fused``, Triton's interpreter; where Triton is installed and
  no GPU is present), sharded and replicated over dp: fp32, as the first case;
- ``--overlap-param-gather``: bit-equal to the gather at the end of the step (losses, norms,
  params; fp32, bf16 and the fused step), with gloo's real asynchronous gathers and with gathers
  that happen only at their wait (the other ranks' slices NaN until then, so a parameter read before its bucket's wait
  shows); a save right after a step (after ``finish_param_sync``) holds the gathered weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from full_weights import full_weights
from launcher import run_distributed
from meshtron.config import build_config
from meshtron.kernels import triton_available
from meshtron.optim import param_gather
from meshtron.optim.build import build_optimizer
from meshtron.optim.grad_buffer import all_gather_single
from meshtron.training.trainer import Trainer
from test_trainer_layouts import BASE
from test_data_parallel import (
    BUCKET,
    DP,
    MICRO_BATCHES,
    STEPS,
    TRAIN,
    assert_matches_reference,
    assert_rel_close,
    dp_mesh,
    make_model,
    reference,
    train,
)

BF16_RTOL = 2e-2
RESUME_AT = 3
# The fused step runs on the CPU only under Triton's interpreter, switched on before the spawn so
# every rank inherits it (on a GPU machine tests/gpu covers the kernel).
FUSED = triton_available() and not torch.cuda.is_available()


def _dist_opt(model, mesh, dtype=torch.float32, overlap=False):
    return build_optimizer(model, TRAIN, dtype, dp_group=mesh.dp_cp_group, distributed=True, bucket_size=BUCKET,
                           overlap_param_gather=overlap)  # fmt: skip


class _GatherAtWait:
    """Stands in for an asynchronous parameter all-gather: the other ranks' slices of ``out`` read
    NaN until ``wait()``, which gathers then (every rank waits in the same order, as the forward
    runs the same modules). A parameter read before its bucket's wait turns the loss NaN."""

    def __init__(self, out: torch.Tensor, own: torch.Tensor, group, async_op: bool) -> None:
        assert async_op
        self.out, self.own, self.group = out, own, group
        for rank, part in enumerate(out.chunk(dist.get_world_size(group))):
            if rank != dist.get_rank(group):
                part.fill_(float("nan"))

    def wait(self) -> bool:
        all_gather_single(self.out, self.own, group=self.group)
        return True


def gathers_at_wait() -> contextlib.AbstractContextManager:
    """Within: the parameter gathers of the distributed optimizer are ``_GatherAtWait``."""
    return mock.patch.object(param_gather, "all_gather_single", _GatherAtWait)


def _overlap_cases(run, mesh, ckpt_dir: str) -> dict:
    """--overlap-param-gather with gloo's asynchronous gathers, then with gathers at their wait; a
    DCP save right after step 3 (the trainer's order: finish the gathers, then save)."""
    out = {}
    for at_wait in (False, True):
        with gathers_at_wait() if at_wait else contextlib.nullcontext():
            model = make_model()
            opt = _dist_opt(model, mesh, overlap=True)
            out[f"overlap at_wait={at_wait}"] = run(model, opt, range(STEPS))
            model = make_model()
            opt = _dist_opt(model, mesh, overlap=True)
            run(model, opt, range(RESUME_AT))
            dcp.save({"model": model.state_dict()}, checkpoint_id=f"{ckpt_dir}/overlap{at_wait}")
    saved = {}
    for name in ("", "/overlapFalse", "/overlapTrue"):  # without overlap (the case above), then with
        saved[name] = make_model(seed=7).state_dict()
        dcp.load({"model": saved[name]}, checkpoint_id=ckpt_dir + name)
    out["overlap saves equal"] = [all(torch.equal(saved[name][k], v) for k, v in saved[""].items()) for name in list(saved)[1:]]
    return out


def _worker(rank: int, world_size: int, ckpt_dir: str, fused: bool) -> dict:
    mesh = dp_mesh(rank)
    run = lambda model, opt, steps: train(model, opt, steps, rank, DP, MICRO_BATCHES, mesh.dp_group)  # noqa: E731
    out = {}

    model = make_model()
    opt = _dist_opt(model, mesh)
    out["fp32"] = run(model, opt, range(STEPS))
    out["memory"] = opt.memory_bytes()

    model = make_model(torch.bfloat16)
    out["bf16"] = run(model, _dist_opt(model, mesh, torch.bfloat16), range(STEPS))
    with gathers_at_wait():  # the masters' copy into the model, then the gathers owed
        model = make_model(torch.bfloat16)
        out["bf16 overlap"] = run(model, _dist_opt(model, mesh, torch.bfloat16, overlap=True), range(STEPS))

    model = make_model()
    opt = _dist_opt(model, mesh)
    run(model, opt, range(RESUME_AT))
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=ckpt_dir)
    out["continued"] = run(model, opt, range(RESUME_AT, STEPS))

    fresh = make_model(seed=7)
    fresh_opt = _dist_opt(fresh, mesh)
    state = {"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_dir)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optimizer"])
    out["resumed"] = run(fresh, fresh_opt, range(RESUME_AT, STEPS))
    out.update(_overlap_cases(run, mesh, ckpt_dir))

    if fused:
        fused_train = dataclasses.replace(TRAIN, optimizer_impl="fused")
        for distributed in (True, False):
            model = make_model()
            opt = build_optimizer(model, fused_train, torch.float32, dp_group=mesh.dp_cp_group, distributed=distributed, bucket_size=BUCKET)
            assert opt.fused
            out[f"fused distributed={distributed}"] = run(model, opt, range(STEPS))
        with gathers_at_wait():  # the kernel writes this rank's slice of the model, the gathers are owed
            model = make_model()
            opt = build_optimizer(model, fused_train, torch.float32, dp_group=mesh.dp_cp_group, distributed=True, bucket_size=BUCKET,
                                  overlap_param_gather=True)  # fmt: skip
            out["fused overlap"] = run(model, opt, range(STEPS))
    return out


def test_distributed_optimizer_matches_one_process(tmp_path):
    if FUSED:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    runs = run_distributed(_worker, DP, str(tmp_path), FUSED)
    ref = reference()

    assert_matches_reference([r["fp32"] for r in runs], ref)
    for key in ("fused distributed=True", "fused distributed=False") if FUSED else ():
        assert_matches_reference([r[key] for r in runs], ref)
    assert_matches_reference([r["bf16"] for r in runs], reference(torch.bfloat16), rtol=BF16_RTOL)

    total = build_optimizer(make_model(), TRAIN, torch.float32).memory_bytes()
    assert sum(r["memory"] for r in runs) == total  # every element owned exactly once
    for r in runs:
        assert abs(r["memory"] - total / DP) <= 0.02 * total / DP

    for r in runs:
        assert r["continued"]["losses"] == r["resumed"]["losses"]
        assert r["continued"]["norms"] == r["resumed"]["norms"]
        for name, value in r["continued"]["params"].items():
            assert torch.equal(value, r["resumed"]["params"][name]), name

    for r in runs:
        pairs = [("overlap at_wait=False", "fp32"), ("overlap at_wait=True", "fp32"), ("bf16 overlap", "bf16")]
        for key, base in pairs + ([("fused overlap", "fused distributed=True")] if FUSED else []):
            assert r[key]["losses"] == r[base]["losses"], key
            assert r[key]["norms"] == r[base]["norms"], key
            for name, value in r[base]["params"].items():
                assert torch.equal(r[key]["params"][name], value), f"{key}: {name}"
        assert r["overlap saves equal"] == [True, True]  # the weights after step 3, as saved without overlap
    # dp 2 -> 1: the checkpoint resumes in one process as the one-process run would continue.
    model = make_model(seed=7)
    opt = build_optimizer(model, TRAIN, torch.float32)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(tmp_path))
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    one_process = train(model, opt, range(RESUME_AT, STEPS))
    assert_rel_close(torch.tensor(one_process["losses"]), torch.tensor(ref["losses"][RESUME_AT:]), 1e-5, "losses")
    for name, value in one_process["params"].items():
        assert_rel_close(value, ref["params"][name], 1e-5, f"param {name} after resuming in one process")


# The whole training loop (trainer, runner, pipeline schedules), --overlap-param-gather on (gathers
# at their wait) against off: bit-equal losses, grad norms, validation losses and final weights. The
# dp2 layout also saves every 2 steps, right after a step (its validation runs every 3): the
# iteration-2 checkpoint, loaded without optimizer state, resumes exactly as the one saved without
# overlap. The 4-process layouts take minutes on two cores: slow-marked.
OVERLAP_LAYOUTS = {  # name: (world size, flags)
    "dp2": (2, ["--micro-batch-size", "2"]),
    "dp2_tp2_sp": (4, ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "2"]),
    "dp2_pp2_interleaved": (4, ["--pp", "2", "--virtual-pipeline-model-parallel-size", "2", "--micro-batch-size", "1"]),
    "dp2_pp2_zbv": (4, ["--pp", "2", "--pipeline-schedule", "zbv", "--virtual-pipeline-model-parallel-size", "2", "--micro-batch-size", "1"]),
    "dp4_ep2_moe": (4, ["--ep", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--micro-batch-size", "2"]),
}
SAVED_LAYOUT = "dp2"


def _trainer_run(flags: list[str]) -> dict:
    trainer = Trainer(build_config(None, BASE + flags), log=lambda _: None)
    result = trainer.run()
    weights = full_weights(trainer.model, trainer.runner.metas, trainer.mesh)
    return {"losses": result.losses, "norms": result.grad_norms, "valid": result.valid_losses, "weights": weights}


def _overlap_layouts(rank: int, world_size: int, names: list[str], tmp: str) -> dict:
    out = {}
    for name in names:
        saved = name == SAVED_LAYOUT
        flags = OVERLAP_LAYOUTS[name][1] + ["--use-distributed-optimizer", "--ddp-bucket-size", "5000",
                                            "--eval-interval", "3" if saved else "2", "--eval-iters", "1"]  # fmt: skip
        for overlap in (False, True):
            save = ["--save", f"{tmp}/{name}{overlap}", "--save-interval", "2"] if saved else []
            with gathers_at_wait() if overlap else contextlib.nullcontext():
                out[f"{name} overlap={overlap}"] = _trainer_run(flags + save + (["--overlap-param-gather"] if overlap else []))
            if saved:
                resume = ["--load", f"{tmp}/{name}{overlap}", "--ckpt-step", "2", "--no-load-optim", "--no-load-rng", "--train-iters", "3"]
                out[f"{name} resumed overlap={overlap}"] = _trainer_run(flags + resume)["losses"]
    return out if rank == 0 else None


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_overlap_param_gather_in_the_training_loop_is_bit_equal(tmp_path, world):
    names = [name for name, (w, _) in OVERLAP_LAYOUTS.items() if w == world]
    runs = run_distributed(_overlap_layouts, world, names, str(tmp_path), timeout=600)[0]
    for name in names:
        off, on = runs[f"{name} overlap=False"], runs[f"{name} overlap=True"]
        assert all(map(math.isfinite, off["losses"])) and len(off["valid"]) >= 2, name
        for key in ("losses", "norms", "valid"):
            assert on[key] == off[key], (name, key, on[key], off[key])
        for weight, value in off["weights"].items():
            assert torch.equal(on["weights"][weight], value), (name, weight)
        if name == SAVED_LAYOUT:
            resumed = runs[f"{name} resumed overlap=True"]
            assert len(resumed) == 1 and resumed == runs[f"{name} resumed overlap=False"], resumed
