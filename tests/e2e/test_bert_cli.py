"""BERT end to end on the CPU: ``meshtron train --model-type bert`` on the embedded corpus (split
into sentences, WordPiece vocabulary trained on it and cached), masked-LM and sentence-order
losses both logged, the masked-LM loss falling, evaluation, a checkpoint, and a resume from it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest



def meshtron(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-m", "meshtron", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"meshtron {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _column(stdout: str, name: str) -> list[float]:
    return [float(line.split(f"| {name} ")[1].split()[0]) for line in stdout.splitlines() if line.startswith("iteration")]


@pytest.mark.slow
def test_tiny_bert_trains_on_the_embedded_corpus_and_resumes(tmp_path):
    common = ["--model-type", "bert", "--preset", "tiny-bert", "--data-cache-path", str(tmp_path / "cache"),
              "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "3e-3", "--lr-warmup-iters", "5",
              "--log-interval", "10", "--eval-interval", "40", "--eval-iters", "2", "--train-iters", "50",
              "--save", str(tmp_path / "ckpt"), "--device", "cpu"]  # fmt: skip
    out = meshtron("train", *common, "--exit-interval", "40", cwd=tmp_path)
    losses, sop = _column(out.stdout, "loss"), _column(out.stdout, "sop_loss")
    assert len(losses) == len(sop) == 4 and losses[-1] < losses[0] - 1.0, out.stdout
    assert all(0.3 < s < 1.5 for s in sop), out.stdout  # a two-way cross-entropy near log 2 early on
    assert "validation at iteration 40" in out.stdout
    resumed = meshtron("train", *common, "--load", str(tmp_path / "ckpt"), cwd=tmp_path)
    assert "resumed from" in resumed.stdout and "iteration      50/50" in resumed.stdout, resumed.stdout
