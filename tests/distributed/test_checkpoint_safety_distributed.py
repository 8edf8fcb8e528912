"""Checkpoint and divergence checks across ranks (gloo, CPU): pipeline stages pool their tensor
names (a pp resume is not mistaken for a partial load, fewer layers still are), the ranks split
the checksum reading of a load and all hear of a corrupt file, and a diverged
tensor-parallel run stops on every rank at the same iteration, the module located, with no hang."""

from pathlib import Path

import torch

from meshtron.checkpoint.checkpoint import CheckpointError
from meshtron.config import build_config
from meshtron.training.divergence import DivergenceError
from meshtron.training.trainer import Trainer
from tests.distributed.launcher import run_distributed
from tests.unit.test_checkpoint_safety import flip_byte

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
    resumed = _train(["--pp", "2", "--num-layers", "4", "--train-iters", "3", "--load", ckpt, "--save", ckpt]).iteration
    fewer = _error_of(["--pp", "2", "--num-layers", "2", "--train-iters", "3", "--load", ckpt])
    diverged = _error_of(["--tp", "2", "--num-layers", "2", "--train-iters", "20", "--lr", "1e4", "--lr-warmup-iters", "0", "--save", f"{tmp}/tp2"])
    torch.distributed.barrier()
    if rank == 0:  # the ranks split the checksum reading: both must hear of the one that finds it
        flip_byte(Path(ckpt) / "iter_0000003" / "__1_0.distcp")
    torch.distributed.barrier()
    corrupt = _error_of(["--pp", "2", "--num-layers", "4", "--train-iters", "4", "--load", ckpt])
    return resumed, fewer, diverged, corrupt


def test_pipeline_resume_partial_load_and_divergence_across_ranks(tmp_path):
    results = run_distributed(_cases, 2, str(tmp_path), timeout=300)
    for rank, (resumed, fewer, diverged, corrupt) in enumerate(results):
        assert corrupt and "iter_0000003/__1_0.distcp is corrupt" in corrupt and "--ckpt-step 2" in corrupt, corrupt
        assert resumed == 3
        # layers 2 and 3: 12 tensors each, as weights, masters, two Adam moments and step counters
        assert fewer and "holds 120 tensors this run does not have" in fewer and "model.layers.2." in fewer, fewer
        assert diverged and f"on rank {rank}: non-finite" in diverged and "first module with a non-finite output" in diverged, diverged
    assert results[0][2].split(" on rank")[0] == results[1][2].split(" on rank")[0]  # the same iteration on both ranks
    assert not list((tmp_path / "tp2").glob("iter_*"))  # no checkpoint: the run diverged before its end
