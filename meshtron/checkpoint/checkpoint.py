"""Save and resume a run: Megatron's directory layout, tensors through torch.distributed.checkpoint.

Layout::

    {save}/latest_checkpointed_iteration.txt    the iteration of the newest complete checkpoint
    {save}/iter_0000100/.metadata               DCP's index of every global tensor's chunks
    {save}/iter_0000100/__{rank}_0.distcp       the chunks each rank wrote
    {save}/iter_0000100/meta.json               iteration, consumed samples, schedule, config, ...
    {save}/iter_0000100/rng_rank0.pt            RNG states of each rank (unless --no-save-rng)
    {save}/iter_0000100/complete.json           size and CRC-32 of every file above, written last

Sharded: each rank writes only the boxes of the global (one-process) tensors it owns, each
element once, optimizer state in parameter shape (``sharded.py``, ``boxes.py``); every rank reads
the boxes it holds under its own layout, so a checkpoint loads under any other layout. Each rank
writes its file on its own and rank 0 merges the ranks' indexes into DCP's ``.metadata``
(``dcp_io.py``), which lets ``--async-save`` write from a background thread with no collective
there: ``start_save`` returns after a copy to host and ``PendingSave.finish`` completes it.

Crash safety: a checkpoint is written into a temporary sibling directory, fsynced, and renamed
into place; the tracker is replaced (temp file + ``os.replace``) only after that. A crash at any
point leaves the previous tracker pointing at a complete checkpoint. Around the rename a
``tracker_pending.txt`` names the iteration being put in place: a crash after the rename and
before the tracker's write leaves it beside a complete checkpoint the tracker lags behind, which
the next load takes (a newer directory without it is a branch the run left, and the tracker
wins). The one window left is
re-saving an iteration that already exists: between moving the old directory aside and renaming
the new one in, the tracker's directory is briefly absent.

Trust on load: the marker (``integrity.py``) is checked before any tensor is read, DCP's pickled
index is read by a restricted unpickler (``safe_metadata.py``), and tensors of the checkpoint
that the run lacks are an error rather than silently dropped.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from meshtron.checkpoint.dcp_io import merge_indexes, read_boxes, write_rank_files
from meshtron.checkpoint.integrity import MARKER, describe_files, manifest, verify
from meshtron.checkpoint.rng import get_rng_state, set_rng_state
from meshtron.checkpoint.safe_metadata import UnsafeMetadata, read_metadata
from meshtron.checkpoint.save_dir import complete_iterations, failure_line, save_dir_problem
from meshtron.checkpoint.sharded import finish_load, load_state, save_state, state_bytes
from meshtron.checkpoint.staging import HostStaging
from meshtron.config import Config, CheckpointConfig
from meshtron.errors import CheckpointError
from meshtron.models.contract import ParamMeta
from meshtron.parallel.mesh import Mesh

TRACKER = "latest_checkpointed_iteration.txt"
PENDING = "tracker_pending.txt"  # the iteration moved into place before the tracker names it (module docstring)
META = "meta.json"
FORMAT_VERSION = 1
MEGATRON_IMPORT = "`meshtron convert megatron-import --load MEGATRON_DIR --save OUT`, then --load OUT"
# --dist-ckpt-strictness values we honor (Megatron's names): any mismatch is an error / the
# checkpoint's tensors this run lacks are logged and skipped.
STRICTNESS = ("raise_all", "log_all")
SAVE_FAILURE = ("continue", "stop")  # --save-failure: train on (the next save retries) or end the run


def checkpoint_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def latest_iteration(save_dir: str | os.PathLike) -> int | None:
    """The tracker's iteration, or None when no checkpoint was ever completed here."""
    tracker = Path(save_dir) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"tracker file {tracker} should hold an iteration number, found {text[:40]!r}") from None


def _pending_iteration(root: Path) -> int | None:
    """The iteration ``PENDING`` names, or None (no such file, or not a number)."""
    text = (root / PENDING).read_text().strip() if (root / PENDING).is_file() else ""
    return int(text) if text.isdigit() else None


def newest_iteration(save_dir: str | os.PathLike, log: Callable[[str], None] = print) -> int | None:
    """The tracker's iteration, or the complete one it lags behind (``PENDING``); without a
    readable tracker, the newest complete checkpoint (said in the log); None when there is
    neither (a fresh start)."""
    root = Path(save_dir)
    try:
        tracked = latest_iteration(root)
        problem = None if tracked is not None or not (root / TRACKER).exists() else "unreadable"
    except CheckpointError as exc:
        tracked, problem = None, str(exc)
    complete = complete_iterations(root)
    lagging = _pending_iteration(root)
    if lagging is not None and lagging in complete and (tracked is None or lagging > tracked):
        log(f"warning: the tracker says {tracked}, but {checkpoint_dir(root, lagging)} was complete and in place when the "
            "save was cut off before the tracker's update: loading it")  # fmt: skip
        return lagging
    if tracked is not None:
        return tracked
    if not complete:
        if problem:
            raise CheckpointError(f"{problem}, and {root} holds no complete checkpoint to fall back on")
        return None
    log(f"warning: {problem or f'no tracker {root / TRACKER}'}: loading the newest complete checkpoint, {checkpoint_dir(root, complete[-1])}")
    return complete[-1]


# -- save -----------------------------------------------------------------------------------------


def save_checkpoint(save_dir: str | os.PathLike, iteration: int, model: nn.Module, optimizer: Any, meta: dict[str, Any],
                    mesh: Mesh | None = None, save_optim: bool = True, metas: dict[str, ParamMeta] | None = None,
                    save_rng: bool = True) -> Path:  # fmt: skip
    """Write ``{save_dir}/iter_{iteration:07d}`` and point the tracker at it; returns the directory.
    Collective: every rank calls it. ``meta`` must be JSON-serializable."""
    return start_save(save_dir, iteration, model, optimizer, meta, mesh, save_optim, metas, save_rng).finish()


def start_save(save_dir: str | os.PathLike, iteration: int, model: nn.Module, optimizer: Any, meta: dict[str, Any],
               mesh: Mesh | None = None, save_optim: bool = True, metas: dict[str, ParamMeta] | None = None,
               save_rng: bool = True, in_background: bool = False, staging: HostStaging | None = None) -> "PendingSave":  # fmt: skip
    """Begin a checkpoint: each rank writes the boxes it owns (``sharded.py``) and its RNG state
    into a temporary sibling directory; ``finish()`` on the result completes it.

    ``in_background`` (``--async-save``): the boxes are copied to host memory (``staging.py``),
    then a thread writes them; its RNG state is taken now. With the run's own ``staging`` this
    returns once the copies are enqueued, and the caller must call ``staging.before_state_changes()``
    before the state next changes (the optimizer step); without, it returns once they are done.
    Collective (a barrier after the directory is made).
    """
    mesh = mesh or Mesh()
    root = Path(save_dir)
    final = checkpoint_dir(root, iteration)
    tmp = root / f"{final.name}.tmp"
    problem = None
    if mesh.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(f"{final.name}.tmp*"):  # left by a run killed mid-save
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as exc:
            problem = failure_line(exc, root)
    problem = _broadcast_from_first(mesh, problem)  # every rank learns it here, none waits in a barrier alone
    if problem:
        raise CheckpointError(f"saving iteration {iteration} to {root} failed: {problem}")
    state = save_state(model, optimizer, mesh, with_optimizer=save_optim, metas=metas)
    record = {"format_version": FORMAT_VERSION, "iteration": iteration, "has_optimizer": save_optim,
              "has_rng": save_rng, "world_size": mesh.world_size, "meta": meta}  # fmt: skip
    pending = PendingSave(root, iteration, tmp, record, mesh, state_bytes(state))
    if not in_background:
        pending.run(state, get_rng_state if save_rng else None)
        return pending
    own_staging = staging is None
    staged, copied = (staging or HostStaging()).stage(state)
    if own_staging:
        copied()  # nobody will order the next state change after the copies
    rng = get_rng_state() if save_rng else None
    pending.thread = threading.Thread(target=pending.run, args=(staged, (lambda: rng) if save_rng else None, copied),
                                      name=f"checkpoint-{iteration}", daemon=True)  # fmt: skip
    pending.thread.start()
    return pending


class PendingSave:
    """A checkpoint whose files this rank is writing (in ``thread`` when asynchronous).

    ``finish()`` (collective) waits for this rank's files, gathers every rank's index and file
    checksums on rank 0, which merges the indexes into DCP's ``.metadata``, writes ``meta.json``
    and the completion marker, renames the directory into place and then writes the tracker:
    only a checkpoint every rank completed is ever pointed at. A failure on any rank fails the
    save on every rank and leaves the previous checkpoint as it was.
    """

    def __init__(self, root: Path, iteration: int, tmp: Path, record: dict[str, Any], mesh: Mesh, staged_bytes: int) -> None:
        self.root, self.iteration, self.tmp, self.record, self.mesh = root, iteration, tmp, record, mesh
        self.staged_bytes = staged_bytes  # what this rank hands to DCP: its own boxes only
        self.thread: threading.Thread | None = None
        self._result: tuple[Any, dict[str, Any]] | None = None
        self._error: BaseException | None = None

    def run(self, state: dict[str, Any], rng: Callable[[], dict[str, Any]] | None, ready: Callable[[], None] = lambda: None) -> None:
        """This rank's files: its DCP data file, its RNG state, and their checksums (once ``ready``
        returns: the host copies of an asynchronous save have landed)."""
        try:
            ready()
            rank = self.mesh.rank
            index = write_rank_files(state, self.tmp, rank)
            written = sorted(self.tmp.glob(f"__{rank}_*.distcp"))
            if rng is not None:
                path = self.tmp / f"rng_rank{rank}.pt"
                torch.save(rng(), path)
                written.append(path)
            self._result = (index, describe_files(written))
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException
            self._error = exc

    def finish(self) -> Path:
        if self.thread is not None:
            self.thread.join()
        mine = None if self._error is not None else self._result
        failure = None if mine is not None else f"rank {self.mesh.rank}: {failure_line(self._error, self.root)}"
        parts = _gather_to_first(self.mesh, (mine, failure))
        own_error, outcome = self._error, None
        if self.mesh.rank == 0:
            failures = [f for _, f in parts if f]
            if not failures:
                try:
                    self._complete([p for p, _ in parts])
                except Exception as exc:
                    own_error = exc
                    failures = [f"rank 0: {failure_line(exc, self.root)}"]
            if failures:
                shutil.rmtree(self.tmp, ignore_errors=True)
            outcome = "; ".join(failures) or None
        outcome = _broadcast_from_first(self.mesh, outcome)
        if outcome:  # the same line on every rank
            raise CheckpointError(f"saving iteration {self.iteration} to {self.root} failed: {outcome}") from own_error
        return checkpoint_dir(self.root, self.iteration)

    def _complete(self, parts: list[tuple[Any, dict[str, Any]]]) -> None:
        """Rank 0, once every rank's files are written: the index, the record, the marker, the
        rename into place, then the tracker."""
        try:
            index = merge_indexes([p[0] for p in parts])
        except ValueError as exc:
            raise CheckpointError(f"the ranks' shards of iteration {self.iteration} do not fit together: {exc}") from None
        _write_durably(self.tmp / ".metadata", pickle.dumps(index))
        _write_durably(self.tmp / META, json.dumps(self.record, indent=1).encode())
        files = describe_files([self.tmp / ".metadata", self.tmp / META])
        for _, rank_files in parts:
            files.update(rank_files)
        _write_durably(self.tmp / MARKER, json.dumps(manifest(self.iteration, files), indent=1).encode())
        _fsync_tree(self.tmp)
        final = checkpoint_dir(self.root, self.iteration)
        _write_durably(self.root / PENDING, f"{self.iteration}\n".encode())
        _move_into_place(self.tmp, final)
        _write_durably(self.root / TRACKER, f"{self.iteration}\n".encode())
        (self.root / PENDING).unlink()
        _fsync_dir(self.root)


def _gather_to_first(mesh: Mesh, item: Any) -> list[Any]:
    if mesh.world_size == 1:
        return [item]
    parts: list[Any] = [None] * mesh.world_size if mesh.rank == 0 else None
    torch.distributed.gather_object(item, parts, dst=0)
    return parts


def _broadcast_from_first(mesh: Mesh, item: Any) -> Any:
    if mesh.world_size == 1:
        return item
    box = [item]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _verify_together(directory: Path, mesh: Mesh) -> str | None:
    """``verify`` with the checksum reading split over the ranks; every rank gets the first problem."""
    problem = verify(directory, mesh.rank, mesh.world_size)
    if mesh.world_size == 1:
        return problem
    problems: list[Any] = [None] * mesh.world_size
    torch.distributed.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def _write_durably(path: Path, data: bytes) -> None:
    """Write via a temp file, fsync, ``os.replace``: readers see the old file or the new one."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` is moved aside first and removed after."""
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- load -----------------------------------------------------------------------------------------


def load_checkpoint(
    load_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: Any = None,
    iteration: int | None = None,
    load_rng: bool = True,
    mesh: Mesh | None = None,
    load_optim: bool = True,
    metas: dict[str, ParamMeta] | None = None,
    strict: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any] | None:
    """Load the tracker's checkpoint (or ``iteration``'s) into ``model`` and ``optimizer`` in place.

    Returns the saved ``meta`` with ``"iteration"`` set to the checkpoint's iteration, or None when
    ``load_dir`` has no tracker and no ``iteration`` was asked for (a fresh start).

    Every file is checked against the completion marker first. Tensors of the checkpoint that
    this run does not have are an error; with ``strict=False`` they are logged and skipped.
    Collective when pipeline-parallel (the stages pool their tensor names).

    With ``--no-load-optim``, still pass the optimizer and ``load_optim=False``: in bf16/fp16 its
    fp32 masters must be refreshed from the loaded weights (``reload_model_params``), or the first
    step would write the initial weights back.
    """
    mesh = mesh or Mesh()
    opened = open_checkpoint(load_dir, iteration, mesh, log)
    if opened is None:
        return None
    directory, record, metadata = opened
    with_optim = optimizer is not None and load_optim
    if with_optim and not record.get("has_optimizer", False):
        raise CheckpointError(f"{directory} was saved without optimizer state (--no-save-optim); resume with --no-load-optim")
    # Each rank names the boxes it holds and reads their overlap with the stored chunks.
    state = load_state(model, optimizer, with_optimizer=with_optim, metas=metas)
    _check_tensors(state, model, metadata, directory, mesh, strict, log)
    read_state(state, directory, metadata)
    if with_optim:
        finish_load(state, optimizer)
    elif optimizer is not None:
        optimizer.reload_model_params()

    if load_rng:
        if not record.get("has_rng", True):
            raise CheckpointError(f"{directory} was saved without RNG states (--no-save-rng); resume with --no-load-rng")
        if record.get("world_size", 1) != mesh.world_size:
            raise CheckpointError(
                f"{directory} was saved by {record.get('world_size', 1)} processes and this run has {mesh.world_size}: "
                "their RNG streams do not map; resume with --no-load-rng"
            )
        set_rng_state(_read_rng(directory / f"rng_rank{mesh.rank}.pt"))
    return {**record["meta"], "iteration": record["iteration"]}


def open_checkpoint(load_dir: str | os.PathLike, iteration: int | None = None, mesh: Mesh | None = None,
                    log: Callable[[str], None] = print) -> tuple[Path, dict[str, Any], Any] | None:  # fmt: skip
    """The directory, ``meta.json`` record and DCP index of the tracker's (or ``iteration``'s)
    checkpoint, every file checked against the completion marker first (the checksum reading
    split over ``mesh``'s ranks); None when ``load_dir`` has no tracker and no ``iteration`` was
    asked for (a fresh start)."""
    root = Path(load_dir)
    if iteration is None:
        iteration = newest_iteration(root, log)
        if iteration is None:
            if (root / META).is_file():
                raise CheckpointError(f"{root} is one checkpoint; point --load at its parent {root.parent}, which holds {TRACKER}")
            return None
        directory = checkpoint_dir(root, iteration)
        if not directory.is_dir():
            raise CheckpointError(f"tracker {root / TRACKER} names iteration {iteration} but {directory} does not exist; {_fallback_hint(root, iteration)}")
    else:
        directory = checkpoint_dir(root, iteration)
        if not directory.is_dir():
            raise CheckpointError(f"no checkpoint for iteration {iteration}: {directory} does not exist; {_fallback_hint(root, iteration)}")
    _refuse_megatron(directory)
    problem = _verify_together(directory, mesh or Mesh())
    if problem:
        raise CheckpointError(f"checkpoint of iteration {iteration} cannot be trusted: {problem}; {_fallback_hint(root, iteration)}")
    record = read_record(directory / META)
    metadata = read_dcp_metadata(directory)
    return directory, record, metadata


def load_for_training(c: CheckpointConfig, model: nn.Module, optimizer: Any, mesh: Mesh, log: Callable[[str], None] = print,
                      metas: dict[str, ParamMeta] | None = None) -> dict[str, Any] | None:  # fmt: skip
    """``--load`` as Megatron reads its companions: ``--ckpt-step`` picks the iteration (else the
    tracker's); ``--finetune`` loads the model weights only (no optimizer state, no RNG) and
    starts again at iteration 0 with no samples consumed; ``--dist-ckpt-strictness log_all``
    loads the tensors both have and logs the checkpoint's others."""
    meta = load_checkpoint(
        c.load, model, optimizer, iteration=None if c.ckpt_step < 0 else c.ckpt_step, mesh=mesh,
        load_rng=not (c.no_load_rng or c.finetune), load_optim=not (c.no_load_optim or c.finetune),
        strict=c.dist_ckpt_strictness == "raise_all", log=log, metas=metas,
    )  # fmt: skip
    if meta is not None and c.finetune:
        return {**meta, "iteration": 0, "consumed_samples": 0}
    return meta


def checkpoint_config_errors(cfg: Config) -> list[str]:
    """What is wrong with the checkpoint-trust and divergence fields (``validate`` adds these)."""
    c, t = cfg.checkpoint, cfg.train
    errors = []
    if c.ckpt_format != "torch_dist":
        errors.append(f"--ckpt-format {c.ckpt_format} is not supported: meshtron reads and writes its own torch_dist (DCP) checkpoints; "
                      f"a Megatron-LM checkpoint (torch or torch_dist) converts with {MEGATRON_IMPORT}")
    if c.dist_ckpt_strictness not in STRICTNESS:
        errors.append(f"--dist-ckpt-strictness must be one of {', '.join(STRICTNESS)}, got '{c.dist_ckpt_strictness}'")
    if c.ckpt_step < -1:
        errors.append(f"--ckpt-step must be an iteration (>= 0), or -1 for the tracker's; got {c.ckpt_step}")
    if (c.finetune or c.ckpt_step >= 0) and not c.load:
        errors.append(f"{'--finetune' if c.finetune else '--ckpt-step'} needs --load")
    if c.async_save and not c.save:
        errors.append("--async-save needs --save (the directory the background writes go to)")
    if c.save and (problem := save_dir_problem(c.save)):
        errors.append(problem)
    if c.ckpt_keep_last < 0:
        errors.append(f"--ckpt-keep-last must be >= 0 (0: keep every checkpoint), got {c.ckpt_keep_last}")
    if c.save_failure not in SAVE_FAILURE:
        errors.append(f"--save-failure must be one of {', '.join(SAVE_FAILURE)}, got '{c.save_failure}'")
    if t.max_consecutive_skipped_steps < 0:
        errors.append(f"--max-consecutive-skipped-steps must be >= 0 (0: no limit), got {t.max_consecutive_skipped_steps}")
    return errors


def _refuse_megatron(directory: Path) -> None:
    """A Megatron-LM checkpoint (no ``meta.json``; ``common.pt``, ``metadata.json`` or ``mp_rank_*``
    beside its data) given to --load: name the command that converts it."""
    if directory.is_dir() and not (directory / META).is_file():
        if (directory / "common.pt").is_file() or (directory / "metadata.json").is_file() or any(directory.glob("mp_rank_*")):
            raise CheckpointError(f"{directory} is a Megatron-LM checkpoint, not meshtron's; convert it with "
                                  f"{MEGATRON_IMPORT.replace('MEGATRON_DIR', str(directory.parent))}")  # fmt: skip


def _fallback_hint(root: Path, bad: int) -> str:
    """How to load another iteration instead (Megatron's ``--ckpt-step``), naming the complete ones."""
    complete = [i for i in complete_iterations(root) if i != bad]
    if not complete:
        return f"{root} holds no other complete checkpoint"
    pick = max([i for i in complete if i < bad] or complete)
    return f"load another iteration with --ckpt-step N (complete ones in {root}: {', '.join(map(str, complete))}), e.g. --ckpt-step {pick}"


def read_meta(load_dir: str | os.PathLike, iteration: int | None = None) -> dict[str, Any]:
    """The saved ``meta`` of the tracker's (or ``iteration``'s) checkpoint, without loading tensors."""
    root = Path(load_dir)
    iteration = newest_iteration(root) if iteration is None else iteration
    if iteration is None:
        raise CheckpointError(f"no checkpoint in {root}: point --load at a directory written by --save")
    _refuse_megatron(checkpoint_dir(root, iteration))
    record = read_record(checkpoint_dir(root, iteration) / META)
    return {**record["meta"], "iteration": record["iteration"]}


def read_record(path: Path) -> dict[str, Any]:
    """A checkpoint's whole ``meta.json``: iteration, what was saved, world size, and ``meta``."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing (was the save interrupted?)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {exc}") from None
    if not isinstance(record, dict) or "iteration" not in record or "meta" not in record:
        raise CheckpointError(f"checkpoint file {path} is not a meshtron meta.json (no 'iteration'/'meta')")
    if record.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format {record['format_version']}, newer than this meshtron reads ({FORMAT_VERSION})")
    return record


def _read_rng(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing; resume with --no-load-rng to start fresh RNG streams")
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {exc}") from None


def read_dcp_metadata(directory: Path) -> Any:
    """DCP's index of ``directory``, read without running code from it (``safe_metadata.py``),
    then checked: each data file holds the bytes the index points to. A missing or damaged file
    is named here rather than inside DCP's rank-wrapped traceback."""
    path = directory / ".metadata"
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing (was the save interrupted?)")
    try:
        metadata = read_metadata(path)
    except UnsafeMetadata as exc:
        raise CheckpointError(f"checkpoint file {path} {exc}") from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {exc}") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    check_data_files(directory, needed)
    return metadata


def check_data_files(directory: Path, needed: dict[str, int]) -> None:
    """Each data file named in ``needed`` exists in ``directory`` and holds at least its bytes."""
    for name, size in sorted(needed.items()):
        data = directory / name
        if not data.is_file():
            raise CheckpointError(f"checkpoint file {data} is missing")
        if data.stat().st_size < size:
            raise CheckpointError(f"checkpoint file {data} is truncated ({data.stat().st_size} of {size} bytes)")


# Keys named after a parameter: the ones a change of model shows up in. The loss scaler's entries
# depend on the precision, which a run may change on resume.
_PARAMETER_KEYED = ("model.", "optimizer.master.", "optimizer.state.")


def _parameter_of(key: str) -> str:
    """The parameter name in a parameter-keyed checkpoint key."""
    name = key.removeprefix("model.").removeprefix("optimizer.master.")
    return name.removeprefix("optimizer.state.").rpartition(".")[0] if key.startswith("optimizer.state.") else name


def _check_tensors(state: dict[str, Any], model: nn.Module, metadata: Any, directory: Path, mesh: Mesh, strict: bool,
                   log: Callable[[str], None]) -> None:  # fmt: skip
    """Tensors this run needs that the checkpoint lacks, or holds in another shape, are an error;
    tensors of the checkpoint whose parameter this run does not have (fewer layers, another model)
    too, unless not ``strict``."""
    saved = metadata.state_dict_metadata
    lacking = [k for k in state if k not in saved]
    if lacking:
        hint = ("another --optimizer than the checkpoint's? keep its --optimizer, or resume with --no-load-optim"
                if all(k.startswith("optimizer.state.") for k in lacking) else "another model shape or precision?")
        raise CheckpointError(f"{directory} lacks {len(lacking)} tensors this run needs, e.g. {lacking[:3]} ({hint})")
    for key, sharded in state.items():
        if tuple(saved[key].size) != tuple(sharded.shape):
            raise CheckpointError(f"{directory} holds {key} of shape {list(saved[key].size)} but this run's is {list(sharded.shape)} "
                                  "(another model width, vocabulary or layout of the model?); configure the model as it was saved")  # fmt: skip
    names = set(model.state_dict())
    if mesh.pp > 1:  # each stage holds its own layers: the run has their union
        parts: list[Any] = [None] * mesh.pp
        torch.distributed.all_gather_object(parts, sorted(names), group=mesh.pp_group)
        names = set().union(*parts)
    sections = _PARAMETER_KEYED if any(k.startswith("optimizer.") for k in state) else ("model.",)
    extra = sorted(k for k in saved if k.startswith(sections) and _parameter_of(k) not in names)
    if not extra:
        return
    what = f"{directory} holds {len(extra)} tensors this run does not have, e.g. {extra[:5]}"
    if strict:
        raise CheckpointError(
            f"{what}: loading would silently drop them (fewer layers, or another model?). Configure the model as the "
            "checkpoint was saved, or load only the tensors both have with --dist-ckpt-strictness log_all"
        )
    log(f"warning: {what}; they are not loaded (--dist-ckpt-strictness log_all)")


def read_state(state: dict[str, Any], directory: Path, metadata: Any) -> None:
    """``read_boxes`` with DCP's rank-wrapped failures turned into one CheckpointError naming the directory."""
    try:
        read_boxes(state, directory, metadata)
    except CheckpointException as exc:
        causes = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in exc.failures.items())
        raise CheckpointError(f"cannot load tensors from {directory}: {causes}") from None
