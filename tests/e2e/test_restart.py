"""Restart without a human: after SIGKILL of a rank, the same command started again (as a SLURM
requeue or torchrun's restart does; --load is --save) resumes from the newest complete checkpoint,
takes over the dead run's lock, and ends with the uninterrupted run's losses and consumed samples.

torchrun --max-restarts itself is not driven here: on this PyTorch (2.13, CPU) its restarted gloo
workers fail to connect their sub-groups about half the time (connectFullMesh: connection
refused) with a ten-line script of PyTorch alone, so such a test would fail for PyTorch's sake."""

import signal

import pytest

from tests.e2e.ranks import Ranks
from tests.e2e.test_agreed_stop import ARGS, step_lines

pytestmark = pytest.mark.slow


def test_kill_9_then_the_same_command_resumes_from_the_newest_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    args = [*ARGS, "--train-iters", "10", "--save-interval", "2", "--load", str(save), "--save", str(save)]
    first = Ranks(args, 2, tmp_path / "first")
    first.wait_for("saved checkpoint at iteration 4")
    first.procs[0].send_signal(signal.SIGKILL)  # rank 0 holds the lock: it stays behind, naming a dead pid
    codes = first.wait(timeout=60)
    assert codes[0] == -signal.SIGKILL and codes[1] not in (0, None), codes  # the other rank fails on the lost peer
    assert (save / "meshtron.lock").exists()

    again = Ranks(args, 2, tmp_path / "again")
    assert again.wait(timeout=300) == [0, 0], again.output(0)[-3000:]
    out = again.output(0)
    assert "took over the lock of" in out and "from an ended run" in out
    resumed_at = int(out.split(f"resumed from {save} at iteration ")[1].split()[0])
    assert resumed_at >= 4
    restarted = {**step_lines(first.output(0)), **step_lines(out)}  # the iterations re-run after the restart replace the lost ones

    whole = Ranks([*ARGS, "--train-iters", "10"], 2, tmp_path / "uninterrupted")
    assert whole.wait(timeout=300) == [0, 0]
    expected = step_lines(whole.output(0))
    assert sorted(expected) == list(range(1, 11)) and restarted == expected
