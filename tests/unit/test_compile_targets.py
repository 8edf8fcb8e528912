"""The ahead-of-time compile check (``meshtron.kernels.compile_check``): every Triton kernel the
library launches, in every configuration its launchers use, compiles for H100 (sm90), MI300X
(gfx942), MI250X (gfx90a) and MI355X (gfx950) within the target's shared memory (LDS), on this
CPU-only machine.

It runs in a child process without ``TRITON_INTERPRET`` (which this suite sets, and under which
kernels cannot be compiled). Launches found in ``tests/data/triton_aot_record.json`` (what they
needed when they last compiled, keyed by Triton version, target, kernel source and specialization)
are not compiled again, so a clean CI clone compiles only kernels changed since the record was
written: refresh it with ``python -m meshtron.kernels.compile_check --record
tests/data/triton_aot_record.json --update-record`` after changing a kernel. Compiled kernels also
go to ``MESHTRON_TRITON_AOT_CACHE`` (default ``~/.cache/meshtron/triton-aot``). Cold, with no record
and no cache: about 2 min per target on 2 shared cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "tests" / "data" / "triton_aot_record.json"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cache = os.environ.get("MESHTRON_TRITON_AOT_CACHE", str(Path.home() / ".cache" / "meshtron" / "triton-aot"))
    env.update(TRITON_CACHE_DIR=cache, PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _child(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=_env(), capture_output=True, text=True, timeout=1500)


def test_every_kernel_compiles_for_every_target():
    """Two children, two targets each: compiling is single-threaded, and CI has two cores."""
    halves = ["sm90,gfx90a", "gfx942,gfx950"]
    procs = [subprocess.Popen([sys.executable, "-m", "meshtron.kernels.compile_check", "--targets", targets, "--record", str(RECORD)], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for targets in halves]  # fmt: skip
    outputs = [proc.communicate(timeout=1500)[0] for proc in procs]
    stdout = "\n".join(outputs)
    print(stdout)
    assert all(proc.returncode == 0 for proc in procs), stdout[-8000:]
    run = subprocess.CompletedProcess([], 0, stdout, "")
    for target, kernels in (("sm90", 35), ("gfx942", 34), ("gfx90a", 28), ("gfx950", 34)):
        # gfx90a: no FP8 kernels (FP8 is refused there); AMD: no TMA kernel (NVIDIA Hopper only)
        assert f"{target}: {kernels} kernels" in run.stdout, run.stdout


def test_the_check_fails_where_shared_memory_runs_out():
    """With gfx942's LDS shrunk to 8 KiB the check names the autotuned kernels no tile of which
    fits and the fixed kernels over the limit (from the cache the test above filled)."""
    script = ("import sys; from meshtron.kernels import platform as p, compile_check as c\n"
              "p.TARGETS['gfx942'] = p.TARGETS['gfx942']._replace(shared_bytes=8 * 1024)\n"
              f"_, failures = c.compile_for('gfx942', record=c.CompileRecord({str(RECORD)!r})); print('\\n'.join(failures))")  # fmt: skip
    run = _child("-c", script)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "triton_grouped_gemm._rows_kernel on gfx942: no tile fits 8 KiB" in run.stdout, run.stdout
    assert "fused_adamw._adamw_kernel on gfx942: 16 KiB of shared memory, over 8 KiB" in run.stdout, run.stdout
