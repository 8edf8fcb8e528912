"""A hung run, named: which ranks did not arrive, and where every live rank waits.

Without it a rank that stops (a frozen process, a dead node, a stuck data loader) leaves the
others blocked in a collective until its timeout, and the log says nothing about which one.
Here each rank runs a thread that publishes a heartbeat to the launch's key-value store (the
TCPStore at MASTER_ADDR:MASTER_PORT that torchrun or rank 0 serves) every ``poll`` seconds: a
counter that advances while the process lives, and the iteration and phase its training loop is
in. When the current phase has run longer than allowed (``--train-timeout-minutes``, or for a
step ``--hang-step-factor`` times the median of the recent steps), the thread waits two more
heartbeats, reads every rank's, and reports:

- ranks whose counter did not advance (stopped, frozen or dead): they did not arrive;
- live ranks behind the others (an earlier iteration): stuck before the collective;
- this rank's last collectives from PyTorch's flight recorder, dumped to a file
  (``flight_recorder.py``: which ones each process group waits in);
- then the stacks of this rank's threads, and the process exits with ``EXIT_HANG``.

Every live rank reports for itself, so the log has each one's stack. The process groups'
own timeout during training is set a minute longer, so the watchdog speaks first.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from typing import Callable

import torch.distributed as dist

from meshtron.training import flight_recorder

EXIT_HANG = 4
RECENT_STEPS = 20  # the step times the median is taken over
MIN_STEPS = 5  # steps seen before --hang-step-factor applies (the first ones compile and warm up)


class Watchdog:
    def __init__(self, limit_s: float, step_factor: float, rank: int, world_size: int, say: Callable[[str], None]):
        self.limit_s, self.step_factor, self.rank, self.world_size, self.say = limit_s, step_factor, rank, world_size, say
        self.poll = min(max(limit_s / 4, 0.2), 5.0)
        self.steps: deque[float] = deque(maxlen=RECENT_STEPS)
        self.iteration, self.phase, self.since = 0, "start", time.monotonic()
        self.beats = 0
        self.store = _store(self.poll) if world_size > 1 else None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def enter(self, phase: str, iteration: int) -> None:
        """The training loop begins ``phase`` ("step", "evaluation", "save") after ``iteration``."""
        now = time.monotonic()
        if self.phase == "step" and phase == "step":
            self.steps.append(now - self.since)
        self.iteration, self.phase, self.since = iteration, phase, now

    def allowed(self) -> tuple[float, str]:
        """How long the current phase may take, and why that long."""
        if self.phase == "step" and self.step_factor and len(self.steps) >= MIN_STEPS:
            median = statistics.median(self.steps)
            if self.step_factor * median < self.limit_s:
                return self.step_factor * median, f"--hang-step-factor {self.step_factor:g} x the median step of {median:.2f}s"
        return self.limit_s, f"--train-timeout-minutes {self.limit_s / 60:g}"

    def _run(self) -> None:
        first_look: tuple[dict[int, dict | None], float] | None = None
        while not self._stopped.wait(self.poll):
            self.beats += 1
            self._publish()
            limit, why = self.allowed()
            elapsed = time.monotonic() - self.since
            if elapsed <= limit:
                first_look = None
            elif first_look is None:
                first_look = (self._read_all(), time.monotonic())
            elif time.monotonic() - first_look[1] >= 2 * self.poll:
                self._report(elapsed, why, first_look[0], self._read_all())
                os._exit(EXIT_HANG)

    def _publish(self) -> None:
        if self.store is not None:
            self.store.set(f"watchdog/{self.rank}", json.dumps({"beats": self.beats, "iteration": self.iteration, "phase": self.phase}))

    def _read_all(self) -> dict[int, dict | None]:
        out: dict[int, dict | None] = {}
        for rank in range(self.world_size):
            key = f"watchdog/{rank}"
            try:
                out[rank] = json.loads(self.store.get(key)) if self.store is not None and self.store.check([key]) else None
            except Exception:  # the store itself does not answer (its host is the frozen one)
                out[rank] = None
        return out

    def _report(self, elapsed: float, why: str, before: dict[int, dict | None], after: dict[int, dict | None]) -> None:
        where = f"iteration {self.iteration + (self.phase == 'step')}'s {self.phase}" if self.phase != "start" else "start-up"
        lines = [f"hang: {where} has taken {elapsed:.0f}s, over the {why}"]
        if self.world_size > 1:
            silent = [r for r in range(self.world_size) if after[r] is None or (before[r] or {}).get("beats") == after[r]["beats"]]
            alive = {r: s for r, s in after.items() if r not in silent and s is not None}
            furthest = max((s["iteration"] for s in alive.values()), default=0)
            behind = [f"{r} (at iteration {s['iteration']}, {s['phase']})" for r, s in alive.items() if s["iteration"] < furthest]
            if silent:
                lines.append(f"ranks that did not arrive: {', '.join(map(str, silent))} (no heartbeat for {2 * self.poll:.0f}s: stopped, frozen or dead)")
            if behind:
                lines.append(f"ranks behind the others, alive: {', '.join(behind)}")
            if not silent and not behind:
                lines.append("every rank is alive at the same place: a collective or the device is stuck (see the stacks)")
        lines.append(f"this rank's threads follow; exiting with code {EXIT_HANG}")
        self.say("; ".join(lines))
        for line in flight_recorder.dump(self.rank) if self.world_size > 1 else []:
            self.say(line)
        sys.stdout.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()


def _store(timeout_s: float) -> dist.Store:
    """A client of the launch's store of its own, so its waits never hold the process group's."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=max(2 * timeout_s, 5)), wait_for_workers=False)  # fmt: skip


def set_training_timeout(minutes: float) -> bool:
    """Every process group's timeout from here on (start-up keeps --distributed-timeout-minutes);
    False where this PyTorch has no way to change it."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return False
    for group in list(dist.distributed_c10d._world.pg_map):
        setter(datetime.timedelta(minutes=minutes), group)
    return True
