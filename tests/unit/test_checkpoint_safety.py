"""Checkpoints that cannot run code, carry checksums, refuse partial loads, and explain themselves."""

import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from meshtron import cli
from meshtron.checkpoint import checkpoint as ckpt
from meshtron.checkpoint.checkpoint import (
    CheckpointError,
    checkpoint_config_errors,
    load_checkpoint,
    load_for_training,
    save_checkpoint,
)
from meshtron.checkpoint.integrity import MARKER, describe_files, manifest
from meshtron.config import CheckpointConfig, build_config
from meshtron.models import build_model
from meshtron.optim.build import build_optimizer
from meshtron.parallel.mesh import Mesh
from tests.unit.test_checkpoint import CFG, setup, trained_and_saved


class Payload:
    """Unpickling it creates ``path``: what a crafted checkpoint would do with any other function."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def rewrite_metadata(directory: Path, change) -> None:
    """Change the pickled DCP index and re-checksum: an attacker controls every file, marker included."""
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    change(metadata)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    (directory / MARKER).write_text(json.dumps(manifest(0, describe_files([p for p in directory.iterdir() if p.name != MARKER]))))


def generatable_checkpoint(path):
    """A model-only checkpoint that ``generate`` and ``hf-export`` can rebuild."""
    cfg = build_config(overrides=["--model.preset", "tiny-llama", "--tokenizer-type", "ByteTokenizer"])
    model = build_model(cfg.model, 384, cfg.data.seq_length)
    meta = {"config": cfg.to_dict(), "vocab_size": 384, "tokenizer": {"tokenizer_type": "ByteTokenizer"}}
    save_checkpoint(path, 5, model, None, meta, save_optim=False)
    return model


def test_malicious_metadata_runs_on_no_load_path(tmp_path, capsys):
    probe = tmp_path / "payload-works"
    pickle.loads(pickle.dumps(Payload(probe)))
    assert probe.exists()  # the payload is real: plain pickle (DCP's FileSystemReader) runs it

    save_dir, marker = tmp_path / "ckpt", tmp_path / "pwned"
    generatable_checkpoint(save_dir)
    rewrite_metadata(save_dir / "iter_0000005", lambda m: setattr(m, "planner_data", Payload(marker)))
    paths = {
        "meshtron train --load": ["train", "--preset", "tiny-llama", "--mock-data", "--vocab-size", "384", "--train-iters", "1", "--load", str(save_dir), "--no-load-optim", "--no-load-rng"],
        "meshtron generate --load": ["generate", "--load", str(save_dir), "--prompt", "Hi", "--device", "cpu"],
        "meshtron convert hf-export": ["convert", "hf-export", "--load", str(save_dir), "--hf-dir", str(tmp_path / "hf")],
        "meshtron checkpoint info": ["checkpoint", "info", str(save_dir)],
    }
    for name, argv in paths.items():
        assert cli.main(argv) != 0, name
        out = capsys.readouterr()
        assert "iter_0000005/.metadata" in out.out + out.err and "references io.open" in out.out + out.err, name
        assert not marker.exists(), f"{name} ran the payload"


def test_metadata_pointing_outside_or_at_pickled_objects_is_refused(tmp_path):
    model, opt = trained_and_saved(tmp_path)
    directory = tmp_path / "iter_0000002"
    original = (directory / ".metadata").read_bytes()

    def escape(m):
        info = next(iter(m.storage_data.values()))
        info.relative_path = "../../outside.distcp"

    rewrite_metadata(directory, escape)
    with pytest.raises(CheckpointError, match=r"\.metadata points at data file '../../outside.distcp'"):
        load_checkpoint(tmp_path, model, opt)
    (directory / ".metadata").write_bytes(original)
    # DCP loads a BytesStorageMetadata item with torch.load(weights_only=False): never admitted.
    rewrite_metadata(directory, lambda m: m.state_dict_metadata.update({"model.extra": BytesStorageMetadata()}))
    with pytest.raises(CheckpointError, match=r"\.metadata references .*BytesStorageMetadata"):
        load_checkpoint(tmp_path, model, opt)


def test_no_unrestricted_pickle_in_meshtron():
    """Every load of a file is weights_only or through the restricted unpickler."""
    root = Path(ckpt.__file__).parents[1]
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"pickle\.loads?\(|\.read_metadata\(\)|dcp\.load\([^)]*checkpoint_id", text), path  # DCP's own reader unpickles
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (path, call)


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "meta.json", "rng_rank0.pt"])
def test_flipped_byte_names_file_and_iteration_and_the_way_back(tmp_path, name):
    model, opt = trained_and_saved(tmp_path, iteration=2)
    save_checkpoint(tmp_path, 4, model, opt, {"consumed_samples": 32})
    flip_byte(tmp_path / "iter_0000004" / name)
    other, other_opt = setup(seed=1)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, other, other_opt)
    message = str(err.value)
    assert f"iter_0000004/{name} is corrupt" in message and "iteration 4" in message
    assert "--ckpt-step 2" in message and "complete ones in" in message
    meta = load_for_training(CheckpointConfig(load=str(tmp_path), ckpt_step=2), other, other_opt, Mesh())
    assert meta["iteration"] == 2 and torch.equal(other[1].weight, model[1].weight)


def test_incomplete_truncated_or_extra_files_are_refused(tmp_path):
    model, opt = trained_and_saved(tmp_path)
    directory = tmp_path / "iter_0000002"
    listed = json.loads((directory / MARKER).read_text())["files"]
    assert set(listed) == {p.name for p in directory.iterdir()} - {MARKER}
    assert all(len(f["crc32"]) == 8 and f["bytes"] == (directory / n).stat().st_size for n, f in listed.items())

    (directory / "stray.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="stray.distcp is not listed in complete.json"):
        load_checkpoint(tmp_path, model, opt)
    (directory / "stray.distcp").unlink()
    data = directory / "__0_0.distcp"
    data.write_bytes(data.read_bytes() + b"\0")
    with pytest.raises(CheckpointError, match=r"__0_0.distcp has \d+ bytes"):
        load_checkpoint(tmp_path, model, opt)
    (directory / MARKER).unlink()
    with pytest.raises(CheckpointError, match="no complete.json: the checkpoint is incomplete.*no other complete checkpoint"):
        load_checkpoint(tmp_path, model, opt)


def test_marker_is_in_place_before_the_tracker(tmp_path, monkeypatch):
    model, opt = setup()
    seen = []
    real = ckpt._write_durably

    def spy(path, data):
        if path.name == ckpt.TRACKER:
            seen.append((tmp_path / "iter_0000003" / MARKER).is_file())
        real(path, data)

    monkeypatch.setattr(ckpt, "_write_durably", spy)
    save_checkpoint(tmp_path, 3, model, opt, {})
    assert seen == [True]


def test_a_save_cut_off_between_the_rename_and_the_tracker_is_the_one_loaded(tmp_path, monkeypatch):
    """The crash window of an asynchronous save killed after its directory was moved into place: the
    tracker still says 2, ``tracker_pending.txt`` says 3, and iteration 3 is complete. The load takes
    3 and says why; with no pending file a newer directory is a branch the run left, and the tracker wins."""
    model, opt = setup()
    save_checkpoint(tmp_path, 2, model, opt, {})
    assert not (tmp_path / ckpt.PENDING).exists()  # a save that ends leaves none behind
    real = ckpt._write_durably

    def killed_at_the_tracker(path, data):
        if path.name == ckpt.TRACKER:
            raise OSError("killed")
        real(path, data)

    monkeypatch.setattr(ckpt, "_write_durably", killed_at_the_tracker)
    with pytest.raises(Exception, match="killed"):
        save_checkpoint(tmp_path, 3, model, opt, {})
    monkeypatch.setattr(ckpt, "_write_durably", real)
    assert (tmp_path / ckpt.TRACKER).read_text().strip() == "2" and (tmp_path / "iter_0000003" / MARKER).is_file()
    lines = []
    assert ckpt.newest_iteration(tmp_path, lines.append) == 3
    assert "the tracker says 2" in lines[0] and "iter_0000003" in lines[0]
    (tmp_path / ckpt.PENDING).unlink()
    assert ckpt.newest_iteration(tmp_path, lines.append) == 2


class Stack(nn.Module):
    def __init__(self, num_layers):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(num_layers))


def test_fewer_layers_is_an_error_listing_them_unless_strictness_log_all(tmp_path):
    torch.manual_seed(0)
    big = Stack(4)
    save_checkpoint(tmp_path, 1, big, build_optimizer(big, CFG, torch.float32), {})
    small = Stack(2)
    small_opt = build_optimizer(small, CFG, torch.float32)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, small, small_opt)
    # 2 layers x (weight, bias) x (model, master, exp_avg, exp_avg_sq, step) = 20 tensors
    assert "holds 20 tensors this run does not have" in str(err.value)
    assert "model.layers.2.bias" in str(err.value) and "--dist-ckpt-strictness log_all" in str(err.value)
    with pytest.raises(CheckpointError, match="holds 4 tensors"):  # weights only: the model's tensors count
        load_checkpoint(tmp_path, small, load_rng=False)

    logged = []
    load_checkpoint(tmp_path, small, small_opt, strict=False, log=logged.append)
    assert "20 tensors" in logged[0]
    assert torch.equal(small.layers[1].weight, big.layers[1].weight) and torch.equal(small.embed.weight, big.embed.weight)


def test_finetune_loads_weights_only_and_restarts_at_zero(tmp_path):
    model, _ = trained_and_saved(tmp_path, torch.bfloat16, iteration=2)
    other, other_opt = setup(torch.bfloat16, seed=1)
    torch.manual_seed(5)
    expected_draw = torch.rand(2)
    torch.manual_seed(5)
    meta = load_for_training(CheckpointConfig(load=str(tmp_path), finetune=True), other, other_opt, Mesh())
    assert (meta["iteration"], meta["consumed_samples"]) == (0, 0)
    assert torch.equal(torch.rand(2), expected_draw)  # the RNG was not restored
    assert torch.equal(other[1].weight, model[1].weight)
    state = other_opt.state_dict()
    assert state["state"]["1.weight"]["step"].item() == 0  # no optimizer state
    assert torch.equal(state["master"]["1.weight"], model[1].weight.float())  # masters follow the weights


def test_no_save_rng(tmp_path):
    model, opt = setup()
    save_checkpoint(tmp_path, 1, model, opt, {}, save_rng=False)
    assert not list((tmp_path / "iter_0000001").glob("rng_*"))
    with pytest.raises(CheckpointError, match="--no-save-rng.*--no-load-rng"):
        load_checkpoint(tmp_path, model, opt)
    assert load_checkpoint(tmp_path, model, opt, load_rng=False)["iteration"] == 1


def test_flags_and_their_validation():
    cfg = build_config(None, ["--mock-data", "--load", "x", "--ckpt-step", "3", "--finetune", "--no-save-rng", "--ckpt-format", "torch_dist",
                              "--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load", "--dist-ckpt-strictness", "log_all",
                              "--no-check-for-nan-in-loss-and-grad", "--max-consecutive-skipped-steps", "4"])  # fmt: skip
    c = cfg.checkpoint
    assert (c.ckpt_step, c.finetune, c.no_save_rng, c.ckpt_format, c.dist_ckpt_strictness) == (3, True, True, "torch_dist", "log_all")
    assert (cfg.train.check_for_nan_in_loss_and_grad, cfg.train.max_consecutive_skipped_steps) == (False, 4)
    assert checkpoint_config_errors(cfg) == []
    defaults = build_config(None, ["--mock-data"])
    assert defaults.train.check_for_nan_in_loss_and_grad and defaults.checkpoint.ckpt_step == -1
    # Megatron's legacy "torch" format is written as torch_dist, with a note in the log (the ROCm scripts pass it).
    assert build_config(None, ["--mock-data", "--ckpt-format", "torch"]).checkpoint.ckpt_format == "torch_dist"
    bad = build_config(None, ["--mock-data", "--ckpt-format", "zarr", "--dist-ckpt-strictness", "ignore_all", "--finetune"])
    errors = "\n".join(checkpoint_config_errors(bad))
    assert "--ckpt-format zarr is not supported" in errors and "--dist-ckpt-strictness must be one of raise_all, log_all" in errors
    assert "--finetune needs --load" in errors


def test_checkpoint_info(tmp_path, capsys):
    model, opt = trained_and_saved(tmp_path, iteration=2)
    meta = {"config": {"parallel": {"tensor_parallel": 2, "context_parallel": 1, "pipeline_parallel": 2, "use_distributed_optimizer": True}}}
    save_checkpoint(tmp_path, 4, model, opt, meta)
    ckpt_dir = tmp_path / "iter_0000004"
    record = json.loads((ckpt_dir / "meta.json").read_text())
    (ckpt_dir / "meta.json").write_text(json.dumps({**record, "world_size": 8}))  # as if saved by tp 2 x dp 2 x pp 2
    (ckpt_dir / MARKER).write_text(json.dumps(manifest(4, describe_files([p for p in ckpt_dir.iterdir() if p.name != MARKER]))))
    assert cli.main(["checkpoint", "info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"OK: iteration 4 of {tmp_path} is complete and intact" and len(out.splitlines()) == 6, out
    assert re.search(r"tensors: 36, \d+ bytes \(--tensors lists them\)", out) and "model.1.weight" not in out
    assert cli.main(["checkpoint", "info", str(tmp_path), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path}: iterations 2, 4 (tracker: 4)" in out and f"iteration 4: {ckpt_dir}" in out
    assert "checksums: verified OK (5 files" in out
    assert "saved by 8 processes (tp 2 x cp 1 x dp 2 x pp 2, distributed optimizer); optimizer state: yes; RNG states: yes" in out
    assert re.search(r"model\.1\.weight +\[8, 8\] +float32", out) and re.search(r"optimizer\.state\.3\.bias\.step +\[\] +float32", out)
    assert re.search(r"tensors: 36, \d+ bytes", out)

    flip_byte(ckpt_dir / "__0_0.distcp")
    assert cli.main(["checkpoint", "info", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAILED: iteration 4 of {tmp_path}: checkpoint file {ckpt_dir}/__0_0.distcp is corrupt")
    assert f"checksums: FAILED: checkpoint file {ckpt_dir}/__0_0.distcp is corrupt" in out
    assert cli.main(["checkpoint", "info", str(tmp_path), "--ckpt-step", "2"]) == 0
    assert "iteration 2:" in capsys.readouterr().out
    (ckpt_dir / MARKER).unlink()
    assert cli.main(["checkpoint", "info", str(tmp_path)]) == 1
    assert "the checkpoint is incomplete" in capsys.readouterr().out.splitlines()[0]


def test_ranks_split_the_checksum_reading_and_cover_every_file():
    from meshtron.checkpoint.integrity import _share

    files = {"a": (100, "x"), "b": (60, "x"), "c": (50, "x"), "d": (1, "x"), "e": (1, "x")}
    shares = [_share(files, part, 2) for part in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(files) and not set(shares[0]) & set(shares[1])
    assert [sum(files[n][0] for n in share) for share in shares] == [102, 110]  # 212 bytes split 102 | 110
    assert _share(files, 0, 1) == ["a", "b", "c", "d", "e"]
