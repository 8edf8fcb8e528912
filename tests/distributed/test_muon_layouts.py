"""Muon (``--optimizer muon``) under each layout against the one-process Muon run.

The whole training loop of ``test_trainer_layouts`` (same model, mock data, fp32 on the CPU,
clipping active), Muon's Newton-Schulz in fp32 (``--muon-fp32-matmul-prec high``; in bf16 a
rounding-level difference of the gradients can move a rounded value). Each layout's losses agree
with one process to 1e-5 relative, its grad norms to 1e-4, its final weights to 1e-4 relative or
1e-5 absolute (five Muon steps: each update is orthogonalized from gradients that differ by
rounding):

- tp2, and tp2 with one kv head copied on both ranks (``--muon-tp-mode duplicated``: each matrix
  gathered whole over tp, its q / k / v blocks orthogonalized apart, the local rows kept);
- dp2 with the distributed optimizer (layer-wise: each rank owns whole matrices, broadcast after
  the step), and tp2 x dp2 with it (4 processes, slow);
- FSDP2 at dp2 (each matrix's shards gathered whole for the update, the own shard kept);
- dp2 (replicated masters), cp2, pp2; a mixture of experts at ep2 (each rank's experts orthogonalized one by one, the router
  with AdamW), with and without the layer-wise distributed optimizer;
- checkpoints (masters and Muon's momentum buffers) saved under the layer-wise distributed
  optimizer, FSDP2 and tp2 resume bit for bit under their layout and continue in one process;
- ``--muon-tp-mode blockwise`` at tp2 differs from one process (each shard alone): the flag acts.
"""

import math

import pytest
import torch

from meshtron.config import build_config
from meshtron.training.trainer import Trainer
from tests.distributed.full_weights import full_weights
from tests.distributed.launcher import run_distributed
from tests.distributed.test_trainer_layouts import BASE, STEPS

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
MUON = BASE + ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high", "--lr", "2e-2"]
LAYOUTS = {  # name: (world size, extra flags, one-process reference)
    "tp2": (2, ["--tp", "2", "--micro-batch-size", "4"], "mbs8"),
    "tp2_kv1": (2, ["--tp", "2", "--micro-batch-size", "4", "--num-query-groups", "1"], "mbs8_kv1"),
    "dp2_distopt": (2, ["--micro-batch-size", "2", "--use-distributed-optimizer"], "mbs8"),
    "fsdp_dp2": (2, ["--micro-batch-size", "2", "--fsdp"], "mbs8"),
    "dp2": (2, ["--micro-batch-size", "2"], "mbs8"),
    "cp2": (2, ["--cp", "2", "--micro-batch-size", "8"], "mbs8"),
    "pp2": (2, ["--pp", "2", "--micro-batch-size", "2"], "mbs8"),
    "ep2_moe": (2, ["--ep", "2", *MOE, "--micro-batch-size", "4"], "moe_mbs8"),
    "ep2_moe_distopt": (2, ["--ep", "2", *MOE, "--micro-batch-size", "4", "--use-distributed-optimizer"], "moe_mbs8"),
    "tp2_blockwise": (2, ["--tp", "2", "--micro-batch-size", "4", "--muon-tp-mode", "blockwise"], "mbs8"),
    "tp2_dp2_distopt": (4, ["--tp", "2", "--micro-batch-size", "2", "--use-distributed-optimizer"], "mbs8"),
}
RESUMED = ("dp2_distopt", "fsdp_dp2", "tp2")  # their checkpoints resume exactly, and continue in one process
REFERENCES = {"mbs8": ["--micro-batch-size", "8"], "mbs8_kv1": ["--micro-batch-size", "8", "--num-query-groups", "1"],
              "moe_mbs8": ["--micro-batch-size", "8", *MOE]}  # fmt: skip


def _run(flags: list[str]) -> dict:
    trainer = Trainer(build_config(None, MUON + flags), log=lambda _: None)
    result = trainer.run()
    memory = trainer.optimizer.memory_bytes() if hasattr(trainer.optimizer, "memory_bytes") else 0
    return {"losses": result.losses, "grad_norms": result.grad_norms, "optimizer_bytes": memory,
            "weights": full_weights(trainer.model, trainer.runner.metas, trainer.mesh)}  # fmt: skip


def _layouts(rank: int, world_size: int, names: list[str], tmp: str = "") -> dict:
    out = {name: _run(LAYOUTS[name][1]) for name in names}
    for name in RESUMED if tmp else ():
        flags, ckpt = LAYOUTS[name][1] + ["--save", f"{tmp}/{name}"], f"{tmp}/{name}"
        first = Trainer(build_config(None, MUON + flags + ["--exit-interval", "2"]), log=lambda _: None).run()
        second = Trainer(build_config(None, MUON + flags + ["--load", ckpt]), log=lambda _: None).run()
        out[f"{name} resumed"] = first.losses + second.losses
        more = ["--train-iters", str(STEPS + 2), "--load", ckpt, "--no-load-rng"]
        out[f"{name} continued"] = Trainer(build_config(None, MUON + LAYOUTS[name][1] + more), log=lambda _: None).run().losses
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def one_process():
    return {name: _run(flags) for name, flags in REFERENCES.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    names = [n for n, (w, _, _) in LAYOUTS.items() if w == 2]
    tmp = tmp_path_factory.mktemp("muon")
    return {"tmp": tmp, **run_distributed(_layouts, 2, names, str(tmp), timeout=900)[0]}


def _close(a, b, rel):
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-7) for x, y in zip(a, b, strict=True))


def _assert_matches(got: dict, ref: dict, layout: str) -> None:
    assert _close(got["losses"], ref["losses"], 1e-5), (layout, got["losses"], ref["losses"])
    assert _close(got["grad_norms"], ref["grad_norms"], 1e-4), (layout, got["grad_norms"], ref["grad_norms"])
    for name, weight in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], weight, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{layout}: {name}: {m}")


@pytest.mark.parametrize("layout", ["tp2", "tp2_kv1", "dp2", "dp2_distopt", "fsdp_dp2", "cp2", "pp2", "ep2_moe", "ep2_moe_distopt"])
def test_muon_layout_matches_one_process(one_process, runs, layout):
    ref = one_process[LAYOUTS[layout][2]]
    assert len(set(ref["losses"])) == len(ref["losses"]) and min(ref["grad_norms"]) > 0.05  # moving, and clipped
    _assert_matches(runs[layout], ref, layout)


def test_layer_wise_ownership_halves_the_optimizer_state(one_process, runs):
    """Rank 0's masters and momentum under the layer-wise distributed optimizer at dp2: about half
    of one process's (whole parameters balanced by size: not exactly half)."""
    ratio = runs["dp2_distopt"]["optimizer_bytes"] / one_process["mbs8"]["optimizer_bytes"]
    assert 0.4 < ratio < 0.6, ratio


def test_blockwise_tp_mode_orthogonalizes_each_shard_alone(one_process, runs):
    ref, got = one_process["mbs8"]["weights"], runs["tp2_blockwise"]["weights"]
    qkv = "layers.0.self_attention.linear_qkv.weight"
    assert not torch.allclose(got[qkv], ref[qkv], rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_muon_tp2_dp2_distributed_optimizer_matches_one_process(one_process):
    got = run_distributed(_layouts, 4, ["tp2_dp2_distopt"], timeout=600)[0]["tp2_dp2_distopt"]
    _assert_matches(got, one_process["mbs8"], "tp2_dp2_distopt")


@pytest.mark.parametrize("layout", RESUMED)
def test_muon_checkpoint_resumes_exactly_and_reshards_to_one_process(runs, layout):
    """Momentum buffers saved at iteration 2 resume bit for bit under the same layout; the
    checkpoint of iteration 5 continues in one process as under its own layout (to 1e-5)."""
    assert runs[f"{layout} resumed"] == runs[layout]["losses"]
    flags = ["--micro-batch-size", "8", "--train-iters", str(STEPS + 2), "--load", str(runs["tmp"] / layout), "--no-load-rng"]
    result = Trainer(build_config(None, MUON + flags), log=lambda _: None).run()
    assert result.iteration == STEPS + 2
    assert _close(result.losses, runs[f"{layout} continued"], 1e-5), (result.losses, runs[f"{layout} continued"])
