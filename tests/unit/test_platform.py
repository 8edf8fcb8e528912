"""Every dispatch decision that differs between NVIDIA and AMD, taken on the CPU with a GPU's
properties simulated (a HIP version, an AMD architecture name, NVIDIA's capability), so that a
regression to a CUDA-only default shows up without AMD hardware.

``meshtron.kernels.platform`` reads only ``torch.version.hip``, ``torch.cuda.is_available``,
``torch.cuda.current_device`` and ``torch.cuda.get_device_properties``; these are what is patched.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from meshtron.kernels import fp8, platform
from meshtron.kernels.fp8_scaling import Fp8Recipe, Fp8Scaling

# name, (major, minor) as ROCm reports them, compute units
AMD = {"gfx942": ("AMD Instinct MI300X", (9, 4), 304), "gfx90a": ("AMD Instinct MI250X/MI250", (9, 0), 110),
       "gfx950": ("AMD Instinct MI355X", (9, 5), 256)}  # fmt: skip
NVIDIA = {"sm90": ("NVIDIA H100 80GB HBM3", (9, 0), 132), "sm80": ("NVIDIA A100-SXM4-80GB", (8, 0), 108)}
GPU = torch.device("cuda", 0)


def simulate(monkeypatch, arch: str) -> None:
    """This process as one on a GPU of ``arch`` (``gfx942``, ``sm90``, ...) with that platform's PyTorch build."""
    amd = arch in AMD
    name, (major, minor), units = AMD[arch] if amd else NVIDIA[arch]
    props = SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=units,
                            gcnArchName=f"{arch}:sramecc+:xnack-" if amd else "NVIDIA",
                            shared_memory_per_block_optin=64 * 1024 if amd else 227 * 1024)  # fmt: skip
    monkeypatch.setattr(torch.version, "hip", "6.4.43482" if amd else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


@pytest.mark.parametrize("arch", [*AMD, *NVIDIA])
def test_architecture_and_target(monkeypatch, arch):
    simulate(monkeypatch, arch)
    assert platform.arch(GPU) == platform.arch() == arch
    assert platform.arch(torch.device("meta")) == arch  # a meta-device build asks about the GPU it will run on
    target = platform.target(GPU)
    if arch in AMD:
        assert (target.backend, target.arch, target.warp_size) == ("hip", arch, 64)
        assert target.shared_bytes == (160 if arch == "gfx950" else 64) * 1024
    else:
        assert (target.backend, target.warp_size) == ("cuda", 32) and target.tiles == "nvidia"


def test_cpu_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform.arch() == "cpu" and platform.target() is None and not platform.fp8_fnuz()
    assert "this run is on 'cpu'" in platform.fp8_refusal(torch.device("cpu"))


@pytest.mark.parametrize("arch, family", [("gfx942", "fnuz"), ("gfx950", "ocp"), ("sm90", "ocp")])
def test_fp8_family_per_platform(monkeypatch, arch, family):
    """MI300X's FP8 is fnuz (max 240 for e4m3), MI355X's and NVIDIA's OCP (448): the scaling state
    built for a layer on the meta device before it moves to the GPU takes the platform's."""
    simulate(monkeypatch, arch)
    fp8.check_fp8_device(GPU)  # accepted
    for device in ("cpu", "meta"):  # not the GPU itself: nothing can be allocated there
        scaling = Fp8Scaling(Fp8Recipe("hybrid", "delayed"), device=device)
        assert scaling.family == family
    e4m3, e5m2 = scaling.dtype("input"), scaling.dtype("grad")
    assert (e4m3, e5m2) == ((torch.float8_e4m3fnuz, torch.float8_e5m2fnuz) if family == "fnuz" else (torch.float8_e4m3fn, torch.float8_e5m2))
    assert torch.finfo(e4m3).max == (240.0 if family == "fnuz" else 448.0)
    assert Fp8Scaling(Fp8Recipe("hybrid", "rowwise")).dtype("grad") == e4m3  # rowwise: e4m3 throughout


@pytest.mark.parametrize("arch, says", [("gfx90a", "MI250X/MI250 (gfx90a) lacks"), ("sm80", "sm_89+")])
def test_fp8_refused_before_any_allocation_without_fp8_cores(monkeypatch, arch, says):
    simulate(monkeypatch, arch)
    with pytest.raises(ValueError, match=r"Drop --fp8-format") as refusal:
        fp8.check_fp8_device(GPU)
    assert says in str(refusal.value)
