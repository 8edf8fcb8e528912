"""``--async-save`` killed with SIGKILL at several moments of a background write: the tracker
always points at a complete checkpoint (checksums verified), and training resumes from it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


ENV = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), PYTHONUNBUFFERED="1")
ARGS = ["--mock-data", "--preset", "tiny-gpt", "--vocab-size", "256", "--log-interval", "1", "--eval-interval", "0",
        "--global-batch-size", "4", "--micro-batch-size", "2", "--save-interval", "1", "--async-save"]


def meshtron(*args, cwd):
    return subprocess.run([sys.executable, "-m", "meshtron", *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.01, 0.05, 0.2])  # seconds after a background write began
def test_kill_9_during_async_save_leaves_a_loadable_checkpoint(tmp_path, delay):
    save = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "meshtron", "train", *ARGS, "--train-iters", "100000", "--save", str(save)],
                            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started, deadline = 0, time.monotonic() + 120
    for line in proc.stdout:
        started += "writing in the background" in line
        if started == 3 or time.monotonic() > deadline:  # the first two are complete by now
            break
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    tracked = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert tracked >= 2
    info = meshtron("checkpoint", "info", str(save), cwd=tmp_path)
    assert info.returncode == 0 and "checksums: verified OK" in info.stdout, info.stdout + info.stderr
    if delay == 0.05:
        resumed = meshtron("train", *ARGS, "--train-iters", str(tracked + 1), "--load", str(save), "--save", str(save), cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
        assert f"resumed from {save} at iteration {tracked}" in resumed.stdout
