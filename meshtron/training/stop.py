"""When to stop, decided by every rank together.

Saving is collective, so every rank must stop at the same iteration: a rank that stops alone
leaves the others waiting in a collective until the timeout, and the exit checkpoint is lost.
Reasons that only one rank may see (a signal, its own wall clock for ``--exit-duration-in-mins``)
are OR-ed over all ranks by one all-reduce of a few bytes per step. It is started after step k
and read after step k+1 (its result has long arrived by then), so it never waits on the device
or the network: every rank stops after step k+1 when any rank saw a reason by the end of step k.
``--exit-interval`` and ``--train-iters`` are the same number on every rank, and the divergence
verdict is taken from the step's all-reduced loss and global gradient norm, so they agree
without a collective of their own.

Signals: the exit signal (``--exit-signal``, SIGTERM by default, as SLURM and Kubernetes send
before a kill) and SIGINT (Ctrl-C) ask for a save and a stop; after the first SIGINT the default
action is restored, so a second Ctrl-C aborts at once without saving, even inside a collective.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from meshtron.config import TrainConfig

# Megatron's --exit-signal choices.
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
SIGNAL, DEADLINE = 1, 2  # the reasons, as bits
REASONS = {SIGNAL: "signal", DEADLINE: "wall-clock limit (--exit-duration-in-mins)"}


def stop_config_errors(t: TrainConfig) -> list[str]:
    """What is wrong with the fields that decide when a run stops: exits, timeouts, straggler reports."""
    errors = []
    if t.exit_signal not in EXIT_SIGNALS:
        errors.append(f"--exit-signal must be one of {', '.join(EXIT_SIGNALS)}, got '{t.exit_signal}'")
    for flag, value in (("--exit-duration-in-mins", t.exit_duration_in_mins), ("--exit-interval", t.exit_interval),
                        ("--train-timeout-minutes", t.train_timeout_minutes), ("--hang-step-factor", t.hang_step_factor)):  # fmt: skip
        if value < 0:
            errors.append(f"{flag} must be >= 0 (0: off), got {value}")
    if 0 < t.hang_step_factor < 2:
        errors.append(f"--hang-step-factor {t.hang_step_factor} would call ordinary step-time noise a hang; use 2 or more (0: off)")
    if t.straggler_minmax_count < 1:
        errors.append(f"--straggler-minmax-count must be >= 1, got {t.straggler_minmax_count}")
    return errors


class StopSignals:
    """Between ``install()`` and ``restore()`` (main thread only): the exit signal and SIGINT set
    ``received`` to the signal's name instead of killing the process."""

    def __init__(self, exit_signal: str, log: Callable[[str], None]):
        self.signums = {getattr(signal, exit_signal), signal.SIGINT}
        self.log = log
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.signums}
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C is not caught: it aborts at once
            self.log("SIGINT: saving and stopping at an iteration all ranks agree on (Ctrl-C again aborts at once, without saving)")
        elif self.received is None:
            self.log(f"{name}: saving and stopping at an iteration all ranks agree on")
        self.received = self.received or name


class StopAgreement:
    """The OR over ranks of each rank's stop reasons, one step late (see the module docstring)."""

    def __init__(self, world_size: int, device: torch.device, exit_duration_in_mins: float, start: float):
        self.world_size, self.device = world_size, device
        self.deadline = start + 60 * exit_duration_in_mins if exit_duration_in_mins > 0 else None
        self._pending: tuple[object, torch.Tensor, torch.cuda.Event | None] | None = None

    def local_reasons(self, signals: StopSignals) -> int:
        past_deadline = self.deadline is not None and time.monotonic() > self.deadline
        return (SIGNAL if signals.received else 0) | (DEADLINE if past_deadline else 0)

    def agree(self, reasons: int) -> int:
        """Called once per step by every rank: the reasons all ranks had one step ago (this step's
        own reasons on one process), and this step's sent on their way."""
        if self.world_size == 1:
            return reasons
        agreed = self._read()
        flags = torch.tensor([int(bool(reasons & bit)) for bit in REASONS], dtype=torch.int32, device=self.device)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)  # one flag per reason: MAX is OR
        self._pending = (work, flags, None)
        if self.device.type == "cuda":  # the copy to host waits on the GPU for the all-reduce, not on the host
            work.wait()
            host = torch.empty_like(flags, device="cpu").pin_memory()
            host.copy_(flags, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._pending = (None, host, done)
        return agreed

    def close(self) -> None:
        """Complete the last all-reduce (every rank calls this after its last step)."""
        self._read()

    def _read(self) -> int:
        if self._pending is None:
            return 0
        work, flags, done = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if done is not None:
            done.synchronize()
        return sum(bit for bit, flag in zip(REASONS, flags.tolist()) if flag)


def describe(reasons: int) -> str:
    return " and ".join(text for bit, text in REASONS.items() if reasons & bit)
