"""The whole training loop under each layout of the mesh against the one-process loop.

Same seed, same data (mock tokens), fp32 on the CPU, clipping active: the losses of every step and
the logged (global) grad norms agree with one process to 1e-5 and 1e-4 relative (a norm sums
squares over 50 k gradients, each 5 AdamW steps from rounding-order differences); the final weights
to 1e-5 relative or 2e-5 absolute. AdamW's eps is 1e-4 here: with 1e-8 its first steps are
sign-like, so a gradient that is 0 in one run and 1e-12 (rounding) in another moves a weight by a
whole lr in one and not at all in the other.
Two layouts repeat dp2 (4 micro batches per rank) and tp2 x dp2 with --gradient-accumulation-fusion,
whose linears write weight gradients into the fp32 buffer themselves and report their buckets ready;
tp2 + sp with --tp-comm-overlap (fused too) runs the overlapped linears from the flag; dp2 with the
distributed optimizer, FSDP2 dp2 and pp2 x tp2 run --decoupled-lr against one process with it.
Then checkpoints saved under FSDP2 dp2, pp4 and pp2 x tp2 x dp2 (distributed optimizer, sequence
parallel) resume exactly under the same layout, and load into one process (resharding by slicing).
"""

import math

import pytest
import torch

from meshtron.config import build_config
from meshtron.training.trainer import Trainer
from tests.distributed.full_weights import full_weights
from tests.distributed.launcher import run_distributed

STEPS = 5
BASE = [
    "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "1", "--num-layers", "4", "--hidden-size", "64",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--seq-length", "16", "--global-batch-size", "8", "--train-iters", str(STEPS), "--lr", "1e-2", "--min-lr", "1e-3",
    "--lr-warmup-iters", "2", "--clip-grad", "0.05", "--adam-eps", "1e-4", "--fp32", "--eval-interval", "0", "--log-interval", "100",
    "--device", "cpu",
]
DECOUPLED = ["--decoupled-lr", "5e-2", "--decoupled-min-lr", "2e-3"]
LAYOUTS = {  # name: (world size, extra flags)
    "tp2": (2, ["--tp", "2", "--micro-batch-size", "4"]),
    "tp2_sp": (2, ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "2"]),
    "tp2_sp_tp_comm_overlap": (2, ["--tp", "2", "--sequence-parallel", "--tp-comm-overlap", "--micro-batch-size", "2",
                                   "--gradient-accumulation-fusion"]),
    "dp2": (2, ["--micro-batch-size", "2"]),
    "dp2_distopt": (2, ["--micro-batch-size", "1", "--use-distributed-optimizer", "--ddp-bucket-size", "5000"]),
    "dp2_grad_accum_fusion": (2, ["--micro-batch-size", "1", "--ddp-bucket-size", "5000", "--gradient-accumulation-fusion"]),
    "fsdp_dp2": (2, ["--micro-batch-size", "2", "--fsdp"]),
    "tp2_dp2_distopt_sp": (4, ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "2", "--use-distributed-optimizer"]),
    "tp2_dp2_distopt_sp_grad_accum_fusion": (4, ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "2",
                                                 "--use-distributed-optimizer", "--gradient-accumulation-fusion"]),
    "cp2_dp2": (4, ["--cp", "2", "--micro-batch-size", "2"]),
    "cp2_allgather_tp2": (4, ["--cp", "2", "--cp-comm-type", "all_gather", "--tp", "2", "--micro-batch-size", "4"]),
    # one kv head for two tp ranks: each holds a copy, and the grad norm must count it once
    "tp2_kv1": (2, ["--tp", "2", "--micro-batch-size", "4", "--num-query-groups", "1"]),
    "tp2_dp2_distopt_kv1": (4, ["--tp", "2", "--micro-batch-size", "2", "--use-distributed-optimizer", "--num-query-groups", "1"]),
    "pp2_1f1b": (2, ["--pp", "2", "--micro-batch-size", "2"]),
    "pp2_interleaved": (2, ["--pp", "2", "--virtual-pipeline-model-parallel-size", "2", "--micro-batch-size", "2"]),
    # 7 layers + the loss = 8 slots: stage 0 holds 4 layers, stage 1 3 layers and the output layer (7 layers
    # alone do not split over 2 stages, so this runs only if the flag reaches the split)
    "pp2_account_for_loss_l7": (2, ["--pp", "2", "--micro-batch-size", "2", "--account-for-loss-in-pipeline-split", "--num-layers", "7"]),
    "pp4_1f1b": (4, ["--pp", "4", "--micro-batch-size", "1"]),
    "pp2_tp2_dp2_distopt_sp": (8, ["--pp", "2", "--tp", "2", "--sequence-parallel", "--micro-batch-size", "1", "--use-distributed-optimizer"]),
    # --decoupled-lr: the embeddings (first stage) and output layer (last) on their own rate, sharded by the distributed optimizer
    "dp2_distopt_decoupled": (2, ["--micro-batch-size", "1", "--use-distributed-optimizer", "--ddp-bucket-size", "5000", *DECOUPLED]),
    "pp2_tp2_decoupled": (4, ["--pp", "2", "--tp", "2", "--micro-batch-size", "2", *DECOUPLED]),
    "fsdp_dp2_decoupled": (2, ["--micro-batch-size", "2", "--fsdp", *DECOUPLED]),
}
# layouts whose model differs from the base one, and the one-process run to compare them with
REFERENCE = {"tp2_kv1": "mbs8_kv1", "tp2_dp2_distopt_kv1": "mbs8_kv1", "pp2_account_for_loss_l7": "mbs8_l7",
             "dp2_distopt_decoupled": "mbs8_decoupled", "pp2_tp2_decoupled": "mbs8_decoupled", "fsdp_dp2_decoupled": "mbs8_decoupled"}
RESUMED = {2: "fsdp_dp2", 4: "pp4_1f1b", 8: "pp2_tp2_dp2_distopt_sp"}  # layouts whose checkpoints must resume exactly


def _run(flags, tmp=None):
    trainer = Trainer(build_config(None, BASE + flags), log=lambda _: None)
    result = trainer.run()
    weights = full_weights(trainer.model, trainer.runner.metas, trainer.mesh)
    return {"losses": result.losses, "grad_norms": result.grad_norms, "weights": weights}


def _layouts(rank, world_size, names, tmp):
    out = {name: _run(LAYOUTS[name][1]) for name in names}
    if world_size in RESUMED:
        layout, ckpt = RESUMED[world_size], f"{tmp}/ckpt{world_size}"
        flags = LAYOUTS[layout][1] + ["--save", ckpt]
        first = Trainer(build_config(None, BASE + flags + ["--exit-interval", "2"]), log=lambda _: None).run()
        second = Trainer(build_config(None, BASE + flags + ["--load", ckpt]), log=lambda _: None).run()
        out["resumed_losses"] = first.losses + second.losses
        more = ["--train-iters", str(STEPS + 2), "--load", ckpt, "--no-load-rng"]
        out["continued_losses"] = Trainer(build_config(None, BASE + LAYOUTS[layout][1] + more), log=lambda _: None).run().losses
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def one_process():
    return {
        "mbs8": _run(["--micro-batch-size", "8"]),
        "mbs2": _run(["--micro-batch-size", "2"]),  # 4 micro batches: gradient accumulation
        "mbs8_kv1": _run(["--micro-batch-size", "8", "--num-query-groups", "1"]),
        "mbs8_l7": _run(["--micro-batch-size", "8", "--num-layers", "7"]),
        "mbs8_decoupled": _run(["--micro-batch-size", "8", *DECOUPLED]),
    }


def _runs_on(tmp, worlds: tuple[int, ...]) -> dict:
    results = {"tmp": tmp}
    for world in worlds:
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        out = run_distributed(_layouts, world, names, str(tmp), timeout=600)[0]
        if world in RESUMED:
            out[f"resumed_{world}"], out[f"continued_{world}"] = out.pop("resumed_losses"), out.pop("continued_losses")
        results.update(out)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _runs_on(tmp_path_factory.mktemp("layouts"), (2, 4))


@pytest.fixture(scope="module")
def runs8(tmp_path_factory):
    """Eight processes on CI's two cores: the slow-marked cases only (``pytest -m slow``)."""
    return _runs_on(tmp_path_factory.mktemp("layouts8"), (8,))


def _by_world(world: int) -> list:
    return [pytest.mark.slow] if world == 8 else []


def _close(a, b, rel=1e-5):
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-7) for x, y in zip(a, b, strict=True))


def test_gradient_accumulation_matches_one_big_batch(one_process):
    ref, acc = one_process["mbs8"], one_process["mbs2"]
    assert _close(acc["losses"], ref["losses"]) and _close(acc["grad_norms"], ref["grad_norms"], rel=1e-4)
    assert len(set(ref["losses"])) == STEPS and min(ref["grad_norms"]) > 0.05  # moving, and clipped


@pytest.mark.parametrize("layout", [pytest.param(name, marks=_by_world(world)) for name, (world, _) in LAYOUTS.items()])
def test_layout_matches_one_process(request, one_process, layout):
    ref = one_process[REFERENCE.get(layout, "mbs8")]
    got = request.getfixturevalue("runs8" if LAYOUTS[layout][0] == 8 else "runs")[layout]
    assert _close(got["losses"], ref["losses"]), (got["losses"], ref["losses"])
    assert _close(got["grad_norms"], ref["grad_norms"], rel=1e-4), (got["grad_norms"], ref["grad_norms"])
    for name, weight in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], weight, rtol=1e-5, atol=2e-5, msg=lambda m, name=name: f"{layout}: {name}: {m}")


@pytest.mark.parametrize("world", [pytest.param(world, marks=_by_world(world)) for world in sorted(RESUMED)])
def test_checkpoint_resumes_exactly_and_reshards_to_one_process(request, world):
    runs = request.getfixturevalue("runs8" if world == 8 else "runs")
    assert runs[f"resumed_{world}"] == runs[RESUMED[world]]["losses"]  # bit for bit, same layout
    # The checkpoint of iteration 5 continues in one process as it does under its own layout.
    flags = ["--micro-batch-size", "8", "--train-iters", str(STEPS + 2), "--load", str(runs["tmp"] / f"ckpt{world}"), "--no-load-rng"]
    result = Trainer(build_config(None, BASE + flags), log=lambda _: None).run()
    assert result.iteration == STEPS + 2
    assert _close(result.losses, runs[f"continued_{world}"]), (result.losses, runs[f"continued_{world}"])


def test_the_decoupled_rate_changes_the_run_it_is_compared_on(one_process):
    """The --decoupled-lr layouts match a one-process run that differs from the base one."""
    assert one_process["mbs8_decoupled"]["losses"][1:] != one_process["mbs8"]["losses"][1:]
