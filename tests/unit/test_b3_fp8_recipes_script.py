"""``benchmarks/b3_fp8_recipes.py --global-batch-size N``: every side runs N sequences a step (the
flag after the side's own, so it wins), and the table says so; without it the workload's batch."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import b3_fp8_recipes  # noqa: E402
from meshtron.config import build_config  # noqa: E402


def _sides_run(monkeypatch, capsys, *args: str) -> tuple[dict[str, list[str]], str]:
    flags = {}

    def run_side(name, side_flags, steps, warmup, limit):
        flags[name] = side_flags
        return None

    monkeypatch.setattr(b3_fp8_recipes, "run_side", run_side)
    monkeypatch.setattr(sys, "argv", ["b3_fp8_recipes.py", "--sides", "bf16,delayed,delayed_head", *args])
    b3_fp8_recipes.compare("B3", b3_fp8_recipes.B3, b3_fp8_recipes.SIDES, "bf16", "")
    return flags, capsys.readouterr().out


def test_global_batch_size_applies_to_every_side(monkeypatch, capsys):
    flags, out = _sides_run(monkeypatch, capsys, "--global-batch-size", "8")
    assert list(flags) == ["bf16", "delayed", "delayed_head"] and "B3, global batch 8" in out
    for side_flags in flags.values():
        train = build_config(overrides=side_flags).train
        assert (train.global_batch_size, train.micro_batch_size) == (8, 1)
    flags, out = _sides_run(monkeypatch, capsys)
    assert all(build_config(overrides=f).train.global_batch_size == 1 for f in flags.values()) and "global batch" not in out
