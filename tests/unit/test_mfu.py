"""MFU both ways: against the datasheet dense bf16 peak (what Megatron-LM and torchtitan report)
and against the measured GEMM ceiling, each named in the log line; devices are faked by their
name, as ``torch.cuda.get_device_name`` gives it."""

from __future__ import annotations

import pytest
import torch

from meshtron.training import metrics
from meshtron.training.metrics import IntervalMeter, format_log_line, mfu_bases

CUDA = torch.device("cuda")


@pytest.fixture
def device_named(monkeypatch):
    monkeypatch.delenv("MESHTRON_PEAK_TFLOPS", raising=False)
    return lambda name: monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


@pytest.mark.parametrize("name, peak, ceiling", [
    ("NVIDIA H100 80GB HBM3", 989.0, 762.0),
    ("NVIDIA H100 PCIe", 756.0, 762.0),  # its own peak, though the measured table knows only the SXM part
    ("NVIDIA H200", 989.0, 788.0),
    ("NVIDIA A100-SXM4-80GB", 312.0, None),
    ("NVIDIA L40S", 362.0, None),
    ("AMD Instinct MI250X/MI250", 191.5, None),  # per die, as PyTorch sees it
    ("AMD Instinct MI300X", 1307.0, None),
    ("AMD Instinct MI325X", 1307.0, None),
    ("AMD Instinct MI355X", 2500.0, None),
    ("NVIDIA GeForce RTX 4090", None, None),
])  # fmt: skip
def test_each_device_has_its_datasheet_peak(device_named, name, peak, ceiling):
    device_named(name)
    got_peak, got_ceiling = mfu_bases(CUDA)
    assert (got_peak.name, got_peak.tflops, got_ceiling.name) == ("peak", peak, "ceiling")
    if name.startswith(("NVIDIA H1", "NVIDIA H2")):  # the measured ceilings this project holds
        assert got_ceiling.tflops == metrics.MEASURED_BF16_CEILING_TFLOPS[name.split()[1]] == ceiling
    if peak is None:
        assert "MESHTRON_PEAK_TFLOPS" in got_peak.source


def test_the_environment_sets_the_peak_and_a_bad_value_is_an_error(device_named, monkeypatch):
    device_named("NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("MESHTRON_PEAK_TFLOPS", "1000")
    peak, ceiling = mfu_bases(CUDA)
    assert (peak.tflops, peak.source, ceiling.tflops) == (1000.0, "MESHTRON_PEAK_TFLOPS", 762.0)
    assert mfu_bases(torch.device("cpu"))[0].tflops == 1000.0  # a CPU run may name its own
    monkeypatch.setenv("MESHTRON_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="MESHTRON_PEAK_TFLOPS must be a positive number"):
        mfu_bases(CUDA)


def test_the_log_line_names_both(device_named, monkeypatch):
    device_named("NVIDIA H100 80GB HBM3")
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    meter = IntervalMeter(flops_per_token=1e9, bases=mfu_bases(CUDA), device=CUDA)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    meter.start_step()
    meter.end_step(tokens=500_000, skipped=False)  # 500 TFLOP/s in one second
    stats = meter.summary()
    assert stats["mfu_peak"] == pytest.approx(500 / 989) and stats["mfu_ceiling"] == pytest.approx(500 / 762)
    line = format_log_line(1, 10, 8, 1e-4, 2.0, 1.0, 1.0, stats)
    assert "MFU 50.6% of peak, 65.6% of ceiling" in line


def test_cpu_has_no_mfu(device_named):
    peak, ceiling = mfu_bases(torch.device("cpu"))
    assert peak.tflops is None and ceiling.tflops is None
    stats = IntervalMeter(1.0, (peak, ceiling), torch.device("cpu")).summary()
    assert not any(key.startswith("mfu") for key in stats) and "MFU" not in format_log_line(1, 1, 1, 0.0, 1.0, 1.0, 1.0, stats)
