"""``meshtron train`` counted in samples with a batch ramp (--train-samples, --rampup-batch-size,
--lr-warmup-samples), on real documents: each step's global batch, consumed samples and rate are
Megatron's, and a run stopped in the middle of the ramp and resumed from its checkpoint logs the
steps of the uninterrupted run, bit for bit (CPU, fp32)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.data.preprocess import main as preprocess

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"iteration +(\d+)/(\d+) \| consumed samples +(\d+) \| global batch size +(\d+) \| .*?\| (lr \S+ \| loss \S+ \| grad norm \S+)")


def train(*args: str, cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "meshtron", "train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"meshtron train failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def steps(out: str) -> list[tuple]:
    return [(int(i), int(total), int(consumed), int(batch), rest) for i, total, consumed, batch, rest in STEP.findall(out)]


@pytest.mark.slow  # ~26 s on 2 cores; the ramp's arithmetic is tests/unit/test_batch_schedule.py, in the default suite
def test_ramped_sample_based_run_and_its_resume_in_the_middle_of_the_ramp(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1)}) + "\n" for i in range(200)))
    preprocess(["--input", str(jsonl), "--output-prefix", str(tmp_path / "d"), "--tokenizer-type", "ByteTokenizer", "--append-eod"])
    args = ["--preset", "tiny-gpt", "--data-path", str(tmp_path / "d_text_document"), "--tokenizer-type", "ByteTokenizer",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "24",
            "--train-samples", "64", "--lr-warmup-samples", "8", "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1",
            "--hidden-dropout", "0.1", "--device", "cpu", "--fp32"]  # fmt: skip

    straight = train(*args, "--save", str(tmp_path / "a"), cwd=tmp_path)
    got = steps(straight)
    # Megatron's ramp: 8 samples per increment of 2. Batch 2 until 8 consumed, 4 until 16, 6 while
    # at most 24 are (16 -> 22 -> 28), then 8: the ramp takes 8 steps (28 samples), (64 - 28) // 8 = 4 follow.
    batches = [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8, 8]
    assert [g[3] for g in got] == batches and {g[1] for g in got} == {12}
    assert [g[2] for g in got] == [sum(batches[: i + 1]) for i in range(12)]
    assert "--train-samples 64: 12 iterations, global batch ramps from 2 by 2 every 8 samples to 8 (reached after 24 samples)" in straight
    assert "4 micro batches of 2" in straight  # a full batch's micro batches; a step of batch b runs b / 2
    lrs = [float(g[4].split()[1]) for g in got]
    assert lrs[:4] == pytest.approx([3e-3 * 2 / 8, 3e-3 * 4 / 8, 3e-3 * 6 / 8, 3e-3])  # warm-up over 8 samples, at the samples after each step

    first = train(*args, "--save", str(tmp_path / "b"), "--exit-interval", "5", cwd=tmp_path)  # stops at batch 4, 12 samples in
    second = train(*args, "--load", str(tmp_path / "b"), "--save", str(tmp_path / "b"), cwd=tmp_path)
    assert "resumed from" in second and "at iteration 5" in second
    assert steps(first) + steps(second) == got
    valid = re.compile(r"validation at iteration (\d+) \| loss (\S+)")
    assert valid.findall(first) + valid.findall(second) == valid.findall(straight) and len(valid.findall(straight)) == 3
    assert len({g[4] for g in got}) == 12  # the steps differ: the comparison is not between constants
