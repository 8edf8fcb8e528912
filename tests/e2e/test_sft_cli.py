"""``meshtron train --sft`` end to end on a small chat jsonl written here: the plain layout with
the byte tokenizer, a few steps, a falling loss and a validation pass."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


COLOURS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "blood": "red", "sun": "yellow"}


def chat_records() -> list[dict]:
    out = []
    for i, (thing, colour) in enumerate(COLOURS.items()):
        out.append({"prompt": f"What colour is {thing}?", "response": f"{thing.capitalize()} is {colour}."})
        out.append({"messages": [{"role": "system", "content": "Answer in one word."},
                                 {"role": "user", "content": f"Colour of {thing}?"},
                                 {"role": "assistant", "content": colour}]})  # fmt: skip
    return out * 5


def train(tmp_path: Path, *extra: str) -> list[float]:
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in chat_records()))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    args = ["train", "--preset", "tiny-llama", "--sft", "--data-path", str(jsonl), "--tokenizer-type", "ByteTokenizer",
            "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3",
            "--lr-warmup-iters", "2", "--log-interval", "4", "--split", "90,10,0", "--eval-interval", "20", "--eval-iters", "1", *extra]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "meshtron", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "conversations packed into" in proc.stdout, proc.stdout
    return [float(l.split("| loss ")[1].split()[0]) for l in proc.stdout.splitlines() if l.startswith("iteration")]


def test_sft_training_lowers_the_loss_on_replies(tmp_path):
    losses = train(tmp_path, "--train-iters", "20")
    assert len(losses) == 5 and losses[-1] < losses[0] - 1.0, losses
