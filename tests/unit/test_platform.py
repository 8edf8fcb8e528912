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


def _fake(shape, device="cuda", dtype=torch.bfloat16):
    """What a dispatch decision reads of a tensor, for a GPU this process does not have."""
    return SimpleNamespace(shape=shape, device=torch.device(device), dtype=dtype)


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a", "sm90"])
def test_attention_backends(monkeypatch, arch):
    """``auto`` attention: cuDNN first on NVIDIA, flash first on ROCm (no cuDNN there), where MLA's
    narrower values (192 / 128) are zero-padded for flash rather than left to the slow kernel."""
    from torch.nn.attention import SDPBackend

    from meshtron.layers.attention import auto_order, pads_values

    simulate(monkeypatch, arch)
    rocm = arch in AMD
    first = SDPBackend.FLASH_ATTENTION if rocm else SDPBackend.CUDNN_ATTENTION
    assert auto_order()[0] == first and (SDPBackend.CUDNN_ATTENTION in auto_order()) != rocm
    assert pads_values("auto", GPU, 192, 128) == rocm
    assert pads_values("flash", GPU, 192, 128) and not pads_values("flash", GPU, 128, 128)
    assert not pads_values("auto", torch.device("cpu"), 192, 128)


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a", "gfx950", "sm90"])
def test_context_parallel_block_kernel(monkeypatch, arch):
    """cp's ``auto`` block kernel: cuDNN on NVIDIA; flash on ROCm, whose cuDNN op always raises,
    with MLA's values padded."""
    from meshtron.parallel import cp_block_kernels as blocks

    simulate(monkeypatch, arch)
    rocm = arch in AMD
    assert blocks.auto_block_kernel() == ("flash" if rocm else "cudnn")
    q, v = _fake((2, 8, 64, 128)), _fake((2, 8, 64, 128))
    assert blocks.block_kernel("auto", q, v, None) is (blocks.FlashKernel if rocm else blocks.CudnnKernel)
    mla = blocks.block_kernel("auto", _fake((2, 8, 64, 192)), v, None)
    if rocm:
        assert isinstance(mla, blocks.PaddedValues) and mla.kernel is blocks.FlashKernel
    else:
        assert mla is blocks.CudnnKernel
    assert blocks.block_kernel("auto", _fake((2, 8, 64, 128), "cpu"), v, None) is None  # the math path off the GPU


@pytest.mark.parametrize("arch, syncs, expected", [("gfx90a", False, "triton"), ("gfx942", True, "triton"),
                                                   ("gfx942", False, "torch"), ("gfx950", False, "torch"), ("sm90", None, "torch")])  # fmt: skip
def test_grouped_gemm_auto(monkeypatch, arch, syncs, expected):
    """``auto`` grouped GEMM prefers the Triton kernel where ``torch._grouped_mm`` is ROCm's
    host-synced loop: always on gfx90a, on gfx942/gfx950 when the build's call syncs (no CK);
    on NVIDIA the sync probe is never run."""
    from meshtron.layers.moe import grouped_gemm

    simulate(monkeypatch, arch)

    def probe(device, dtype):
        assert syncs is not None, "the sync probe ran on NVIDIA"
        return syncs

    monkeypatch.setattr(grouped_gemm, "_grouped_mm_syncs", probe)
    assert grouped_gemm.auto_backend(GPU, torch.bfloat16, True, True) == expected
    assert grouped_gemm.auto_backend(GPU, torch.bfloat16, False, True) == "triton"
    assert grouped_gemm.auto_backend(GPU, torch.bfloat16, True, False) == "torch"  # nothing better there
    assert grouped_gemm.auto_backend(GPU, torch.bfloat16, False, False) == "loop"


@pytest.mark.parametrize("arch, usable", [("gfx942", True), ("gfx950", True), ("gfx90a", False), ("sm90", True)])
def test_symmetric_memory_overlap(monkeypatch, arch, usable):
    """Async-TP through symmetric memory where PyTorch supports it: NVIDIA, gfx942, gfx950."""
    import torch.distributed as dist

    from meshtron.parallel import tp_overlap

    simulate(monkeypatch, arch)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert tp_overlap.symmetric_memory_usable(None) == usable
    if not usable:
        with pytest.warns(UserWarning, match="gfx942/gfx950"):
            assert tp_overlap.resolve_backend("symm_mem", None) == "p2p"


@pytest.mark.parametrize("arch, peak, ceiling", [("gfx942", 1307.0, None), ("gfx90a", 191.5, None), ("sm90", 989.0, 762.0)])
def test_mfu_bases(monkeypatch, arch, peak, ceiling):
    """AMD Instinct names get their datasheet peak (an MI250X die's half of the package) and no
    measured ceiling yet, named so in the log."""
    from meshtron.training.metrics import mfu_bases

    simulate(monkeypatch, arch)
    monkeypatch.delenv("MESHTRON_PEAK_TFLOPS", raising=False)
    got_peak, got_ceiling = mfu_bases(GPU)
    assert (got_peak.tflops, got_ceiling.tflops) == (peak, ceiling)
    assert "datasheet" in got_peak.source and (ceiling or "not measured" in got_ceiling.source)


@pytest.mark.parametrize("arch, family", [("gfx942", "cdna"), ("gfx90a", "cdna"), ("gfx950", "cdna4"), ("sm90", "nvidia")])
def test_grouped_gemm_autotune_tiles(monkeypatch, arch, family):
    """The grouped GEMM's autotuners try the launching device's tile family (bf16: the family's
    tiles; fp32: the small ones everywhere), chosen at run time through their prune hook; AMD's
    tiles are MFMA-sized (multiples of 32) for wavefronts of 64."""
    pytest.importorskip("triton")
    from meshtron.kernels import triton_grouped_gemm as tgg

    simulate(monkeypatch, arch)
    assert platform.target(GPU).tiles == family
    operand = torch.empty(64, 64, device="meta", dtype=torch.bfloat16)  # stands for the GPU tensor the launch reads
    for kernel, tuned, first in (("rows", tgg._rows_tuned, "a_ptr"), ("weight_grad", tgg._weight_grad_tuned, "dy_ptr")):
        for ieee in (False, True):
            tried = tuned.early_config_prune(tuned.configs, {first: operand, "IEEE": ieee})
            wanted = tgg.tile_configs(kernel, family, ieee)
            assert tried and set(tried) == set(wanted) and len(tried) == len(wanted)
        if family != "nvidia":
            tiles = tgg.tile_configs(kernel, family, False)
            assert all(c.kwargs[b] % 32 == 0 for c in tiles for b in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
            assert all(c.num_warps in (4, 8) for c in tiles)
    assert tgg.tile_configs("rows", "nvidia", False) != tgg.tile_configs("rows", "cdna", False)


@pytest.mark.parametrize("arch, cuda, blockwise", [("sm90", "12.9", True), ("sm90", "13.0", True), ("sm90", "12.8", False),
                                                   ("sm80", "13.0", False), ("gfx942", None, False), ("gfx950", None, False)])  # fmt: skip
def test_blockwise_fp8_gemm_per_platform(monkeypatch, arch, cuda, blockwise):
    """cuBLAS's 1x128 / 128x128 block-scaled GEMM (``torch._scaled_mm``) only on NVIDIA Hopper from
    CUDA 12.9, for bf16 outputs, where its first GEMM agrees with the reference; elsewhere the
    blockwise recipe takes its Triton GEMM. The weight scales' layout is the same in every
    PyTorch release only where K / 128 is a multiple of 4."""
    from meshtron.kernels import fp8_blockwise

    simulate(monkeypatch, arch)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert platform.blockwise_scaled_mm(GPU) is blockwise
    assert not platform.blockwise_scaled_mm(torch.device("cpu"))
    a = torch.empty(256, 512, dtype=torch.float8_e4m3fn, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: GPU))
    for works in (True, False):
        monkeypatch.setattr(fp8_blockwise, "scaled_mm_takes_blocks", lambda device, dtype: works)  # noqa: B023
        cublas = blockwise and works
        assert fp8_blockwise.gemm_backend(a, torch.bfloat16, "auto") == ("scaled_mm" if cublas else "triton")
        assert fp8_blockwise.gemm_backend(a, torch.bfloat16, "off") == ("scaled_mm" if cublas else "reference")
        assert fp8_blockwise.gemm_backend(a[:, :384], torch.bfloat16, "auto") == "triton"  # K / 128 = 3
        assert fp8_blockwise.gemm_backend(a, torch.float32, "auto") == "triton"  # cuBLAS writes bf16 only
