"""--log-straggler on three gloo ranks, one of them slowed in its data loading, then another in its
forward: the report names that rank and its section, although collectives make every rank's
step equally long (two runs in one launch)."""

import time

import pytest

from meshtron.config import build_config
from meshtron.training.straggler import report
from meshtron.training.trainer import Trainer
from tests.distributed.launcher import run_distributed

ARGS = ["--mock-data", "--preset", "tiny-gpt", "--vocab-size", "256", "--seq-length", "32", "--eval-interval", "0",
        "--global-batch-size", "3", "--micro-batch-size", "1", "--device", "cpu", "--train-iters", "4", "--log-interval", "2",
        "--log-straggler", "--straggler-minmax-count", "2"]  # fmt: skip


SLOWED = {"data wait": 2, "forward": 1}  # section -> the rank slowed in it


def _slow_rank_runs(rank, world_size):
    out = {}
    for section, slowed in SLOWED.items():
        lines = []
        trainer = Trainer(build_config(None, ARGS), log=lines.append)
        if rank == slowed and section == "data wait":
            fetch = trainer._to_device
            trainer._to_device = lambda batch: (time.sleep(0.3), fetch(batch))[1]
        if rank == slowed and section == "forward":  # the first module with weights: the micro batch's forward only
            first = next(m for m in trainer.model.modules() if list(m.parameters(recurse=False)))
            first.register_forward_hook(lambda *_: time.sleep(0.3))
        trainer.run()
        out[section] = lines
    return out


@pytest.mark.slow
def test_the_slowed_rank_is_named_with_its_section():
    runs = run_distributed(_slow_rank_runs, 3, timeout=300)[0]
    for section, slowed in SLOWED.items():
        reports = [line for line in runs[section] if line.startswith("stragglers")]
        assert len(reports) == 2, runs[section]
        for line in reports:
            assert line.startswith("stragglers (mean per step, 3 ranks, median step "), line
            assert f": rank {slowed} +" in line and f"ms in {section} (" in line, line
            # the waiting ranks are the median: named, if at all, only for jitter of a busy machine, after the slowed one
            assert all(line.index(f"rank {r} ") > line.index(f"rank {slowed} ") for r in range(3) if r != slowed and f"rank {r} " in line), line


def test_report_of_even_ranks_says_none():
    same = {"step": 0.1, "data wait": 0.01, "forward": 0.02, "backward": 0.04, "optimizer": 0.03}
    line, scalars = report([same, dict(same)], 3)
    assert line.endswith("none beyond the median rank") and scalars["straggler/excess_ms"] == 0.0
    assert scalars["straggler/backward_max_ms"] == scalars["straggler/backward_median_ms"] == 40.0
