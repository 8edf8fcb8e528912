"""Which GPU a process runs on, in the terms the dispatch decisions need.

The one module that reads torch's platform facts (a HIP or CUDA build, the device's properties):
every choice that differs between NVIDIA and AMD GPUs (FP8 formats, attention kernels, the
grouped GEMM, symmetric memory, autotune tiles) asks here, so a test can simulate a platform by
patching ``torch.version.hip`` and ``torch.cuda.get_device_properties`` and see every decision
follow. Nothing is cached: the properties are cached by torch, and the answers are cheap.

ROCm tensors are ``cuda`` tensors and ``get_device_capability()`` answers (9, 4) on an MI300X,
so HIP is tested before any capability meant for NVIDIA (see /work/shared/research/rocm.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KIB = 1024


class Target(NamedTuple):
    """A compile target of Triton: its backend and architecture, warp (wavefront) width, and the
    shared memory (LDS on AMD) one program may use."""

    backend: str  # "cuda" or "hip"
    arch: int | str  # 90, or "gfx942"
    warp_size: int
    shared_bytes: int
    tiles: str  # the autotune tile family (``triton_grouped_gemm``)


# The targets meshtron's kernels are compiled for in CI, by architecture name (``arch``).
TARGETS = {
    "sm90": Target("cuda", 90, 32, 227 * KIB, "nvidia"),  # H100, H200
    "gfx942": Target("hip", "gfx942", 64, 64 * KIB, "cdna"),  # MI300X, MI325X
    "gfx90a": Target("hip", "gfx90a", 64, 64 * KIB, "cdna"),  # MI250X
    "gfx950": Target("hip", "gfx950", 64, 160 * KIB, "cdna4"),  # MI350X, MI355X
}

# FP8 on AMD: the fnuz formats on gfx942 (hipBLASLt and _scaled_mm's rowwise kernels take only
# those there), the OCP formats from gfx950 on; PyTorch refuses _scaled_mm elsewhere (gfx90a).
FNUZ_FP8_ARCHS = ("gfx942",)
OCP_FP8_AMD_ARCHS = ("gfx950", "gfx1200", "gfx1201")
# Where ROCm serves torch._grouped_mm (with CK) and symmetric memory without a fallback.
ROCM_GROUPED_MM_ARCHS = ("gfx942", "gfx950")
ROCM_SYMMETRIC_MEMORY_ARCHS = ("gfx942", "gfx950")


def is_rocm() -> bool:
    return torch.version.hip is not None


def _gpu(device: torch.device | str | int | None) -> torch.device | None:
    """``device`` if it is a GPU; for None (or a meta / CPU device) the current GPU when there is one."""
    if device is not None:
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type == "cuda":
            return device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def arch(device: torch.device | str | int | None = None) -> str:
    """``gfx942`` (the AMD architecture, without feature flags such as ``:sramecc+``), ``sm90``
    (NVIDIA's compute capability) or ``cpu``, for ``device`` or the current GPU."""
    gpu = _gpu(device)
    if gpu is None:
        return "cpu"
    props = torch.cuda.get_device_properties(gpu)
    if is_rocm():
        return props.gcnArchName.split(":")[0]
    return f"sm{props.major}{props.minor}"


def device_name(device: torch.device | str | int | None = None) -> str:
    gpu = _gpu(device)
    return "CPU" if gpu is None else torch.cuda.get_device_properties(gpu).name


def target(device: torch.device | str | int | None = None) -> Target | None:
    """The compile target of ``device``: a listed one, else one built from the device (an NVIDIA
    card other than Hopper gets NVIDIA's tiles; its shared memory is Triton's to check). None on a CPU."""
    name = arch(device)
    if name in TARGETS or name == "cpu":
        return TARGETS.get(name)
    props = torch.cuda.get_device_properties(_gpu(device))
    if is_rocm():  # CDNA and RDNA GPUs outside the list: 64 KiB of LDS, CDNA's tiles
        return Target("hip", name, 64, 64 * KIB, "cdna")
    shared = getattr(props, "shared_memory_per_block_optin", 0) or 48 * KIB
    return Target("cuda", props.major * 10 + props.minor, 32, shared, "nvidia")


def fp8_refusal(device: torch.device) -> str | None:
    """Why no FP8 GEMM runs on ``device`` (a message naming what to change), or None where it does."""
    if device.type != "cuda":
        return (f"--fp8-format needs a GPU with FP8 matrix cores (NVIDIA sm_89+ such as H100, AMD MI300X/MI325X "
                f"or MI350X); this run is on '{device.type}'. Drop --fp8-format to train in bf16/fp32.")  # fmt: skip
    name = arch(device)
    if is_rocm():
        if name in FNUZ_FP8_ARCHS or name in OCP_FP8_AMD_ARCHS:
            return None
        return (f"--fp8-format needs FP8 matrix cores, which {device_name(device)} ({name}) lacks: on AMD they start "
                f"with MI300 (gfx942; PyTorch's _scaled_mm refuses {name}). Drop --fp8-format to train in bf16.")  # fmt: skip
    props = torch.cuda.get_device_properties(device)
    if (props.major, props.minor) < (8, 9):
        return f"--fp8-format needs FP8 tensor cores (sm_89+); {props.name} ({name}) has none. Drop --fp8-format."
    return None


def blockwise_scaled_mm(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes 1 x 128 / 128 x 128 block scales on ``device``: cuBLAS's
    blockwise kernels are NVIDIA Hopper's (sm_90) from CUDA 12.9 on; never on ROCm (hipBLASLt)."""
    if is_rocm() or device.type != "cuda" or torch.version.cuda is None:
        return False
    major, minor = (int(v) for v in torch.version.cuda.split(".")[:2])
    return (major, minor) >= (12, 9) and torch.cuda.get_device_properties(device).major == 9


def fp8_fnuz(device: torch.device | str | int | None = None) -> bool:
    """Whether FP8 on ``device`` (or the current GPU) uses the fnuz formats (gfx942) rather than
    the OCP ones (NVIDIA, gfx950, and the CPU reference)."""
    return is_rocm() and arch(device) in FNUZ_FP8_ARCHS


def cudnn_attention() -> bool:
    """Whether PyTorch's cuDNN attention exists: never on ROCm, where its op always raises."""
    return not is_rocm()


def grouped_mm_may_be_fast(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` can be one kernel on ``device``: on NVIDIA wherever it runs;
    on ROCm only on gfx942/gfx950 (with CK; elsewhere a host-synced loop over the groups)."""
    return not is_rocm() or arch(device) in ROCM_GROUPED_MM_ARCHS


def symmetric_memory_arch(device: torch.device | None = None) -> bool:
    """Whether PyTorch's symmetric memory (async TP) supports this GPU: NVIDIA, or gfx942/gfx950."""
    return not is_rocm() or arch(device) in ROCM_SYMMETRIC_MEMORY_ARCHS
