"""The whole training loop under each layout of the mesh against the one-process loop.

Same seed, same data (mock tokens), fp32 on the CPU, clipping active: the losses of every step and
the logged (global) grad norms agree with one process to 1e-5 relative; the final weights after 5
AdamW steps to 1e-5 relative or 2e-5 absolute (AdamW divides by sqrt(v), so fp32 rounding of a
near-zero gradient moves a weight by up to ~1e-3 of an lr-1e-2 step).
Then a checkpoint saved under tp2 x dp2 (distributed optimizer, sequence parallel) resumes
exactly under the same layout, and loads into one process (resharding by slicing).
"""

import math

import pytest
import torch

from meshtron.checkpoint.layout import full_state
from meshtron.config import build_config
from meshtron.training.trainer import Trainer
from tests.distributed.launcher import run_distributed

STEPS = 5
BASE = [
    "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "1", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--seq-length", "16", "--global-batch-size", "8", "--train-iters", str(STEPS), "--lr", "1e-2", "--min-lr", "1e-3",
    "--lr-warmup-iters", "2", "--clip-grad", "0.05", "--fp32", "--eval-interval", "0", "--log-interval", "100",
    "--device", "cpu",
]
LAYOUTS = {  # name: (world size, extra flags)
    "tp2": (2, ["--tp", "2", "--micro-batch-size", "4"]),
    "tp2_sp": (2, ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "2"]),
    "dp2": (2, ["--micro-batch-size", "2"]),
    "dp2_distopt": (2, ["--micro-batch-size", "1", "--use-distributed-optimizer", "--ddp-bucket-size", "5000"]),
    "fsdp_dp2": (2, ["--micro-batch-size", "2", "--fsdp"]),
    "tp2_dp2_distopt_sp": (4, ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "2", "--use-distributed-optimizer"]),
    "cp2_dp2": (4, ["--cp", "2", "--micro-batch-size", "2"]),
}


def _run(flags, tmp=None):
    trainer = Trainer(build_config(None, BASE + flags), log=lambda _: None)
    result = trainer.run()
    weights = {k: v.clone() for k, v in full_state(trainer.model, trainer.optimizer, trainer.mesh, False)["model"].items()}
    return {"losses": result.losses, "grad_norms": result.grad_norms, "weights": weights}


def _layouts(rank, world_size, names, tmp):
    out = {name: _run(LAYOUTS[name][1]) for name in names}
    if world_size == 4:
        flags = LAYOUTS["tp2_dp2_distopt_sp"][1] + ["--save", f"{tmp}/ckpt"]
        first = Trainer(build_config(None, BASE + flags + ["--exit-interval", "2"]), log=lambda _: None).run()
        second = Trainer(build_config(None, BASE + flags + ["--load", f"{tmp}/ckpt"]), log=lambda _: None).run()
        out["resumed_losses"] = first.losses + second.losses
        more = ["--train-iters", str(STEPS + 2), "--load", f"{tmp}/ckpt", "--no-load-rng"]
        out["continued_losses"] = Trainer(build_config(None, BASE + LAYOUTS["tp2_dp2_distopt_sp"][1] + more), log=lambda _: None).run().losses
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def one_process():
    return {
        "mbs8": _run(["--micro-batch-size", "8"]),
        "mbs2": _run(["--micro-batch-size", "2"]),  # 4 micro batches: gradient accumulation
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    two = [n for n, (w, _) in LAYOUTS.items() if w == 2]
    four = [n for n, (w, _) in LAYOUTS.items() if w == 4]
    results = run_distributed(_layouts, 2, two, str(tmp), timeout=300)[0]
    results.update(run_distributed(_layouts, 4, four, str(tmp), timeout=300)[0])
    results["tmp"] = tmp
    return results


def _close(a, b, rel=1e-5):
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-7) for x, y in zip(a, b, strict=True))


def test_gradient_accumulation_matches_one_big_batch(one_process):
    ref, acc = one_process["mbs8"], one_process["mbs2"]
    assert _close(acc["losses"], ref["losses"]) and _close(acc["grad_norms"], ref["grad_norms"])
    assert len(set(ref["losses"])) == STEPS and min(ref["grad_norms"]) > 0.05  # moving, and clipped


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(runs, one_process, layout):
    ref, got = one_process["mbs8"], runs[layout]
    assert _close(got["losses"], ref["losses"]), (got["losses"], ref["losses"])
    assert _close(got["grad_norms"], ref["grad_norms"]), (got["grad_norms"], ref["grad_norms"])
    for name, weight in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], weight, rtol=1e-5, atol=2e-5, msg=lambda m, name=name: f"{layout}: {name}: {m}")


def test_checkpoint_resumes_exactly_under_tp2_dp2_and_reshards_to_one_process(runs):
    straight = runs["tp2_dp2_distopt_sp"]["losses"]
    assert runs["resumed_losses"] == straight  # bit for bit, same layout
    # The checkpoint of iteration 5 continues in one process as it does under tp2 x dp2.
    flags = ["--micro-batch-size", "8", "--train-iters", str(STEPS + 2), "--load", str(runs["tmp"] / "ckpt"), "--no-load-rng"]
    result = Trainer(build_config(None, BASE + flags), log=lambda _: None).run()
    assert result.iteration == STEPS + 2
    assert _close(result.losses, runs["continued_losses"]), (result.losses, runs["continued_losses"])
