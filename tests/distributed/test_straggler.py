"""--log-straggler on three gloo ranks, one of them slowed in its data loading: the report names
that rank and its section, although collectives make every rank's step equally long."""

import time

from meshtron.config import build_config
from meshtron.training.straggler import report
from meshtron.training.trainer import Trainer
from tests.distributed.launcher import run_distributed

ARGS = ["--mock-data", "--preset", "tiny-gpt", "--vocab-size", "256", "--seq-length", "32", "--eval-interval", "0",
        "--global-batch-size", "3", "--micro-batch-size", "1", "--device", "cpu", "--train-iters", "4", "--log-interval", "2",
        "--log-straggler", "--straggler-minmax-count", "2"]  # fmt: skip


def _slow_rank_run(rank, world_size):
    lines = []
    trainer = Trainer(build_config(None, ARGS), log=lines.append)
    if rank == 2:
        fetch = trainer._to_device
        trainer._to_device = lambda batch: (time.sleep(0.3), fetch(batch))[1]
    trainer.run()
    return lines


def test_the_slowed_rank_is_named_with_its_section():
    lines = run_distributed(_slow_rank_run, 3, timeout=300)[0]
    reports = [line for line in lines if line.startswith("stragglers")]
    assert len(reports) == 2, lines
    for line in reports:
        assert line.startswith("stragglers (mean per step, 3 ranks, median step "), line
        assert ": rank 2 +" in line and "ms in data wait (" in line, line
        # the waiting ranks are the median: named, if at all, only for jitter of a busy machine, after rank 2
        assert all(line.index(f"rank {r} ") > line.index("rank 2 ") for r in (0, 1) if f"rank {r} " in line), line


def test_report_of_even_ranks_says_none():
    same = {"step": 0.1, "data wait": 0.01, "forward-backward": 0.06, "optimizer": 0.03}
    line, scalars = report([same, dict(same)], 3)
    assert line.endswith("none beyond the median rank") and scalars["straggler/excess_ms"] == 0.0
