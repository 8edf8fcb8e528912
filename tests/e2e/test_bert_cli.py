"""BERT end to end on the CPU: ``meshtron train --model-type bert`` on the embedded corpus (split
into sentences, WordPiece vocabulary trained on it and cached), masked-LM and sentence-order
losses both logged, the masked-LM loss falling, evaluation, a checkpoint, and a resume from it;
and BERT, T5 and ICT on ``--mock-data``, which needs no corpus, tokenizer or NLTK."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def meshtron(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``python -m meshtron ARGS`` from this checkout, ``env`` added to the environment."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **env}
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


FAMILIES = {"tiny-bert": math.log(1000), "tiny-t5": math.log(1000), "tiny-ict": math.log(4)}  # preset: loss at the start
# Each family's ``meshtron train`` through the CLI's entry point, one after another in one process
# (a process costs seconds of imports); each prints its output as one JSON line.
TRAIN_FAMILIES = """
import contextlib, io, json, sys
from meshtron.cli import main
for preset in sys.argv[1:]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["train", "--preset", preset, "--mock-data", "--vocab-size", "1000", "--micro-batch-size", "4", "--global-batch-size", "8",
                   "--train-iters", "3", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--device", "cpu"])
    print(json.dumps({"preset": preset, "rc": rc, "stdout": out.getvalue()}))
"""


@pytest.fixture(scope="module")
def mock_runs(tmp_path_factory) -> dict[str, str]:
    """preset -> its run's stdout, in a process where nltk cannot be imported and HOME is empty."""
    tmp = tmp_path_factory.mktemp("mock")
    blocked = tmp / "blocked" / "nltk"  # an nltk that cannot be imported, ahead of any installed one
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('nltk is blocked in this test')\n")
    env = {**os.environ, "PYTHONPATH": f"{blocked.parent}{os.pathsep}{REPO}", "HOME": str(tmp)}
    proc = subprocess.run([sys.executable, "-c", TRAIN_FAMILIES, *FAMILIES], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"preset"')]
    assert [(r["preset"], r["rc"]) for r in runs] == [(preset, 0) for preset in FAMILIES], proc.stdout[-3000:]
    return {r["preset"]: r["stdout"] for r in runs}


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_mock_data_trains_the_sentence_families_without_corpus_or_nltk(mock_runs, preset):
    out = mock_runs[preset]
    losses = _column(out, "loss")
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and abs(losses[0] - FAMILIES[preset]) < 0.3, out
    assert "validation at iteration 3" in out and "embedded corpus" not in out
    assert ("sop_loss" in out) == (preset == "tiny-bert")
