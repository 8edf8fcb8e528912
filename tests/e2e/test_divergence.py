"""A run that diverges stops with a non-zero exit and the iteration, and saves nothing after it."""

import os
import re
import subprocess
import sys
from pathlib import Path

from meshtron import cli

ARGS = ["--mock-data", "--preset", "tiny-gpt", "--vocab-size", "256", "--log-interval", "1", "--eval-interval", "0",
        "--global-batch-size", "4", "--micro-batch-size", "2", "--seq-length", "32"]  # fmt: skip


def meshtron(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    return subprocess.run([sys.executable, "-m", "meshtron", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_huge_lr_stops_with_the_iteration_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    # The good checkpoint in process (a second interpreter costs seconds of imports); the diverging run is the CLI's.
    assert cli.main(["train", *ARGS, "--train-iters", "3", "--save", str(ckpt)]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in (ckpt / "iter_0000003").iterdir()}

    run = meshtron("train", *ARGS, "--train-iters", "30", "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "1",
                   "--lr", "1e4", "--lr-warmup-iters", "0", cwd=tmp_path)  # fmt: skip
    assert run.returncode == 3, run.stdout + run.stderr
    found = re.search(r"training diverged at iteration (\d+) on rank 0: non-finite", run.stderr)
    assert found, run.stderr
    diverged = int(found.group(1))
    assert 4 <= diverged < 30
    # Checkpoints up to the step before the divergence, none from it on; the older one untouched.
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(diverged - 1)
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [f"iter_{i:07d}" for i in range(3, diverged)]
    assert {p.name: p.read_bytes() for p in (ckpt / "iter_0000003").iterdir()} == before
    assert f"saved checkpoint at iteration {diverged}" not in run.stdout

    # Loadable: checked by `meshtron checkpoint info` and resumed from (in process, to keep the test short).
    assert cli.main(["checkpoint", "info", str(ckpt)]) == 0
    assert "checksums: verified OK" in capsys.readouterr().out
    assert cli.main(["train", *ARGS, "--train-iters", "4", "--load", str(ckpt), "--ckpt-step", "3"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {ckpt} at iteration 3" in out and "iteration       4/4" in out, out
