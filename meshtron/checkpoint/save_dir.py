"""The save directory of a run (``--save``): checked before training, held by one run at a time,
never written over by surprise, and a failed write named in one line.

- Usable: not a file, writable, and with room for one more checkpoint by the size of this run's
  state; otherwise the run is refused before its first step, not after its last.
- Held: rank 0 writes a lock file naming its host, pid and job. A second run is refused up front
  and told who holds the directory. The holder's own restart (the same SLURM job or torchrun run
  id, or a dead pid on the same host) takes the lock over, so a requeued job resumes unattended.
- Not written over: a run that did not resume from ``--save`` but would write iterations the
  directory already holds (a fresh run, ``--finetune``, ``--ckpt-step`` back in time) is refused
  unless ``--allow-existing-checkpoints`` says so: it would replace those checkpoints and move
  the tracker back.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from meshtron.checkpoint.integrity import MARKER

LOCK = "meshtron.lock"


def save_dir_problem(save: str) -> str | None:
    """Why ``--save`` cannot be written (a file on its path, no write permission), from the path alone."""
    path = Path(save)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"--save {save}: {existing} is a file, not a directory; name a directory for the checkpoints"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--save {save}: {existing} is not writable by this user; name a directory you can write"
    return None


def probe_writable(root: Path) -> str | None:
    """Create ``root`` and a file in it (what a permission check cannot tell: a read-only mount)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as exc:
        return f"--save {root} cannot be written: {exc.strerror or exc}"
    return None


def space_problem(root: Path, checkpoint_bytes: int) -> str | None:
    """No room for one checkpoint of ``checkpoint_bytes`` (this run's state over all ranks)."""
    free = shutil.disk_usage(root).free
    if free >= checkpoint_bytes:
        return None
    return (f"--save {root} has {_size(free)} free but one checkpoint of this run takes about "
            f"{_size(checkpoint_bytes)}; free space there or name another directory")  # fmt: skip


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def list_iterations(root: str | os.PathLike) -> list[int]:
    """The ``iter_*`` directories of ``root`` (renamed into place only once complete), ascending."""
    root = Path(root)
    found = [p.name.removeprefix("iter_") for p in root.glob("iter_*") if p.is_dir()] if root.is_dir() else []
    return sorted(int(n) for n in found if n.isdigit())


def complete_iterations(root: Path) -> list[int]:
    return [i for i in list_iterations(root) if (root / f"iter_{i:07d}" / MARKER).is_file()]


def overwrite_problem(root: Path, start_iteration: int, resumed_here: bool) -> str | None:
    """The checkpoints of ``root`` that this run would replace or outdate: those at or after
    the iteration it starts from, other than the one it resumed from."""
    clashing = [i for i in list_iterations(root) if i > start_iteration or (i == start_iteration and not resumed_here)]
    if not clashing:
        return None
    how = f"starts at iteration {start_iteration}" if start_iteration else "starts from iteration 0"
    return (f"--save {root} holds checkpoints of iterations {', '.join(map(str, clashing))} and this run {how}: "
            f"it would replace them and move the tracker back. Resume with "
            f"--load {root}, save to another directory, or pass --allow-existing-checkpoints to write there anyway")  # fmt: skip


def claim_save_dir(lock: SaveLock, start_iteration: int, resumed_here: bool, allow_existing: bool,
                   checkpoint_bytes: int) -> tuple[str | None, str | None]:  # fmt: skip
    """Rank 0, before training: (why the run may not write its save directory, a note for the
    log). On a problem the caller releases the lock."""
    root = lock.path.parent
    problem = probe_writable(root)
    if problem:
        return problem, None
    problem, note = lock.acquire()
    if problem is None and not allow_existing:
        problem = overwrite_problem(root, start_iteration, resumed_here)
    return problem or space_problem(root, checkpoint_bytes), note


def _holder() -> dict[str, object]:
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": "" if job == "none" else job,
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip


def _describe(holder: dict) -> str:
    job = f", job {holder['job']}" if holder.get("job") else ""
    return f"host {holder.get('host', '?')} pid {holder.get('pid', '?')}{job}, since {holder.get('since', '?')}"


def _pid_gone(pid: object) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, TypeError):
        return False
    return False


class SaveLock:
    """The lock file of one save directory, held by rank 0 from start-up to the end of the run."""

    def __init__(self, root: Path):
        self.path = root / LOCK
        self.me = _holder()
        self.held = False

    def acquire(self) -> tuple[str | None, str | None]:
        """(a problem that refuses the run, a note of a lock taken over)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        note = None
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                other = json.loads(self.path.read_text())
            except (OSError, ValueError):
                other = {}
            here = other.get("host") == self.me["host"]
            mine = (self.me["job"] and other.get("job") == self.me["job"]) or (here and other.get("pid") == self.me["pid"])
            gone = here and _pid_gone(other.get("pid"))
            if not (mine or gone):
                return (f"--save {self.path.parent} is being written by another run ({_describe(other)}; lock file {self.path}). "
                        f"Save to another directory, wait for that run to end, or delete {self.path} if it is gone"), None  # fmt: skip
            note = f"took over the lock of {self.path.parent} from {'this job' if mine else 'an ended run'} ({_describe(other)})"
            fd = os.open(self.path, os.O_WRONLY | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            json.dump(self.me, f)
        self.held = True
        return None, note

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if not self.held:
            return
        self.held = False
        try:
            if json.loads(self.path.read_text()) == self.me:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def failure_line(exc: BaseException, root: Path) -> str:
    """One line for a failed write: the operating system's reason where one is in the chain
    (DCP wraps it; torch.save's zip writer drops it after a short write, so a full disk is
    recognized by its free space), and how much room the disk has left."""
    try:
        free: int | None = shutil.disk_usage(root).free
    except OSError:
        free = None
    cause = _os_error(exc)
    if cause is not None:
        reason = f"{cause.strerror or cause}" + (f" ({cause.filename})" if cause.filename else "")
    elif "unexpected pos" in str(exc):
        full = free is not None and free < 2**20
        reason = "No space left on device (a write stopped short)" if full else "a write stopped short (an I/O error)"
    else:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return reason + (f"; {_size(free)} free on its disk" if free is not None else "")


def _os_error(exc: BaseException | None, seen: set | None = None) -> OSError | None:
    """The first OSError in ``exc``'s causes, contexts and (DCP's CheckpointException) per-rank failures."""
    seen = seen if seen is not None else set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and (exc.errno or exc.strerror):
            return exc
        for inner, *_ in getattr(exc, "failures", {}).values():
            found = _os_error(inner, seen)
            if found is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None
