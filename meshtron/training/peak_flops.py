"""The datasheet dense bf16 peak of each accelerator: the denominator of MFU as Megatron-LM and
torchtitan report it, so our MFU compares with theirs. The measured GEMM ceiling
(``metrics.MEASURED_BF16_CEILING_TFLOPS``) is the other denominator, what the chip really reaches.

Dense (no 2:4 sparsity) bf16 tensor throughput, TFLOP/s, from the vendors' datasheets: NVIDIA H100
SXM 989 (PCIe 756, NVL 835), H200 SXM 989, A100 312, L40S 362; AMD Instinct MI250X 383 per package, MI300X
1307, MI325X 1307, MI355X 2500. Matched as substrings of the device name in this order, the first
hit wins (``H100 PCIe`` before ``H100``). An MI250X shows as two devices, one per die, so
its entry is half the package's 383. Another device: set ``MESHTRON_PEAK_TFLOPS``.
"""

from __future__ import annotations

import os

DATASHEET_BF16_DENSE_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200", 989.0),  # SXM, and GH200's
    ("A100", 312.0),
    ("L40S", 362.0),
    ("MI250X", 191.5),  # per die: PyTorch sees each of the package's two dies as a device
    ("MI300X", 1307.0),
    ("MI325X", 1307.0),
    ("MI355X", 2500.0),
)
PEAK_ENV = "MESHTRON_PEAK_TFLOPS"


def datasheet_peak_tflops(device_name: str) -> tuple[float | None, str]:
    """The dense bf16 peak of ``device_name`` (``torch.cuda.get_device_name``) and where it came
    from: ``MESHTRON_PEAK_TFLOPS`` when set (a clear error if it is no positive number), else the
    table; None for a device the table lacks."""
    override = os.environ.get(PEAK_ENV)
    if override:
        try:
            value = float(override)
        except ValueError:
            value = 0.0
        if not value > 0:
            raise ValueError(f"{PEAK_ENV} must be a positive number of TFLOP/s, got {override!r}")
        return value, PEAK_ENV
    for key, value in DATASHEET_BF16_DENSE_TFLOPS:
        if key in device_name:
            return value, f"datasheet dense bf16 peak of {key}"
    return None, f"unknown for {device_name or 'this device'} (set {PEAK_ENV})"
