"""A save that fails (no space, an I/O error) is one line, the previous checkpoint stays loadable,
and --save-failure chooses between training on (the next save retries) and stopping; a run is
refused before training when --save cannot hold it or belongs to another run."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

import meshtron.checkpoint.checkpoint as ckpt
from meshtron import cli

ARGS = ["--mock-data", "--preset", "tiny-gpt", "--vocab-size", "256", "--seq-length", "32", "--log-interval", "1",
        "--eval-interval", "0", "--global-batch-size", "4", "--micro-batch-size", "2", "--device", "cpu", "--save-interval", "1"]  # fmt: skip


def fail_saves_of(monkeypatch, iterations):
    """Rank files of these iterations fail to write as on a full disk."""
    real = ckpt.write_rank_files

    def write(state, tmp, rank):
        if int(tmp.name.removeprefix("iter_").removesuffix(".tmp")) in iterations:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / f"__{rank}_0.distcp"))
        return real(state, tmp, rank)

    monkeypatch.setattr(ckpt, "write_rank_files", write)


def test_failed_saves_are_one_line_each_and_training_goes_on(tmp_path, monkeypatch, capsys):
    save = tmp_path / "ckpt"
    fail_saves_of(monkeypatch, {2, 3})
    assert cli.main(["train", *ARGS, "--train-iters", "4", "--save", str(save)]) == 0
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if " failed: " in line]
    assert len(failed) == 2 and all("\n" not in f for f in failed), out
    assert failed[0].startswith(f"warning: saving iteration 2 to {save} failed: rank 0: No space left on device ({save}/iter_0000002.tmp/__0_0.distcp)")
    assert failed[0].endswith("; the newest checkpoint is still iteration 1; training goes on and the next save tries again "
                              "(--save-failure stop ends the run instead)")  # fmt: skip
    assert "saved checkpoint at iteration 4" in out
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000001", "iter_0000004"]


def test_save_failure_stop_ends_the_run_and_the_previous_checkpoint_loads(tmp_path, monkeypatch, capsys):
    save = tmp_path / "ckpt"
    fail_saves_of(monkeypatch, {2})
    assert cli.main(["train", *ARGS, "--train-iters", "4", "--save", str(save), "--save-failure", "stop", "--ckpt-keep-last", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "saving iteration 2" in err and "the newest checkpoint is still iteration 1" in err, err
    monkeypatch.undo()
    assert cli.main(["train", *ARGS, "--train-iters", "3", "--load", str(save), "--save", str(save), "--ckpt-keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {save} at iteration 1" in out
    assert "removed the checkpoints of iterations 1 (--ckpt-keep-last 1)" in out and "removed the checkpoints of iterations 2 " in out
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000003"]


def test_unusable_or_taken_save_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert cli.main(["train", *ARGS, "--train-iters", "2", "--save", str(tmp_path / "file")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    save = tmp_path / "ckpt"
    assert cli.main(["train", *ARGS, "--train-iters", "2", "--save", str(save)]) == 0
    capsys.readouterr()
    assert cli.main(["train", *ARGS, "--train-iters", "3", "--save", str(save)]) == 2  # a fresh run into them
    err = capsys.readouterr().err
    assert "holds checkpoints of iterations 1, 2 and this run starts from iteration 0" in err and "iteration" not in capsys.readouterr().out
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (save / "meshtron.lock").exists()  # released at the end of the run, and by a refused one


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: room for one checkpoint of the tiny model and not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs privileges this machine does not give; the injected failures above cover the logic")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_a_really_full_disk_is_named_and_the_previous_checkpoint_loads(small_disk, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    run = subprocess.run([sys.executable, "-m", "meshtron", "train", *ARGS, "--train-iters", "3", "--save", str(small_disk / "ckpt")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert "saved checkpoint at iteration 1" in run.stdout
    assert "saving iteration 2" in run.stdout and "No space left on device" in run.stdout + run.stderr, run.stdout[-3000:]
    assert run.stderr.strip().count("\n") == 0, run.stderr  # the last save's failure: one line, no traceback
    info = subprocess.run([sys.executable, "-m", "meshtron", "checkpoint", "info", str(small_disk / "ckpt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert info.returncode == 0 and "iteration 1:" in info.stdout and "verified OK" in info.stdout, info.stdout
