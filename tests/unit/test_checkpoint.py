"""Checkpoints: exact round trip through DCP, RNG restore, crash safety, clear errors."""

import json
import random

import numpy as np
import pytest
import torch

from meshtron.checkpoint import checkpoint as ckpt
from meshtron.checkpoint.checkpoint import (
    CheckpointError,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
)
from meshtron.config import TrainConfig
from meshtron.optim.lr_schedule import LRSchedule
from meshtron.optim.build import build_optimizer

CFG = TrainConfig(
    lr=1e-2, min_lr=1e-3, lr_warmup_iters=2, train_iters=10, clip_grad=0.5, initial_loss_scale=256.0, loss_scale_window=1
)


def setup(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16)
    ).to(dtype)
    return model, build_optimizer(model, CFG, dtype)


def train(model, opt, steps, start=0):
    """Two micro batches a step, data fixed by the step number (not by the global RNG)."""
    sched, results = LRSchedule.from_config(CFG), []
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(2):
            tokens = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(10 * step + micro))
            logits = model(tokens).float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
            opt.scale_loss(loss / 2).backward()
        results.append(opt.step(sched.lr_at(step)))
    return results


def trained_and_saved(tmp_path, dtype=torch.float32, iteration=2):
    model, opt = setup(dtype)
    train(model, opt, iteration)
    save_checkpoint(tmp_path, iteration, model, opt, {"consumed_samples": 8 * iteration, "lr": {"style": "cosine"}})
    return model, opt


def equal_trees(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal_trees(a[k], b[k]) for k in a)
    return torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_restores_tensors_rng_and_next_steps(tmp_path, dtype):
    model, opt = trained_and_saved(tmp_path, dtype)
    expected_rng = (torch.rand(3), random.random(), np.random.rand())
    continued = train(model, opt, 2, start=2)

    other, other_opt = setup(dtype, seed=1)
    meta = load_checkpoint(tmp_path, other, other_opt)
    assert meta == {"consumed_samples": 16, "lr": {"style": "cosine"}, "iteration": 2}
    assert torch.equal(torch.rand(3), expected_rng[0])
    assert (random.random(), np.random.rand()) == expected_rng[1:]
    resumed = train(other, other_opt, 2, start=2)
    assert resumed == continued  # norms, skips and loss scales (fp16: grown every step) too
    assert equal_trees(other.state_dict(), model.state_dict())
    assert equal_trees(other_opt.state_dict(), opt.state_dict())


def test_rng_states_are_restored(tmp_path):
    model, opt = setup()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    save_checkpoint(tmp_path, 1, model, opt, {})
    after_save = (torch.rand(4), random.random(), np.random.rand(2))
    torch.manual_seed(8), random.seed(8), np.random.seed(8)
    load_checkpoint(tmp_path, model)
    assert torch.equal(torch.rand(4), after_save[0])
    assert random.random() == after_save[1]
    assert np.array_equal(np.random.rand(2), after_save[2])
    torch.manual_seed(8)
    load_checkpoint(tmp_path, model, load_rng=False)
    assert not torch.equal(torch.rand(4), after_save[0])


def test_layout_tracker_and_explicit_iteration(tmp_path):
    model, opt = trained_and_saved(tmp_path, iteration=2)
    train(model, opt, 2, start=2)
    save_checkpoint(tmp_path, 4, model, opt, {"consumed_samples": 32})
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert latest_iteration(tmp_path) == 4
    assert {p.name for p in (tmp_path / "iter_0000004").iterdir()} >= {".metadata", "meta.json", "rng_rank0.pt"}
    other, other_opt = setup(seed=1)
    assert load_checkpoint(tmp_path, other, other_opt)["iteration"] == 4
    assert load_checkpoint(tmp_path, other, other_opt, iteration=2)["consumed_samples"] == 16


def test_fresh_start_returns_none(tmp_path):
    model, opt = setup()
    assert load_checkpoint(tmp_path / "nothing", model, opt) is None
    assert latest_iteration(tmp_path) is None


def snapshot(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir()}


@pytest.mark.parametrize("new_iteration", [4, 2])  # a new iteration, or re-saving the tracked one
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch, new_iteration):
    model, opt = trained_and_saved(tmp_path, iteration=2)
    before = snapshot(tmp_path / "iter_0000002")
    train(model, opt, 1, start=2)

    def crash():  # runs after DCP has written the tensors of the new checkpoint
        assert any(p.name.endswith(".distcp") for p in tmp_path.glob("iter_*.tmp/*"))
        raise RuntimeError("disk full")

    monkeypatch.setattr(ckpt, "get_rng_state", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, new_iteration, model, opt, {})
    monkeypatch.undo()

    assert latest_iteration(tmp_path) == 2
    assert snapshot(tmp_path / "iter_0000002") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    other, other_opt = setup(seed=1)
    assert load_checkpoint(tmp_path, other, other_opt)["iteration"] == 2


def test_tracker_written_only_after_checkpoint_is_complete(tmp_path, monkeypatch):
    model, opt = setup()
    seen = []
    real = ckpt._write_durably

    def spy(path, data):
        if path.name == ckpt.TRACKER:
            final = tmp_path / "iter_0000003"
            seen.append(sorted(p.name for p in final.iterdir()))
        real(path, data)

    monkeypatch.setattr(ckpt, "_write_durably", spy)
    save_checkpoint(tmp_path, 3, model, opt, {})
    assert seen and {".metadata", "meta.json", "rng_rank0.pt"} <= set(seen[0])

    def fail(tmp, final):
        raise OSError("rename failed")

    monkeypatch.setattr(ckpt, "_move_into_place", fail)
    with pytest.raises(CheckpointError, match="saving iteration 5 .* failed: rank 0: OSError: rename failed"):
        save_checkpoint(tmp_path, 5, model, opt, {})
    assert latest_iteration(tmp_path) == 3


def test_stale_temp_dir_from_killed_run_is_cleared(tmp_path):
    model, opt = setup()
    stale = tmp_path / "iter_0000001.tmp-99999"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("x")
    save_checkpoint(tmp_path, 1, model, opt, {})
    assert not stale.exists()


def test_no_load_optim_refreshes_bf16_masters(tmp_path):
    model, _ = trained_and_saved(tmp_path, torch.bfloat16)
    other, other_opt = setup(torch.bfloat16, seed=1)
    load_checkpoint(tmp_path, other, other_opt, load_optim=False)
    for name, master in other_opt.state_dict()["master"].items():
        assert torch.equal(master, model.state_dict()[name].float())
    assert other_opt.state_dict()["state"]["1.weight"]["step"].item() == 0


def test_save_without_optimizer_then_loading_it_is_an_error(tmp_path):
    model, opt = setup()
    save_checkpoint(tmp_path, 1, model, opt, {}, save_optim=False)
    load_checkpoint(tmp_path, model)
    with pytest.raises(CheckpointError, match="no-load-optim"):
        load_checkpoint(tmp_path, model, opt)


def test_errors_name_the_file(tmp_path):
    model, opt = trained_and_saved(tmp_path)
    directory = tmp_path / "iter_0000002"

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, model, opt)
    assert "latest_checkpointed_iteration.txt" in str(err.value) and "iter_0000007" in str(err.value)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2\n")
    with pytest.raises(CheckpointError, match="parent"):
        load_checkpoint(directory, model, opt)  # an iteration directory, not the save directory

    def broken(name, damage):
        saved = (directory / name).read_bytes()
        damage(directory / name)
        with pytest.raises(CheckpointError, match=name):
            load_checkpoint(tmp_path, model, opt)
        (directory / name).write_bytes(saved)

    broken("meta.json", lambda p: p.write_text("{not json"))
    broken("meta.json", lambda p: p.unlink())
    broken("rng_rank0.pt", lambda p: p.unlink())
    broken("rng_rank0.pt", lambda p: p.write_bytes(b"garbage"))
    broken(".metadata", lambda p: p.unlink())
    broken(".metadata", lambda p: p.write_bytes(b"garbage"))
    broken("__0_0.distcp", lambda p: p.write_bytes(p.read_bytes()[:100]))
    broken("__0_0.distcp", lambda p: p.unlink())
    load_checkpoint(tmp_path, model, opt)  # restored files load again


def test_meta_json_is_plain_json(tmp_path):
    trained_and_saved(tmp_path)
    record = json.loads((tmp_path / "iter_0000002" / "meta.json").read_text())
    assert record["iteration"] == 2 and record["meta"]["consumed_samples"] == 16


def test_async_save_writes_the_state_of_the_saving_step_and_completes_on_finish(tmp_path):
    model, opt = trained_and_saved(tmp_path, iteration=2)
    train(model, opt, 1, start=2)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    pending = ckpt.start_save(tmp_path, 3, model, opt, {"consumed_samples": 24}, in_background=True)
    assert pending.staged_bytes > 0
    train(model, opt, 1, start=3)  # training goes on while the files are written
    assert latest_iteration(tmp_path) == 2  # not complete before finish
    assert pending.finish() == tmp_path / "iter_0000003"
    assert latest_iteration(tmp_path) == 3
    other, other_opt = setup(seed=1)
    assert load_checkpoint(tmp_path, other, other_opt)["iteration"] == 3
    assert equal_trees(other.state_dict(), at_save)


def test_async_save_failure_surfaces_at_finish_and_keeps_previous(tmp_path, monkeypatch):
    model, opt = trained_and_saved(tmp_path, iteration=2)
    monkeypatch.setattr(ckpt, "write_rank_files", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    pending = ckpt.start_save(tmp_path, 4, model, opt, {}, in_background=True)
    with pytest.raises(CheckpointError, match="failed: rank 0: OSError: disk full"):
        pending.finish()
    assert latest_iteration(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
