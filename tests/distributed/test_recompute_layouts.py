"""Activation recompute as a user runs it: the trainer built from flags, with the defaults the CLI
gives (gradient-accumulation fusion on, fused kernels, the default grouped GEMM), against the same
run without recompute, in one process and under pp2, tp2 + sp, FSDP2 dp2, ep2 and cp2 on gloo.

Recompute reruns the same forward with the same random state, so on the CPU the losses, grad
norms and final weights are bit-equal to the run that kept its activations, in every layout.
Before the fix these runs failed at the first backward: a checkpoint's recompute hands saved
tensors back detached (the fused weight gradient lost ``main_grad``), and the grouped GEMM's
one-time probe inside the first forward made the recompute save fewer tensors than the forward.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtron.config import build_config
from meshtron.training.trainer import Trainer
from tests.distributed.full_weights import full_weights
from tests.distributed.launcher import run_distributed

BASE = [
    "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "1", "--num-layers", "4", "--hidden-size", "64",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--seq-length", "16", "--global-batch-size", "8",
    "--train-iters", "2", "--lr", "1e-2", "--eval-interval", "0", "--log-interval", "100", "--device", "cpu",
]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "0.01"]
RECOMPUTE = {  # name: (needs experts, flags)
    "full": (False, ["--recompute-granularity", "full"]),
    "full_block2": (False, ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"]),
    "moe_layer": (True, ["--moe-layer-recompute"]),
    "selective_moe": (True, ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe"]),
    "full_moe_layer": (True, ["--recompute-granularity", "full", "--moe-layer-recompute"]),
}
LAYOUTS = {  # name: (world size, flags, recompute settings run there)
    "one": (1, ["--micro-batch-size", "4"], list(RECOMPUTE)),
    "one_bf16": (1, ["--micro-batch-size", "4", "--bf16"], ["full", "moe_layer"]),
    "pp2": (2, ["--pp", "2", "--micro-batch-size", "2"], ["full", "moe_layer"]),
    "pp2_vpp2_bf16": (2, ["--pp", "2", "--virtual-pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--bf16"],
                      ["full", "full_moe_layer"]),
    "tp2_sp": (2, ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "4"], ["full", "moe_layer"]),
    "fsdp_dp2": (2, ["--fsdp", "--micro-batch-size", "2"], ["full", "moe_layer"]),
    "ep2_distopt": (2, ["--ep", "2", "--use-distributed-optimizer", "--micro-batch-size", "2"], ["full", "moe_layer", "selective_moe"]),
    "cp2": (2, ["--cp", "2", "--micro-batch-size", "4"], ["full", "moe_layer"]),
}


def _model(layout: str, setting: str) -> list[str]:
    """The layout's flags and the model the setting needs (experts for MoE recompute and for ep)."""
    flags = LAYOUTS[layout][1]
    return flags + (MOE if RECOMPUTE[setting][0] or "--ep" in flags else [])


def _cases() -> list[str]:
    return [f"{layout}/{setting}" for layout, (_, _, settings) in LAYOUTS.items() for setting in settings]


def _run(flags: list[str]) -> dict:
    trainer = Trainer(build_config(None, BASE + flags), log=lambda _: None)
    result = trainer.run()
    return {"losses": result.losses, "grad_norms": result.grad_norms,
            "weights": full_weights(trainer.model, trainer.runner.metas, trainer.mesh)}  # fmt: skip


def _pairs(rank: int, world_size: int, layouts: list[str]) -> dict | None:
    """Each case's (recomputed, plain) results; a layout's plain runs are shared by its settings."""
    out, plain = {}, {}
    for layout in layouts:
        for setting in LAYOUTS[layout][2]:
            model = _model(layout, setting)
            key = tuple(model)
            if key not in plain:
                plain[key] = _run(model)
            out[f"{layout}/{setting}"] = (_run(model + RECOMPUTE[setting][1]), plain[key])
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def runs():
    results = {}
    for world in sorted({w for w, _, _ in LAYOUTS.values()}):
        layouts = [name for name, (w, _, _) in LAYOUTS.items() if w == world]
        results.update(_pairs(0, 1, layouts) if world == 1 else run_distributed(_pairs, world, layouts, timeout=900)[0])
    return results


@pytest.mark.parametrize("case", _cases())
def test_recompute_equals_the_run_that_keeps_activations(runs, case):
    recomputed, plain = runs[case]
    assert recomputed["losses"] == plain["losses"], (recomputed["losses"], plain["losses"])
    assert recomputed["grad_norms"] == plain["grad_norms"]
    assert len(set(plain["losses"])) == len(plain["losses"])  # the model trains: each step's loss differs
    for name, weight in plain["weights"].items():
        assert torch.equal(recomputed["weights"][name], weight), f"{case}: {name}"


def test_cli_full_and_moe_layer_recompute(tmp_path):
    """The literal command a user types, defaults and all (fusion on), with both recompute kinds in
    one run (one interpreter's start is most of its time; each kind alone is compared above)."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "meshtron", "train", *BASE, "--micro-batch-size", "4", *MOE, *RECOMPUTE["full_moe_layer"][1]],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^iteration +2/2 ", proc.stdout, re.M), proc.stdout
