"""A ramped global batch (--rampup-batch-size, --train-samples) under data and pipeline
parallelism against one process: the number of micro batches changes from step to step (2, 4,
6, 8 samples: 1 to 4 micro batches per data-parallel rank, 2 to 8 through the 1F1B and
interleaved pipelines), and a data-parallel run stopped in the middle of the ramp resumes onto
the uninterrupted run's steps. Slow (two minutes on two shared cores): the one-process proof of
the ramp and its resume is ``tests/e2e/test_rampup_cli.py``.

Same seed and mock tokens, fp32 on the CPU, clipping active: losses agree to 1e-5 relative (as in
``test_trainer_layouts``, for the same reasons) and the (global) grad norms to 1e-3: nine steps
here, not five, and the interleaved pipeline's rounding-order differences (1e-7 on the first
norms, 8e-6 by step 8) reach 1.3e-4 on the last step, where the norm jumps from 1.3 to 6.7; a
micro batch lost or doubled would move a step's loss itself by far more than 1e-5. The resumed
losses equal the uninterrupted run's of the same layout exactly.
"""

import math

import pytest

from meshtron.config import build_config
from meshtron.training.trainer import Trainer
from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.slow

BASE = [
    "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "1", "--num-layers", "4", "--hidden-size", "64",
    "--num-attention-heads", "4", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
    "--rampup-batch-size", "2", "2", "24", "--train-samples", "40", "--lr-warmup-samples", "6", "--lr", "1e-2", "--min-lr", "1e-3",
    "--clip-grad", "0.05", "--adam-eps", "1e-4", "--fp32", "--eval-interval", "0", "--log-interval", "100", "--device", "cpu",
]  # fmt: skip
BATCHES = [2, 2, 2, 2, 4, 4, 6, 6, 8]  # Megatron's ramp: 8 samples per increment, then (40 - 28) // 8 = 1 full batch
LAYOUTS = {
    "dp2": [],
    "pp2_1f1b": ["--pp", "2"],
    "pp2_interleaved": ["--pp", "2", "--virtual-pipeline-model-parallel-size", "2"],
}


def _layouts(rank, world_size, tmp):
    out = {name: _train(flags) for name, flags in LAYOUTS.items()}
    ckpt = f"{tmp}/ckpt"
    first = _train(["--save", ckpt, "--exit-interval", "5"])  # dp2, stopped at batch 4
    second = _train(["--save", ckpt, "--load", ckpt])
    out["resumed_dp2"] = {key: first[key] + second[key] for key in first}
    return out if rank == 0 else None


def _train(flags: list[str]) -> dict:
    """Losses, grad norms and each step's (global batch, micro batches on this rank)."""
    trainer = Trainer(build_config(None, BASE + flags), log=lambda _: None)
    steps = []
    forward_backward = trainer.runner.forward_backward

    def counting(batches, **kwargs):
        if not kwargs.get("forward_only"):
            steps.append((trainer.last_batch_size, len(batches)))
        return forward_backward(batches, **kwargs)

    trainer.runner.forward_backward = counting
    result = trainer.run()
    return {"losses": result.losses, "grad_norms": result.grad_norms, "steps": steps}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = _train([])
    return one, run_distributed(_layouts, 2, str(tmp_path_factory.mktemp("rampup")), timeout=600)[0]


def _close(a, b, rel):
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-7) for x, y in zip(a, b, strict=True))


def test_one_process_ramps_its_micro_batches(runs):
    one, _ = runs
    assert one["steps"] == [(b, b) for b in BATCHES]  # micro batches of 1 sample
    assert len(set(one["losses"])) == len(BATCHES)


@pytest.mark.parametrize("layout, micro", [("dp2", [b // 2 for b in BATCHES]), ("pp2_1f1b", BATCHES), ("pp2_interleaved", BATCHES)])
def test_layout_with_a_ramp_matches_one_process(runs, layout, micro):
    one, many = runs
    assert many[layout]["steps"] == list(zip(BATCHES, micro))
    assert _close(many[layout]["losses"], one["losses"], 1e-5), (many[layout]["losses"], one["losses"])
    assert _close(many[layout]["grad_norms"], one["grad_norms"], 1e-3)


def test_resume_in_the_middle_of_the_ramp_continues_it_exactly(runs):
    _, many = runs
    assert many["resumed_dp2"]["steps"] == many["dp2"]["steps"]
    assert many["resumed_dp2"]["losses"] == many["dp2"]["losses"] and many["resumed_dp2"]["grad_norms"] == many["dp2"]["grad_norms"]
