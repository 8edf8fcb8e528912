"""Run a function on N gloo processes on the CPU and bring back what each returns.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes (forked from this one
where it has not touched CUDA, else fresh interpreters), gives each a
``torch.distributed`` gloo group over 127.0.0.1 (with torchrun's environment variables set, so code
that reads them sees a normal launch), calls ``fn(rank, world_size, *args)``, and returns the
per-rank results (anything ``torch.save`` can write) in rank order. A failure on any rank stops
the others and is raised here with that rank's traceback, instead of leaving a hung collective.

Each start still costs a second or more (the ranks build their models and gloo groups), so a test
should group its cases into one call. ``fn`` must be a module-level function (a spawned child
unpickles it).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))  # fmt: skip
    # Several processes share few cores: one thread each avoids oversubscription stalls.
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save(result, out / f"{rank}.pt")
        # Tear down together: a gloo rank whose peer has already closed its connections can abort
        # in its own teardown ("terminate called without an active exception").
        dist.barrier()
    except BaseException:
        (out / f"{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]``, each run in its own gloo process."""
    # Forked ranks inherit the imported torch and meshtron (seconds of CPU per rank on a small
    # machine); a process that has touched CUDA, or holds a process group, must spawn fresh ones.
    fork = not torch.cuda.is_initialized() and not dist.is_initialized()
    ctx = mp.get_context("fork" if fork else "spawn")
    with tempfile.TemporaryDirectory(prefix="meshtron-dist-") as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, out_dir, fn, args)) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs):
            failed = any(p.exitcode not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        errors = sorted(Path(out_dir).glob("*.err"))
        if errors:
            raise RuntimeError("\n".join(f"rank {e.stem} failed:\n{e.read_text()}" for e in errors))
        if any(p.exitcode != 0 for p in procs):
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"distributed run did not finish within {timeout:.0f} s or died (exit codes {codes})")
        return [torch.load(Path(out_dir) / f"{r}.pt", weights_only=False) for r in range(world_size)]


def by_name(rank_results: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """``run_distributed``'s per-rank ``{case name: result}`` dicts -> ``{case name: [result of rank 0, 1, ...]}``."""
    out: dict[str, list[Any]] = {}
    for rank_result in rank_results:
        for name, result in rank_result.items():
            out.setdefault(name, []).append(result)
    return out
