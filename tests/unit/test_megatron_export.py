"""``meshtron convert megatron-export`` held to what Megatron-LM's own ``load_checkpoint`` takes.

Without Megatron: the export's structure against the files Megatron-LM itself wrote
(``tests/data/megatron``): the torch_dist ``_extra_state`` objects byte for byte, every legacy
``model_optim_rng.pt`` entry (tensors, ``_extra_state`` entries, layer numbers per stage) equal.
With Megatron-LM importable by ``MEGATRON_PYTHON`` (unset by default, and in CI: those tests
skip): Megatron loads the export strictly on the CPU
(``make_checkpoints.py --check-export``) and its logits of the fixed tokens equal meshtron's.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint.megatron_files import open_megatron
from meshtron.checkpoint.megatron_pickle import load_megatron_pickle
from meshtron.cli import main as cli_main
from tests.unit.test_megatron_convert import CASES, DATA, _import, _import_dir, _logits

MEGATRON_PYTHON = os.environ.get("MEGATRON_PYTHON", "")  # opt-in: these runs take minutes
LEGACY = {"llama_tp2pp2_torch": (2, 2, 1), "gpt_tp2_torch": (2, 1, 1), "moe_ep2_torch": (1, 1, 2), "mla_tp2_torch": (2, 1, 1)}


def _export(load: Path, out: Path, *flags: str) -> Path:
    assert cli_main(["convert", "megatron-export", "--load", str(load), "--save", str(out), *flags]) == 0
    return out


def _legacy_flags(layout: tuple[int, int, int]) -> list[str]:
    tp, pp, ep = map(str, layout)
    return ["--ckpt-format", "torch", "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp, "--expert-model-parallel-size", ep]


def _objects(root: Path) -> dict[str, bytes]:
    """The stored bytes of every ``_extra_state`` object of a torch_dist checkpoint."""
    ckpt = open_megatron(root)
    out = {}
    for index, info in ckpt.metadata.storage_data.items():
        if "._extra_state/" in index.fqn:
            with open(ckpt.directory / info.relative_path, "rb") as f:
                f.seek(info.offset)
                out[index.fqn] = f.read(info.length)
    return out


def _legacy_files(root: Path) -> dict[str, dict]:
    files = sorted((root / "iter_0000007").glob("mp_rank_*/model_optim_rng.pt"))
    return {path.parent.name: load_megatron_pickle(path, str(path)) for path in files}


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("_dist")])
def test_dist_export_writes_megatrons_extra_state_objects(case, tmp_path):
    mine = _objects(_export(_import(case, tmp_path / "mt"), tmp_path / "mg"))
    theirs = _objects(DATA / case)
    assert mine.keys() == theirs.keys()
    assert all(mine[key] == theirs[key] for key in mine)  # Megatron-Core's own bytes: torch.save([None])
    assert load_megatron_pickle(next(iter(mine.values())), "an _extra_state object") == [None]


@pytest.mark.parametrize("case", sorted(LEGACY))
def test_legacy_export_equals_megatrons_own_files(case, tmp_path):
    """Exported under the layout Megatron saved it with, every rank's file holds what Megatron's did."""
    out = _export(_import(case, tmp_path / "mt"), tmp_path / "mg", *_legacy_flags(LEGACY[case]))
    mine, theirs = _legacy_files(out), _legacy_files(DATA / case)
    assert mine.keys() == theirs.keys()
    for rank, megatron in theirs.items():
        exported = mine[rank]["model"]
        assert exported.keys() == megatron["model"].keys(), rank
        for key, value in megatron["model"].items():
            assert (value is None and exported[key] is None) or torch.equal(value, exported[key]), (rank, key)
        fields = mine[rank]["args"].fields()
        assert [fields[f"{k}_model_parallel_size"] for k in ("tensor", "pipeline", "expert")] == list(LEGACY[case])
        assert mine[rank]["iteration"] == megatron["iteration"] == 7


def test_transformer_engine_spec_names_import_back(tmp_path):
    """Under TE's spec an MoE layer keeps its pre-MLP norm apart (torch_dist), a dense layer's legacy
    state fuses both norms and lists the attention's ``core_attention._extra_state``; both read back
    to Megatron's logits."""
    moe = _import("moe_ep2_dist", tmp_path / "moe")
    dist = open_megatron(_export(moe, tmp_path / "moe_te", "--transformer-impl", "transformer_engine"))
    assert "decoder.layers.pre_mlp_layernorm.weight" in dist.shapes and "decoder.layers.mlp.linear_fc1.layer_norm_weight" not in dist.shapes
    dense = _import("llama_tp2pp2_torch", tmp_path / "dense")
    legacy = _export(dense, tmp_path / "dense_te", "--transformer-impl", "transformer_engine", *_legacy_flags((1, 2, 1)))
    first = _legacy_files(legacy)["mp_rank_00_000"]["model"]
    assert {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"} <= first.keys()
    assert first["decoder.layers.1.self_attention.core_attention._extra_state"] is None
    assert not any("input_layernorm" in key or "pre_mlp_layernorm" in key for key in first)
    for case, exported in (("moe_ep2_dist", tmp_path / "moe_te"), ("llama_tp2pp2_torch", legacy)):
        again = _import_dir(exported, tmp_path / f"{case}_again")
        reference = torch.load(DATA / case / "reference.pt")
        torch.testing.assert_close(_logits(again, reference["tokens"]), reference["logits"], atol=1e-5, rtol=1e-5)


def test_a_layout_that_does_not_divide_the_model_is_refused(tmp_path, capsys):
    mt = _import("llama_tp2pp2_torch", tmp_path / "mt")
    flags = _legacy_flags((1, 3, 2))
    assert cli_main(["convert", "megatron-export", "--load", str(mt), "--save", str(tmp_path / "mg"), *flags]) == 2
    err = capsys.readouterr().err
    assert "num_layers 4 is not divisible by --pipeline-model-parallel-size 3" in err and "needs an MoE model" in err
    with pytest.raises(SystemExit):  # torch_dist is written whole; a layout flag there is a mistake
        cli_main(["convert", "megatron-export", "--load", str(mt), "--save", str(tmp_path / "mg"), "--tensor-model-parallel-size", "2"])


# -- Megatron-LM's own loader ---------------------------------------------------------------------


@functools.cache
def _megatron_missing() -> str | None:
    """Why Megatron-LM cannot be run here, or None."""
    if not MEGATRON_PYTHON:
        return "set MEGATRON_PYTHON to a Python with Megatron-LM (see tests/data/megatron/make_checkpoints.py) to run it"
    if not Path(MEGATRON_PYTHON).is_file():
        return f"no Python with Megatron-LM at {MEGATRON_PYTHON} (set MEGATRON_PYTHON; see tests/data/megatron/make_checkpoints.py)"
    probe = subprocess.run([MEGATRON_PYTHON, "-c", "import megatron.training.checkpointing"], capture_output=True, text=True, timeout=600)
    return None if probe.returncode == 0 else f"{MEGATRON_PYTHON} cannot import megatron.training: {probe.stderr.strip()[-300:]}"


MEGATRON_LOADS = [
    ("llama_tp1_dist", (2, 1, 1)),  # torch_dist, resharded to tp 2 by Megatron
    ("moe_ep2_dist", (1, 1, 2)),
    ("gpt_tp2_torch", (2, 1, 1)),  # legacy: tied embeddings, biases, LayerNorm, learned positions
    ("mla_yarn_dist", (2, 1, 1)),  # latent attention with YaRN, resharded to tp 2
    ("mla_tp2_torch", (2, 1, 1)),  # legacy latent attention: the down-projections' rows split over tp
    pytest.param("llama_tp2pp2_torch", (2, 2, 1), marks=pytest.mark.slow),  # legacy, four processes
]


@pytest.mark.parametrize(("case", "layout"), MEGATRON_LOADS)
def test_megatron_loads_the_export_to_meshtrons_logits(case, layout, tmp_path):
    if reason := _megatron_missing():
        pytest.skip(reason)
    mt = _import(case, tmp_path / "mt")
    out = _export(mt, tmp_path / "mg", *(_legacy_flags(layout) if case.endswith("_torch") else []))
    script = DATA / "make_checkpoints.py"
    run = subprocess.run([MEGATRON_PYTHON, str(script), "--check-export", case, str(out), *map(str, layout)], capture_output=True,
                         text=True, timeout=1200, cwd=DATA.parents[2], env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    reference = torch.load(DATA / case / "reference.pt")
    megatron, meshtron = torch.load(out / "megatron_logits.pt"), _logits(mt, reference["tokens"])
    print(f"{run.stdout.strip().splitlines()[-1]}; from meshtron's by {(megatron - meshtron).abs().max():.3g}", file=sys.stderr)
    torch.testing.assert_close(megatron, meshtron, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(megatron, reference["logits"], atol=1e-5, rtol=1e-5)
