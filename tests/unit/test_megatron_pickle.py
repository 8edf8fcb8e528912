"""Megatron's pickles read as plain values, and a payload in one never runs
(``meshtron/checkpoint/megatron_pickle.py``)."""

from __future__ import annotations

import argparse
import enum
import io
import os
import pickle
import zipfile

import numpy
import pytest
import torch

from meshtron.checkpoint.megatron_pickle import EnumValue, Namespace, UnsafePickle, load_megatron_pickle


class AttnBackend(enum.Enum):  # pickled under Megatron's module name below
    auto = 5


AttnBackend.__module__ = "megatron.core.transformer.enums"


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _with_enum(obj) -> bytes:
    """torch.save of ``obj`` with ``AttnBackend`` pickled as Megatron's class (not importable here)."""
    import sys
    import types

    names = ["megatron", "megatron.core", "megatron.core.transformer", "megatron.core.transformer.enums"]
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[names[-1]].AttnBackend = AttnBackend
    try:
        return _saved(obj)
    finally:
        for name in names:
            del sys.modules[name]


def test_plain_values_namespace_tensors_numpy_and_enums():
    weight = torch.randn(3, 4)
    args = argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16, attention_backend=AttnBackend.auto, sizes=[1, 2])
    rng = numpy.random.RandomState(3).get_state()
    loaded = load_megatron_pickle(_with_enum({"args": args, "model": {"w": weight, "view": weight[1]}, "np": rng, "version": 3.0}))
    assert isinstance(loaded["args"], Namespace)
    fields = loaded["args"].fields()
    assert fields["num_layers"] == 2 and fields["params_dtype"] is torch.bfloat16 and fields["sizes"] == [1, 2]
    assert fields["attention_backend"] == EnumValue("megatron.core.transformer.enums.AttnBackend", 5)
    assert torch.equal(loaded["model"]["w"], weight) and torch.equal(loaded["model"]["view"], weight[1])
    assert numpy.array_equal(loaded["np"][1], rng[1]) and loaded["version"] == 3.0


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED_BY_PICKLE",))


@pytest.mark.parametrize("where", ["top", "inside args"])
def test_a_payload_never_runs_and_is_named(tmp_path, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    obj = {"model": {}, "args": argparse.Namespace(evil=_Payload())} if where == "inside args" else {"x": _Payload()}
    path = tmp_path / "model_optim_rng.pt"
    path.write_bytes(_saved(obj))
    with pytest.raises(UnsafePickle, match=r"model_optim_rng\.pt references (posix|os)\.system"):
        load_megatron_pickle(path)
    assert not (tmp_path / "PWNED_BY_PICKLE").exists()


def test_a_payload_hidden_as_an_allowed_enum_module_is_only_a_value(tmp_path, monkeypatch):
    """An enum module admits names, not code: REDUCE on one builds an EnumValue, whatever it names."""
    monkeypatch.chdir(tmp_path)
    data = _saved({"x": 1})
    archive = zipfile.ZipFile(io.BytesIO(data))
    payload = b"\x80\x02csignal\nsystem\nX\x15\x00\x00\x00touch PWNED_BY_PICKLE\x85R."
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name in archive.namelist():
            z.writestr(name, payload if name.endswith("data.pkl") else archive.read(name))
    loaded = load_megatron_pickle(out.getvalue(), "common.pt")
    assert loaded == EnumValue("signal.system", "touch PWNED_BY_PICKLE")
    assert not (tmp_path / "PWNED_BY_PICKLE").exists()


def test_not_an_archive_or_truncated_is_named(tmp_path):
    path = tmp_path / "common.pt"
    path.write_bytes(_saved({"w": torch.ones(100)})[:200])
    with pytest.raises(ValueError, match="common.pt is not a torch.save archive"):
        load_megatron_pickle(path)
    path.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="common.pt is not a torch.save archive"):
        load_megatron_pickle(path)


class Marked(torch.Tensor):
    """A tensor subclass: not a plain value of a Megatron checkpoint."""


def test_a_tensor_with_attributes_comes_back_plain_and_a_subclass_is_refused(tmp_path):
    """Megatron's fp32 main params carry ``tensor_model_parallel`` etc.: torch pickles them through
    ``_rebuild_from_type_v2``; they load as plain tensors, attributes dropped. A tensor subclass
    (another type in the same call) is refused."""
    main = torch.arange(6.0).reshape(2, 3)
    main.tensor_model_parallel, main.partition_dim = True, 0
    torch.save({"fp32_from_fp16_params": [[main]]}, tmp_path / "a.pt")
    loaded = load_megatron_pickle(tmp_path / "a.pt")["fp32_from_fp16_params"][0][0]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, main) and not hasattr(loaded, "tensor_model_parallel")
    torch.save({"x": torch.ones(2).as_subclass(Marked)}, tmp_path / "b.pt")
    with pytest.raises(UnsafePickle, match="Marked"):
        load_megatron_pickle(tmp_path / "b.pt")
