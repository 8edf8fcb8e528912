"""The CLI end to end: preprocess -> train a few steps -> generate, and the embedded default path."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.cli import main as cli_main
from meshtron.data.tokenizers import train_bpe_tokenizer


TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "A journey of a thousand miles begins with a single step.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
] * 30


def meshtron(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-m", "meshtron", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"meshtron {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_preprocess_train_generate(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"content": t}) + "\n" for t in TEXTS))
    tokenizer = train_bpe_tokenizer(TEXTS, 300, str(tmp_path / "tokenizer.json"))
    meshtron("preprocess", "--input", str(jsonl), "--output-prefix", str(tmp_path / "docs"), "--json-keys", "content",
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer, "--append-eod", "--workers", "2", cwd=tmp_path)
    prefix = tmp_path / "docs_content_document"
    assert prefix.with_suffix(".bin").stat().st_size > 0 and prefix.with_suffix(".idx").stat().st_size > 34

    train = meshtron("train", "--preset", "tiny-llama", "--data-path", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer",
                     "--tokenizer-model", tokenizer, "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
                     "--train-iters", "30", "--lr", "3e-3", "--lr-warmup-iters", "3", "--log-interval", "5", "--eval-interval", "15",
                     "--eval-iters", "2", "--split", "90,10,0", "--save", str(tmp_path / "ckpt"), "--save-interval", "10",
                     "--tensorboard-dir", str(tmp_path / "tb"), cwd=tmp_path)
    lines = [l for l in train.stdout.splitlines() if l.startswith("iteration")]
    losses = [float(l.split("| loss ")[1].split()[0]) for l in lines]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, train.stdout
    assert "validation at iteration 30" in train.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "30"
    assert any((tmp_path / "tb").iterdir())

    for args in (["--greedy"], ["--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "3"]):
        out = meshtron("generate", "--load", str(tmp_path / "ckpt"), "--prompt", "The quick", "--max-new-tokens", "12", *args, cwd=tmp_path)
        assert out.stdout.startswith("The quick") and len(out.stdout.strip()) > len("The quick")


def test_embedded_default_trains_samples_and_is_plottable(tmp_path, monkeypatch, capsys):
    """The default run's flags, shortened: it learns, samples, writes what `meshtron plot` reads
    into its run directory, and run again it replaces its own demo checkpoint."""
    from meshtron.cli import DEFAULT_RUN_DIR, EMBEDDED_DEFAULT_ARGS
    from meshtron.plot import event_dir, read_scalars

    shorter = ["--data-cache-path", str(tmp_path / "cache"), "--log-interval", "5", "--generate-prompt", "The "]
    out = meshtron("train", *EMBEDDED_DEFAULT_ARGS, *shorter, "--train-iters", "20", cwd=tmp_path)
    losses = [float(l.split("| loss ")[1].split()[0]) for l in out.stdout.splitlines() if l.startswith("iteration")]
    assert losses[-1] < losses[0] - 1.0, out.stdout
    assert re.search(r"sample: ['\"]The ", out.stdout), out.stdout
    run_dir = tmp_path / DEFAULT_RUN_DIR
    assert (run_dir / "tokenizer").is_dir()
    steps, values = read_scalars(event_dir(run_dir))["train/loss"]  # what `meshtron plot checkpoints/default` draws
    assert steps == [5, 10, 15, 20] and values[-1] < values[0]
    # Run again (in this process: a second interpreter costs seconds of imports), from the same directory.
    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", *EMBEDDED_DEFAULT_ARGS, *shorter, "--train-iters", "2"]) == 0
    again = capsys.readouterr().out
    assert re.search(r"sample: ['\"]The ", again) and (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_bad_flag_fails_before_any_work(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-m", "meshtron", "train", "--hiden-size", "64"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "did you mean '--hidden-size'" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_sigterm_saves_a_loadable_checkpoint_and_resume_continues(tmp_path, capsys):
    """A preempted job (SIGTERM, as SLURM and Kubernetes send) saves at the next step boundary and
    exits cleanly; ``--load`` then continues from that iteration."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), PYTHONUNBUFFERED="1")
    args = ["--mock-data", "--preset", "tiny-gpt", "--vocab-size", "256", "--train-iters", "100000", "--log-interval", "1",
            "--eval-interval", "0", "--global-batch-size", "4", "--micro-batch-size", "2", "--save", str(tmp_path / "ckpt")]
    proc = subprocess.Popen([sys.executable, "-m", "meshtron", "train", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    for line in proc.stdout:  # wait until training runs
        if line.startswith("iteration") or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "stopping at iteration" in out and "saved checkpoint" in out
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= saved < 100000
    # The resume in this process (a second interpreter costs seconds of imports); the preempted run was the CLI's.
    assert cli_main(["train", *[a if a != "100000" else str(saved + 2) for a in args], "--load", str(tmp_path / "ckpt")]) == 0
    resumed = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'ckpt'} at iteration {saved}" in resumed
    assert f"iteration {saved + 2:>7d}/{saved + 2}" in resumed
