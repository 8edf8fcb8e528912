"""Drills on two gloo ranks: a stop that only one rank sees (a signal, its own clock) is agreed by
all, so every rank saves the same iteration and exits 0; and the resumed run equals the
uninterrupted one."""

import re
import signal
import time

import pytest

from tests.e2e.ranks import Ranks, run_ranks


ARGS = ["--mock-data", "--preset", "tiny-gpt", "--vocab-size", "256", "--seq-length", "32", "--log-interval", "1",
        "--eval-interval", "0", "--global-batch-size", "4", "--micro-batch-size", "2", "--device", "cpu",
        "--train-iters", "60", "--lr-warmup-iters", "2"]  # fmt: skip


def step_lines(out: str) -> dict[int, str]:
    """iteration -> its consumed samples, loss and grad norm, as logged."""
    lines = re.findall(r"iteration +(\d+)/\d+ \| (consumed samples +\d+) .*?(loss [\d.]+ \| grad norm [\d.]+)", out)
    return {int(i): f"{consumed} {loss}" for i, consumed, loss in lines}


def stopped_at(out: str) -> int:
    found = re.findall(r"stopping at iteration (\d+)", out)
    assert len(found) == 1, out[-3000:]
    return int(found[0])


def test_sigterm_to_one_rank_stops_all_at_one_iteration_and_the_resume_equals_the_uninterrupted_run(tmp_path):
    save = tmp_path / "ckpt"
    run = Ranks([*ARGS, "--save", str(save)], 2, tmp_path / "signalled")
    run.wait_for("iteration       3/")
    run.procs[1].send_signal(signal.SIGTERM)  # rank 1 only: rank 0 never sees it
    assert run.wait() == [0, 0], run.output(0)[-3000:] + run.output(1)[-3000:]
    out = run.output(0)
    stop = stopped_at(out)
    assert "(signal; every rank stops and saves here)" in out
    assert f"saved checkpoint at iteration {stop}" in out
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == stop
    assert sorted(p.name for p in (save / f"iter_{stop:07d}").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    end = str(stop + 2)  # --exit-interval ends both runs there with the same --train-iters (the same schedule and data order)
    assert run_ranks([*ARGS, "--load", str(save), "--save", str(save), "--exit-interval", end], 2, tmp_path / "resumed") == [0, 0]
    assert run_ranks([*ARGS, "--exit-interval", end], 2, tmp_path / "uninterrupted") == [0, 0]
    resumed = {**step_lines(out), **step_lines((tmp_path / "resumed" / "rank0.log").read_text())}
    whole = step_lines((tmp_path / "uninterrupted" / "rank0.log").read_text())
    assert sorted(whole) == list(range(1, stop + 3)) and resumed == whole


@pytest.mark.slow
def test_sigint_to_one_rank_saves_on_all_and_a_second_ctrl_c_aborts_at_once(tmp_path):
    once = Ranks([*ARGS, "--save", str(tmp_path / "once")], 2, tmp_path / "once-logs")
    once.wait_for("iteration       3/")
    once.procs[1].send_signal(signal.SIGINT)
    assert once.wait() == [0, 0], once.output(0)[-3000:] + once.output(1)[-3000:]
    stop = stopped_at(once.output(0))
    assert int((tmp_path / "once" / "latest_checkpointed_iteration.txt").read_text()) == stop
    assert "Ctrl-C again aborts at once" in once.output(1)

    # A model whose steps and save take long enough for the second Ctrl-C to land before the save ends
    # (the tiny one saves in 0.03 s, so the second signal came after a complete checkpoint).
    wide = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8"]
    twice = Ranks([*ARGS, *wide, "--save", str(tmp_path / "twice")], 2, tmp_path / "twice-logs")
    twice.wait_for("iteration       3/")
    twice.procs[1].send_signal(signal.SIGINT)
    twice.wait_for("Ctrl-C again aborts at once", rank=1)
    twice.procs[1].send_signal(signal.SIGINT)
    start = time.monotonic()
    codes = twice.wait(timeout=60)
    assert codes[1] == -signal.SIGINT and codes[0] not in (0, None), codes  # rank 0 fails on the lost peer instead of hanging
    assert time.monotonic() - start < 30
    assert not (tmp_path / "twice" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.slow
def test_exit_duration_with_ranks_started_apart_stops_every_rank_at_one_iteration(tmp_path):
    save = tmp_path / "ckpt"
    # 0.25 minutes from each rank's own start, rank 1 starting 4 s after rank 0: their clocks disagree by 4 s.
    run = Ranks([*ARGS, "--train-iters", "100000", "--exit-duration-in-mins", "0.25", "--save", str(save)], 2, tmp_path / "logs", start_gaps=4.0)
    assert run.wait(timeout=180) == [0, 0], run.output(0)[-3000:] + run.output(1)[-3000:]
    out = run.output(0)
    stop = stopped_at(out)
    assert "(wall-clock limit (--exit-duration-in-mins); every rank stops and saves here)" in out
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == stop
    assert sorted(p.name for p in (save / f"iter_{stop:07d}").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
