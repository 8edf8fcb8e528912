"""Checkpoint and divergence checks across ranks (gloo, CPU): pipeline stages pool their tensor
names (a pp resume is not mistaken for a partial load, fewer layers still are), and a diverged
tensor-parallel run stops on every rank at the same iteration, the module located, with no hang."""

from meshtron.checkpoint.checkpoint import CheckpointError
from meshtron.config import build_config
from meshtron.training.divergence import DivergenceError
from meshtron.training.trainer import Trainer
from tests.distributed.launcher import run_distributed

BASE = ["--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "2", "--fp32", "--eval-interval", "0", "--device", "cpu"]  # fmt: skip


def _train(flags):
    return Trainer(build_config(None, BASE + flags), log=lambda _: None).run()


def _error_of(flags):
    try:
        _train(flags)
    except (CheckpointError, DivergenceError) as exc:
        return str(exc)
    return None


def _cases(rank, world_size, tmp):
    ckpt = f"{tmp}/pp2"
    _train(["--pp", "2", "--num-layers", "4", "--train-iters", "2", "--save", ckpt])
    resumed = _train(["--pp", "2", "--num-layers", "4", "--train-iters", "3", "--load", ckpt]).iteration
    fewer = _error_of(["--pp", "2", "--num-layers", "2", "--train-iters", "3", "--load", ckpt])
    diverged = _error_of(["--tp", "2", "--num-layers", "2", "--train-iters", "20", "--lr", "1e4", "--lr-warmup-iters", "0", "--save", f"{tmp}/tp2"])
    return resumed, fewer, diverged


def test_pipeline_resume_partial_load_and_divergence_across_ranks(tmp_path):
    results = run_distributed(_cases, 2, str(tmp_path), timeout=300)
    for rank, (resumed, fewer, diverged) in enumerate(results):
        assert resumed == 3
        # layers 2 and 3: 12 tensors each, as weights, masters, two Adam moments and step counters
        assert fewer and "holds 120 tensors this run does not have" in fewer and "model.layers.2." in fewer, fewer
        assert diverged and f"on rank {rank}: non-finite" in diverged and "first module with a non-finite output" in diverged, diverged
    assert results[0][2].split(" on rank")[0] == results[1][2].split(" on rank")[0]  # the same iteration on both ranks
    assert not list((tmp_path / "tp2").glob("iter_*"))  # no checkpoint: the run diverged before its end
