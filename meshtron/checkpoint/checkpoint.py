"""Save and resume a run: Megatron's directory layout, tensors through torch.distributed.checkpoint.

Layout::

    {save}/latest_checkpointed_iteration.txt    the iteration of the newest complete checkpoint
    {save}/iter_0000100/.metadata, *.distcp     model + optimizer tensors (DCP)
    {save}/iter_0000100/meta.json               iteration, consumed samples, schedule, config, ...
    {save}/iter_0000100/rng_rank0.pt            RNG states of each rank

The tensors are full and keyed by parameter name, whatever parallel layout wrote them
(``layout.py``), so a checkpoint loads under any other layout.

Tensors go through DCP even in one process so that sharded, reshardable checkpoints (a later
distributed optimizer) change what is *in* the state dict, not how callers save or load.

Crash safety: a checkpoint is written into a temporary sibling directory, fsynced, and renamed
into place; the tracker is replaced (temp file + ``os.replace``) only after that. A crash at any
point leaves the previous tracker pointing at a complete checkpoint. The one window left is
re-saving an iteration that already exists: between moving the old directory aside and renaming
the new one in, the tracker's directory is briefly absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from meshtron.checkpoint.layout import empty_full_state, full_state, load_full_state
from meshtron.models.contract import ParamMeta
from meshtron.parallel.mesh import Mesh

TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written; the message names the file or directory."""


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


# -- RNG ------------------------------------------------------------------------------------------


def get_rng_state() -> dict[str, Any]:
    """Every generator a run draws from (python, numpy, torch CPU, current CUDA device), in types
    that ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {**np_state, "state": {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"]}},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore ``get_rng_state()``'s result; a CUDA state is applied only where CUDA exists."""
    random.setstate(state["python"])
    np_state = state["numpy"]
    key = np.asarray(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state({**np_state, "state": {"key": key, "pos": np_state["state"]["pos"]}})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# -- save -----------------------------------------------------------------------------------------


def save_checkpoint(
    save_dir: str | os.PathLike,
    iteration: int,
    model: nn.Module,
    optimizer: Any,
    meta: dict[str, Any],
    mesh: Mesh | None = None,
    save_optim: bool = True,
    metas: dict[str, ParamMeta] | None = None,
) -> Path:
    """Write ``{save_dir}/iter_{iteration:07d}`` atomically, then point the tracker at it.

    Collective: every rank calls it. The tensors are saved layout-free (full, keyed by name; see
    ``layout.py``) by global rank 0; every rank adds its RNG state; rank 0 then renames the
    directory into place and writes the tracker. ``meta`` must be JSON-serializable. Returns the
    final directory.
    """
    mesh = mesh or Mesh()
    root = Path(save_dir)
    final = checkpoint_dir(root, iteration)
    tmp = root / f"{final.name}.tmp"
    writer = mesh.rank == 0
    state = full_state(model, optimizer, mesh, with_optimizer=save_optim, metas=metas)
    if writer:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{final.name}.tmp*"):  # left by a run killed mid-save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier(mesh)
    try:
        if writer:
            with _quiet_single_process():
                dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
            record = {"format_version": FORMAT_VERSION, "iteration": iteration, "has_optimizer": save_optim,
                      "world_size": mesh.world_size, "meta": meta}
            _write_durably(tmp / META, json.dumps(record, indent=1).encode())
        torch.save(get_rng_state(), tmp / f"rng_rank{mesh.rank}.pt")
        _barrier(mesh)
        if writer:
            _fsync_tree(tmp)
            _move_into_place(tmp, final)
    except BaseException:  # DCP raises CheckpointException, a BaseException
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if writer:
        _write_durably(root / TRACKER, f"{iteration}\n".encode())
    _barrier(mesh)
    return final


def _barrier(mesh: Mesh) -> None:
    if mesh.world_size > 1:
        torch.distributed.barrier()


@contextlib.contextmanager
def _quiet_single_process():
    """DCP runs without a process group when none exists, and warns on every call that it does;
    in one process that is the intent, so the warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


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
) -> dict[str, Any] | None:
    """Load the tracker's checkpoint (or ``iteration``'s) into ``model`` and ``optimizer`` in place.

    Returns the saved ``meta`` with ``"iteration"`` set to the checkpoint's iteration, or None when
    ``load_dir`` has no tracker and no ``iteration`` was asked for (a fresh start).

    With ``--no-load-optim``, still pass the optimizer and ``load_optim=False``: in bf16/fp16 its
    fp32 masters must be refreshed from the loaded weights (``reload_model_params``), or the first
    step would write the initial weights back.
    """
    root = Path(load_dir)
    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            if (root / META).is_file():
                raise CheckpointError(f"{root} is one checkpoint; point --load at its parent {root.parent}, which holds {TRACKER}")
            return None
        directory = checkpoint_dir(root, iteration)
        if not directory.is_dir():
            raise CheckpointError(f"tracker {root / TRACKER} names iteration {iteration} but {directory} does not exist")
    else:
        directory = checkpoint_dir(root, iteration)
        if not directory.is_dir():
            raise CheckpointError(f"no checkpoint for iteration {iteration}: {directory} does not exist")

    mesh = mesh or Mesh()
    record = _read_meta(directory / META)
    metadata = _read_dcp_metadata(directory)
    with_optim = optimizer is not None and load_optim
    if with_optim and not record.get("has_optimizer", False):
        raise CheckpointError(f"{directory} was saved without optimizer state (--no-save-optim); resume with --no-load-optim")
    # Every rank reads the full tensors (no collectives) and keeps its own part of them.
    full = empty_full_state(model, optimizer, with_optimizer=with_optim, metas=metas)
    _dcp_load({"model": full["model"]}, directory, metadata)
    if with_optim:
        _dcp_load({"optimizer": full["optimizer"]}, directory, metadata)
    load_full_state(full, model, optimizer, with_optimizer=with_optim, metas=metas)
    if optimizer is not None and not with_optim:
        optimizer.reload_model_params()

    if load_rng:
        rng = directory / f"rng_rank{mesh.rank}.pt"
        if record.get("world_size", 1) != mesh.world_size:
            raise CheckpointError(
                f"{directory} was saved by {record.get('world_size', 1)} processes and this run has {mesh.world_size}: "
                "their RNG streams do not map; resume with --no-load-rng"
            )
        set_rng_state(_read_rng(rng))
    return {**record["meta"], "iteration": record["iteration"]}


def read_meta(load_dir: str | os.PathLike, iteration: int | None = None) -> dict[str, Any]:
    """The saved ``meta`` of the tracker's (or ``iteration``'s) checkpoint, without loading tensors."""
    root = Path(load_dir)
    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        raise CheckpointError(f"no checkpoint in {root}: point --load at a directory written by --save")
    record = _read_meta(checkpoint_dir(root, iteration) / META)
    return {**record["meta"], "iteration": record["iteration"]}


def _read_meta(path: Path) -> dict[str, Any]:
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


def _read_dcp_metadata(directory: Path) -> Any:
    """Read DCP's index first, so a missing or damaged file is named here rather than inside DCP's
    rank-wrapped traceback; then check each data file holds the bytes the index points to."""
    path = directory / ".metadata"
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing (was the save interrupted?)")
    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {exc}") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        data = directory / name
        if not data.is_file():
            raise CheckpointError(f"checkpoint file {data} is missing")
        if data.stat().st_size < size:
            raise CheckpointError(f"checkpoint file {data} is truncated ({data.stat().st_size} of {size} bytes)")
    return metadata


def _dcp_load(state: dict[str, Any], directory: Path, metadata: Any) -> None:
    """``dcp.load`` with its rank-wrapped failures turned into one CheckpointError naming the directory."""
    saved = metadata.state_dict_metadata.keys()
    wanted = [k for k in _flat_keys(state) if k not in saved]
    if wanted:
        raise CheckpointError(
            f"{directory} lacks {len(wanted)} tensors this run needs, e.g. {wanted[:3]} "
            "(another model shape or precision?)"
        )
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    except CheckpointException as exc:
        causes = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in exc.failures.items())
        raise CheckpointError(f"cannot load tensors from {directory}: {causes}") from None


def _flat_keys(state: dict[str, Any], prefix: str = "") -> list[str]:
    """DCP's flattened key names (``a.b.c``) for a nested dict of tensors."""
    keys = []
    for k, v in state.items():
        name = f"{prefix}{k}"
        keys.extend(_flat_keys(v, name + ".") if isinstance(v, dict) else [name])
    return keys
