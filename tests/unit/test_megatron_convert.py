"""``meshtron convert megatron-import | megatron-export`` held to Megatron-LM's own checkpoints and logits.

``tests/data/megatron/*`` were written by Megatron-LM's ``save_checkpoint`` (Megatron-Core 0.19.2,
on the CPU, ``make_checkpoints.py``), each with Megatron's logits of fixed tokens. Imported, the
meshtron model must give those logits to 1e-5; exported back, the torch_dist tensors must equal
Megatron's bit for bit. Damaged or hostile input must fail naming the file, running nothing.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint.checkpoint import CheckpointError, load_checkpoint, read_meta
from meshtron.checkpoint.megatron_files import open_megatron
from meshtron.cli import main as cli_main
from meshtron.config import Config
from meshtron.models import build_model

DATA = Path(__file__).resolve().parents[1] / "data" / "megatron"
TRAINED = ("llama_adam_dist", "llama_adam_bf16_dist", "llama_adam_tp2_torch", "llama_adam_bf16_torch")  # with Adam: test_megatron_optim.py
ENCODERS = ("bert_", "t5_")  # BERT and T5 cases (make_encoder_checkpoints.py): test_megatron_encoders.py
CASES = sorted(p.name for p in DATA.iterdir() if (p / "reference.pt").is_file() and p.name not in TRAINED and not p.name.startswith(ENCODERS))


def _import(case: str, out: Path) -> Path:
    assert cli_main(["convert", "megatron-import", "--load", str(DATA / case), "--save", str(out)]) == 0
    return out


def _logits(save_dir: Path, tokens: torch.Tensor, **model_fields) -> torch.Tensor:
    meta = read_meta(save_dir)
    cfg = Config.from_dict(meta["config"])
    for name, value in model_fields.items():
        setattr(cfg.model, name, value)
    model = build_model(cfg.model, meta["vocab_size"], cfg.data.seq_length).eval()
    load_checkpoint(save_dir, model, load_rng=False, log=lambda _: None)
    with torch.no_grad():
        return model(tokens)


def test_the_data_covers_both_formats_and_the_layouts():
    assert {"llama_tp1_dist", "llama_tp2_dist", "llama_tp2pp2_torch", "gpt_tp2_torch"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_imported_logits_equal_megatrons(case, tmp_path):
    out = _import(case, tmp_path / "mt")
    reference = torch.load(DATA / case / "reference.pt")
    torch.testing.assert_close(_logits(out, reference["tokens"]), reference["logits"], atol=1e-5, rtol=1e-5)
    meta = read_meta(out)
    assert (meta["iteration"], meta["consumed_samples"]) == (7, 112)  # Megatron's iteration and consumed samples


def test_attention_is_not_uniform_so_a_rope_mistake_shows(tmp_path):
    """The weights' spread makes attention depend on positions: a wrong RoPE base moves the logits."""
    out = _import("llama_tp1_dist", tmp_path / "mt")
    reference = torch.load(DATA / "llama_tp1_dist" / "reference.pt")
    wrong = _logits(out, reference["tokens"], rotary_base=500)
    assert (wrong - reference["logits"]).abs().max() > 1e-2


def _dist_tensors(directory: Path) -> dict[str, torch.Tensor]:
    ckpt = open_megatron(directory)
    return {key: ckpt.read(key) for key in ckpt.shapes}


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("_dist")])
def test_round_trip_megatron_meshtron_megatron_is_exact(case, tmp_path):
    out = _import(case, tmp_path / "mt")
    assert cli_main(["convert", "megatron-export", "--load", str(out), "--save", str(tmp_path / "mg")]) == 0
    original, exported = _dist_tensors(DATA / case), _dist_tensors(tmp_path / "mg")
    assert original.keys() == exported.keys()
    for key, tensor in original.items():
        assert torch.equal(tensor, exported[key]), key
    common = open_megatron(tmp_path / "mg").common
    assert common["iteration"] == 7 and common["args"].fields()["consumed_train_samples"] == 112
    assert common["args"].fields()["num_layers"] == open_megatron(DATA / case).common["args"].fields()["num_layers"]


def test_legacy_export_reimports_to_megatrons_logits(tmp_path):
    """A legacy (tp2 x pp2) checkpoint, exported as torch_dist, imports again to the same logits."""
    out = _import("llama_tp2pp2_torch", tmp_path / "mt")
    assert cli_main(["convert", "megatron-export", "--load", str(out), "--save", str(tmp_path / "mg")]) == 0
    again = _import_dir(tmp_path / "mg", tmp_path / "mt2")
    reference = torch.load(DATA / "llama_tp2pp2_torch" / "reference.pt")
    torch.testing.assert_close(_logits(again, reference["tokens"]), reference["logits"], atol=1e-5, rtol=1e-5)


def _import_dir(load: Path, out: Path) -> Path:
    assert cli_main(["convert", "megatron-import", "--load", str(load), "--save", str(out)]) == 0
    return out


# -- bad input ------------------------------------------------------------------------------------


def _copy(case: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / case, tmp_path / case))


def _expect_error(capsys, load: Path, *needles: str) -> None:
    assert cli_main(["convert", "megatron-import", "--load", str(load), "--save", str(load.parent / "out")]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err


def test_truncated_distcp_is_named(tmp_path, capsys):
    root = _copy("llama_tp2_dist", tmp_path)
    data = root / "iter_0000007" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    _expect_error(capsys, root, f"{data} is truncated")


class _Payload:
    """Unpickled with plain pickle, it would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_payload_in_common_pt_never_runs(tmp_path, capsys):
    root = _copy("llama_tp1_dist", tmp_path)
    common = root / "iter_0000007" / "common.pt"  # read before the .distcp's common state, as Megatron does
    torch.save({"args": argparse.Namespace(num_layers=2, hook=_Payload(tmp_path / "ran")), "iteration": 7}, common)
    _expect_error(capsys, root, f"{common} references {os.system.__module__}.system", "nothing from the file was run")
    assert not (tmp_path / "ran").exists()


def test_payload_in_model_optim_rng_never_runs(tmp_path, capsys):
    root = _copy("llama_tp2pp2_torch", tmp_path)
    path = root / "iter_0000007" / "mp_rank_00_000" / "model_optim_rng.pt"
    torch.save({"model": {}, "args": _Payload(tmp_path / "ran")}, path)
    _expect_error(capsys, root, f"{path} references {os.system.__module__}.system")
    assert not (tmp_path / "ran").exists()


def test_an_unknown_args_value_is_refused_by_name(tmp_path, capsys):
    root = _copy("llama_tp1_dist", tmp_path)
    fields = {k: v for k, v in open_megatron(root).common["args"].fields().items() if isinstance(v, (int, float, str, bool, type(None)))}
    fields["normalization"] = "ScaleNorm"
    torch.save({"args": argparse.Namespace(**fields), "iteration": 7}, root / "iter_0000007" / "common.pt")
    _expect_error(capsys, root, "args.normalization = 'ScaleNorm' is not supported", "'LayerNorm', 'RMSNorm'")


def test_a_missing_pipeline_rank_is_named(tmp_path, capsys):
    root = _copy("llama_tp2pp2_torch", tmp_path)
    missing = root / "iter_0000007" / "mp_rank_01_001"
    shutil.rmtree(missing)
    _expect_error(capsys, root, f"{missing / 'model_optim_rng.pt'} is missing", "pipeline rank 1")


def test_dcp_index_with_a_payload_is_refused(tmp_path, capsys):
    root = _copy("llama_tp1_dist", tmp_path)
    index = root / "iter_0000007" / ".metadata"
    index.write_bytes(pickle.dumps(_Payload(tmp_path / "ran")))
    _expect_error(capsys, root, f"{index} references {os.system.__module__}.system")
    assert not (tmp_path / "ran").exists()


def test_a_megatron_dir_given_to_load_names_the_import_command(tmp_path):
    with pytest.raises(CheckpointError, match="is a Megatron-LM checkpoint.*meshtron convert megatron-import --load"):
        read_meta(DATA / "llama_tp2pp2_torch")


def test_norm_gains_stored_centred_on_zero_are_imported_as_they_apply(tmp_path):
    """A run with --apply-layernorm-1p stores each norm gain less 1: the same tensors read as such
    import to gains 1 higher, every other tensor unchanged."""
    plain = load_checkpoint_state(_import("llama_tp1_dist", tmp_path / "plain"))
    root = _copy("llama_tp1_dist", tmp_path)
    common = open_megatron(root).common
    fields = {k: v for k, v in common["args"].fields().items() if isinstance(v, (int, float, str, bool, type(None)))}
    torch.save({**common, "args": argparse.Namespace(**fields, apply_layernorm_1p=True)}, root / "iter_0000007" / "common.pt")
    centred = load_checkpoint_state(_import_dir(root, tmp_path / "centred"))
    gains = [name for name in plain if "norm" in name and name.endswith("weight")]
    assert len(gains) == 2 * 2 + 1  # two blocks' two norms and the final one
    for name, tensor in plain.items():
        torch.testing.assert_close(centred[name], tensor + 1 if name in gains else tensor, rtol=0, atol=0)


def load_checkpoint_state(save_dir: Path) -> dict[str, torch.Tensor]:
    meta = read_meta(save_dir)
    cfg = Config.from_dict(meta["config"])
    model = build_model(cfg.model, meta["vocab_size"], cfg.data.seq_length)
    load_checkpoint(save_dir, model, load_rng=False, log=lambda _: None)
    return {name: p.detach().clone() for name, p in model.named_parameters()}
