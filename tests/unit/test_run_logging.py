"""What a run leaves to look at: the start-up notes for Megatron flags meshtron does its own way
(each once), TensorBoard scalars (loss, lr, grad norm, tokens/s, step time, memory, validation
perplexity), a ``--profile`` trace of the asked-for iterations, and W&B logging (a clear refusal
when the package is missing; through a stand-in module here, as the test machine has none).

One tiny CPU run on mock data (a few seconds) serves the checks that need a run."""

from __future__ import annotations

import importlib.machinery
import json
import shlex
import sys
import types

import pytest

from meshtron.config import build_config
from meshtron.errors import ConfigError
from meshtron.training.trainer import Trainer
from meshtron.validation import validate

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 6 --log-interval 1 --eval-interval 3 --eval-iters 1 --mock-data --vocab-size 128 --device cpu "
        "--lr-warmup-iters 1 --overlap-grad-reduce --overlap-grad-reduce --log-throughput --attention-backend unfused")  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished tiny run with TensorBoard and a profile of iterations [2, 4): (its directory, its log lines)."""
    run_dir = tmp_path_factory.mktemp("run")
    lines: list[str] = []
    cfg = build_config(None, shlex.split(TINY) + ["--tensorboard-dir", str(run_dir), "--profile", "--profile-step-start", "2",
                                                  "--profile-step-end", "4"])  # fmt: skip
    Trainer(cfg, log=lines.append).run()
    return run_dir, lines


def test_noted_flags_are_said_once_at_start_up(tiny_run):
    _, lines = tiny_run
    assert sum(line.startswith("--overlap-grad-reduce: always on") for line in lines) == 1
    assert any(line.startswith("--log-throughput: always") for line in lines)
    assert any(line.startswith("--attention-backend unfused: meshtron's math") for line in lines)


def test_tensorboard_has_what_a_plot_needs(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = tiny_run
    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s_per_device", "perf/ms_per_iter",
                "perf/host_peak_rss_gib", "train/batch_size", "valid/loss", "valid/ppl"):  # fmt: skip
        assert tag in tags, f"{tag} missing from {sorted(tags)}"
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 7))


def test_profile_trace_covers_the_asked_iterations(tiny_run):
    run_dir, lines = tiny_run
    traces = list((run_dir / "profile").glob("*.json"))
    assert [t.name for t in traces] == ["trace_rank0_iters_2-4.json"]
    assert json.loads(traces[0].read_text())["traceEvents"], "the trace is empty"
    assert any("profile of iterations [2, 4) written to" in line for line in lines)


def test_wandb_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed, whatever this machine has
    with pytest.raises(ConfigError, match="pip install wandb"):
        validate(build_config(None, ["--wandb-project", "p"]), world_size=1)


def test_wandb_gets_the_scalars_and_its_settings(monkeypatch, tmp_path):
    calls: dict = {"log": []}
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class Run:
        def log(self, values, step):
            calls["log"].append((step, values))

        def finish(self):
            calls["finished"] = True

    fake.init = lambda **kwargs: calls.update(init=kwargs) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    save_dir = tmp_path / "wandb"
    cfg = build_config(None, shlex.split(TINY) + ["--train-iters", "2", "--eval-interval", "0", "--wandb-project", "proj",
                                                  "--wandb-exp-name", "exp", "--wandb-save-dir", str(save_dir)])  # fmt: skip
    Trainer(cfg, log=lambda _: None).run()
    assert calls["init"]["project"] == "proj" and calls["init"]["name"] == "exp" and calls["init"]["dir"] == str(save_dir)
    assert "mode" not in calls["init"], "W&B's own WANDB_MODE (offline) must decide"
    assert [step for step, _ in calls["log"]] == [1, 2] and "train/loss" in calls["log"][0][1] and calls.get("finished")
    assert save_dir.is_dir()


def test_plot_writes_a_png_of_the_run(tiny_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from meshtron.cli import main
    from meshtron.plot import PANELS, read_scalars

    run_dir, _ = tiny_run
    assert main(["plot", str(run_dir), "--output", str(tmp_path / "run.png")]) == 0
    png = (tmp_path / "run.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000 and f"wrote {tmp_path / 'run.png'}" in capsys.readouterr().out
    scalars = read_scalars(run_dir)
    assert all(any(tag in scalars for tag, _ in series) for _, series in PANELS), "a panel of the plot would be empty"
    assert scalars["valid/loss"][0] == [3, 6]


def test_plot_without_matplotlib_or_events_says_what_to_do(tiny_run, tmp_path, monkeypatch, capsys):
    from meshtron.cli import main

    assert main(["plot", str(tmp_path)]) == 2 and "train with --tensorboard-dir" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(tiny_run[0])]) == 2 and "pip install 'meshtron[plot]'" in capsys.readouterr().err


def test_interval_meter_counts_steps_not_what_runs_between(monkeypatch):
    """Step time is read once per stretch of steps (no sync per step); ``pause`` before evaluation or
    a save keeps their time out of the next log line's throughput."""
    import torch

    from meshtron.training import metrics

    clock = iter([0.0, 3.0, 10.0, 12.0])  # start, pause (evaluation follows), start again, summary
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    meter = metrics.IntervalMeter(flops_per_token=1.0, bases=(), device=torch.device("cpu"))
    for _ in range(3):
        meter.start_step()
        meter.end_step(tokens=100, skipped=False)
    meter.pause()
    meter.pause()  # nothing running: no clock read
    meter.start_step()
    meter.end_step(tokens=100, skipped=True)
    stats = meter.summary()
    assert stats["ms_per_iter"] == 1000.0 * (3.0 + 2.0) / 4 and stats["tokens_per_s"] == 400 / 5.0 and stats["skipped"] == 1
