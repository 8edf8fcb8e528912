"""The save directory's guards (lock, usability, no overwrite), retention, the tracker fallback and
the one-line failure reason, each on a directory of real (tiny) checkpoints."""

import errno
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import meshtron.checkpoint.save_dir as save_dir
from meshtron.checkpoint.checkpoint import TRACKER, load_checkpoint, newest_iteration, save_checkpoint
from meshtron.checkpoint.retention import prune
from meshtron.checkpoint.save_dir import SaveLock, claim_save_dir, failure_line, overwrite_problem, save_dir_problem
from meshtron.config import build_config
from meshtron.errors import CheckpointError, ConfigError
from meshtron.validation import validate


def saved(root, *iterations):
    model = nn.Linear(3, 2)
    for i in iterations:
        save_checkpoint(root, i, model, None, {"consumed_samples": i}, save_optim=False)
    return model


def test_save_naming_a_file_or_under_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    assert "is a file, not a directory" in save_dir_problem(str(tmp_path / "f"))
    assert f"{tmp_path / 'f'} is a file" in save_dir_problem(str(tmp_path / "f" / "ckpt"))
    assert save_dir_problem(str(tmp_path / "new" / "ckpt")) is None


def test_a_read_only_mount_is_found_by_writing():
    assert "cannot be written" in save_dir.probe_writable(save_dir.Path("/proc/meshtron-ckpt"))


def test_second_writer_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / save_dir.LOCK).write_text(json.dumps({"host": save_dir.socket.gethostname(), "pid": holder.pid, "job": "",
                                                          "since": "2025-01-01 00:00:00"}))  # fmt: skip
        problem, _ = SaveLock(tmp_path).acquire()
        assert f"being written by another run (host {save_dir.socket.gethostname()} pid {holder.pid}" in problem
        assert f"delete {tmp_path / save_dir.LOCK} if it is gone" in problem
    finally:
        holder.kill()
        holder.wait()
    lock = SaveLock(tmp_path)
    problem, note = lock.acquire()
    assert problem is None and "took over the lock" in note and "an ended run" in note
    assert json.loads((tmp_path / save_dir.LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / save_dir.LOCK).exists()


def test_the_same_job_restarted_elsewhere_takes_its_lock_back(tmp_path, monkeypatch):
    (tmp_path / save_dir.LOCK).write_text(json.dumps({"host": "another-node", "pid": 1, "job": "4242"}))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    problem, note = SaveLock(tmp_path).acquire()
    assert problem is None and "from this job" in note
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    (tmp_path / save_dir.LOCK).write_text(json.dumps({"host": "another-node", "pid": 1, "job": "4242"}))
    assert "job 4242" in SaveLock(tmp_path).acquire()[0]


def test_fresh_run_or_rollback_into_checkpoints_is_refused_resume_is_not(tmp_path):
    saved(tmp_path, 10, 20, 30)
    assert "holds checkpoints of iterations 10, 20, 30 and this run starts from iteration 0" in overwrite_problem(tmp_path, 0, False)
    assert "iterations 20, 30 and this run starts at iteration 10" in overwrite_problem(tmp_path, 10, True)
    assert overwrite_problem(tmp_path, 30, True) is None
    assert "iterations 30" in overwrite_problem(tmp_path, 30, False)  # started at 30 from another directory: its save would replace 30
    lock = SaveLock(tmp_path)
    assert claim_save_dir(lock, 0, False, allow_existing=True, checkpoint_bytes=1)[0] is None
    lock.release()
    assert claim_save_dir(lock, 30, True, False, checkpoint_bytes=1)[0] is None
    lock.release()
    assert "free but one checkpoint of this run takes about 4294967296.00 GiB" in claim_save_dir(lock, 30, True, False, checkpoint_bytes=2**62)[0]
    lock.release()


def test_keep_last_removes_only_older_complete_checkpoints(tmp_path):
    saved(tmp_path, 1, 2, 3, 4)
    (tmp_path / "iter_0000005.tmp").mkdir()  # one being written
    (tmp_path / "iter_0000009").mkdir()  # incomplete (no marker): not ours to judge
    assert prune(tmp_path, 2, just_saved=4) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("iter_")) == ["iter_0000003", "iter_0000004", "iter_0000005.tmp", "iter_0000009"]
    assert prune(tmp_path, 0, just_saved=4) == []
    assert prune(tmp_path, 1, just_saved=3) == []  # 4 is newer than the one just saved: left alone; 3 is the newest up to it
    assert load_checkpoint(tmp_path, nn.Linear(3, 2), load_rng=False)["iteration"] == 4


@pytest.mark.parametrize("tracker", [None, "garbage\n"])
def test_missing_or_garbage_tracker_falls_back_to_the_newest_complete_checkpoint(tmp_path, tracker):
    model = saved(tmp_path, 2, 4)
    (tmp_path / "iter_0000006").mkdir()  # no marker: not complete
    (tmp_path / TRACKER).unlink()
    if tracker:
        (tmp_path / TRACKER).write_text(tracker)
    lines = []
    assert newest_iteration(tmp_path, lines.append) == 4
    assert str(tmp_path / "iter_0000004") in lines[0] and ("no tracker" in lines[0] if tracker is None else "'garbage'" in lines[0])
    other = nn.Linear(3, 2)
    assert load_checkpoint(tmp_path, other, load_rng=False, log=lines.append)["iteration"] == 4
    assert torch.equal(other.weight, model.weight)


def test_garbage_tracker_with_nothing_to_fall_back_on_is_an_error(tmp_path):
    (tmp_path / TRACKER).write_text("x")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint to fall back on"):
        newest_iteration(tmp_path)
    assert newest_iteration(tmp_path / "empty") is None


def test_failure_line_finds_the_operating_systems_reason_inside_wrappers(tmp_path):
    disk_full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "__0_0.distcp"))
    try:
        try:
            raise disk_full
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        line = failure_line(outer, tmp_path)
    assert line.startswith(f"No space left on device ({tmp_path / '__0_0.distcp'}); ") and line.endswith("free on its disk")
    short = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    assert failure_line(short, tmp_path).startswith("a write stopped short (an I/O error); ")  # this disk has room


def test_load_equal_to_save_may_not_exist_yet_another_load_must(tmp_path):
    first_start = str(tmp_path / "ckpt")
    validate(build_config(None, ["--mock-data", "--load", first_start, "--save", first_start]))
    with pytest.raises(ConfigError, match="--load .*other does not exist"):
        validate(build_config(None, ["--mock-data", "--load", str(tmp_path / "other"), "--save", first_start]))
