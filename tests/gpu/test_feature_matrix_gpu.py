"""The feature matrix (``feature_matrix.py``) on 1, 2 and 4 GPUs, as many as this machine has:
every row trains two steps and matches the plain one-GPU path, or is refused by validation before
anything is allocated. Prints the table; ``MESHTRON_MATRIX_TABLE=path`` also writes it there
(``benchmarks/RESULTS.md`` keeps the last one).

The one- and two-GPU launches run side by side where there are at least three GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("feature_matrix.py")


def _launch(world: int, gpus: list[int], out: Path, reference: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), str(SCRIPT), str(out),
           "--reference", str(reference)]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def table(rows: list[dict]) -> str:
    """One line per (GPUs, model, layout): rows ok, refused and failed, each named compactly
    (recompute/fusion/fp8/compile)."""
    def name(r: dict) -> str:
        return "/".join([r["recompute"], "gaf" if r["fusion"] else "nogaf"] + (["fp8"] if r["fp8"] else []) + (["compile"] if r["compile"] else []))

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["gpus"], r["model"], r["layout"]), []).append(r)
    lines = ["| GPUs | model | layout | ok | refused | failed |", "| ---: | --- | --- | ---: | --- | --- |"]
    for (gpus, model, layout), rs in groups.items():
        ok = sum(r["status"] == "ok" for r in rs)
        refused = ", ".join(f"{name(r)} ({r['note'][:80]})" for r in rs if r["status"] == "refused")
        failed = ", ".join(name(r) for r in rs if r["status"] == "FAIL")
        lines.append(f"| {gpus} | {model} | {layout} | {ok}/{len(rs)} | {refused} | {failed} |")
    return "\n".join(lines)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_feature_matrix(tmp_path):
    count = torch.cuda.device_count()
    reference = tmp_path / "reference.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "0"}
    subprocess.run([sys.executable, str(SCRIPT), str(reference), "--write-reference"], cwd=ROOT, env=env, check=True, timeout=600)
    refs = json.loads(reference.read_text())
    assert all(r["status"] == "ran" for r in refs.values()), refs
    waves = [[(1, [0]), (2, [1, 2])]] if count >= 3 else [[(1, [0])], [(2, [0, 1])]] if count == 2 else [[(1, [0])]]
    if count >= 4:
        waves.append([(4, [0, 1, 2, 3])])
    rows, logs = [], []
    for wave in waves:
        procs = [(world, _launch(world, gpus, tmp_path / f"rows{world}.json", reference)) for world, gpus in wave]
        for world, proc in procs:
            log, _ = proc.communicate(timeout=3000)
            logs.append(log)
            assert proc.returncode == 0, f"{world} GPUs: exit {proc.returncode}\n{log[-6000:]}"
            rows += json.loads((tmp_path / f"rows{world}.json").read_text())
    text = table(rows)
    print("\n".join(logs), "\n", text)
    if os.environ.get("MESHTRON_MATRIX_TABLE"):
        Path(os.environ["MESHTRON_MATRIX_TABLE"]).write_text(text + "\n\n" + "\n".join(logs))
    failed = [r for r in rows if r["status"] == "FAIL"]
    assert not failed, "\n".join(f"{r['gpus']} {r['model']} {r['layout']} {r['recompute']} fusion={r['fusion']} fp8={r['fp8']} "
                                 f"compile={r['compile']}: {r['note']}" for r in failed)  # fmt: skip
