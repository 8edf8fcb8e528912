"""Start ``meshtron train`` as N gloo ranks on this machine, one process each, as torchrun would
(its environment variables), so that a test can signal, stop or kill one rank by its pid."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.distributed.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]


class Ranks:
    """The processes of one run; each rank's output goes to ``{log_dir}/rank{r}.log``."""

    def __init__(self, args: list[str], world_size: int, log_dir: Path, start_gaps: float = 0.0, port: int | None = None, env: dict | None = None):
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        self.procs = []
        for rank in range(world_size):
            if rank and start_gaps:
                time.sleep(start_gaps)
            rank_env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                            OMP_NUM_THREADS="1", **(env or {}))  # fmt: skip
            out = open(self.log(rank), "w")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "meshtron", "train", *args], cwd=log_dir, env=rank_env,
                                               stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
            out.close()

    def log(self, rank: int) -> Path:
        return self.log_dir / f"rank{rank}.log"

    def output(self, rank: int = 0) -> str:
        return self.log(rank).read_text()

    def wait_for(self, text: str, rank: int = 0, timeout: float = 180.0) -> None:
        """Until ``text`` appears in the rank's output (fails if the rank exits or time runs out)."""
        deadline = time.monotonic() + timeout
        while text not in self.output(rank):
            if self.procs[rank].poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"rank {rank} never printed {text!r}:\n{self.output(rank)[-3000:]}")
            time.sleep(0.1)

    def wait(self, timeout: float = 120.0) -> list[int]:
        """Every rank's exit code (a killed rank's is minus the signal); kills the rest after ``timeout``."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        codes = [p.poll() for p in self.procs]
        self.kill()
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_ranks(args: list[str], world_size: int, log_dir: Path, timeout: float = 180.0) -> list[int]:
    """Run to the end; every rank's exit code."""
    return Ranks(args, world_size, log_dir).wait(timeout)
