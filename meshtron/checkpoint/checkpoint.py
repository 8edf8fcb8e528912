"""Save and resume a run: Megatron's directory layout, tensors through torch.distributed.checkpoint.

Layout::

    {save}/latest_checkpointed_iteration.txt    the iteration of the newest complete checkpoint
    {save}/iter_0000100/.metadata, *.distcp     model + optimizer tensors (DCP)
    {save}/iter_0000100/meta.json               iteration, consumed samples, schedule, config, ...
    {save}/iter_0000100/rng_rank0.pt            RNG states of each rank (unless --no-save-rng)
    {save}/iter_0000100/complete.json           size and CRC-32 of every file above, written last

The tensors are full and keyed by parameter name, whatever parallel layout wrote them
(``layout.py``), so a checkpoint loads under any other layout.

Tensors go through DCP even in one process so that sharded, reshardable checkpoints (a later
distributed optimizer) change what is *in* the state dict, not how callers save or load.

Crash safety: a checkpoint is written into a temporary sibling directory, fsynced, and renamed
into place; the tracker is replaced (temp file + ``os.replace``) only after that. A crash at any
point leaves the previous tracker pointing at a complete checkpoint. The one window left is
re-saving an iteration that already exists: between moving the old directory aside and renaming
the new one in, the tracker's directory is briefly absent.

Trust on load: the marker (``integrity.py``) is checked before any tensor is read, DCP's pickled
index is read by a restricted unpickler (``safe_metadata.py``), and tensors of the checkpoint
that the run lacks are an error rather than silently dropped.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from meshtron.checkpoint.integrity import MARKER, manifest, verify
from meshtron.checkpoint.layout import empty_full_state, full_state, load_full_state
from meshtron.checkpoint.safe_metadata import SafeFileSystemReader, UnsafeMetadata, read_metadata
from meshtron.config import Config, CheckpointConfig
from meshtron.models.contract import ParamMeta
from meshtron.parallel.mesh import Mesh

TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"
FORMAT_VERSION = 1
# --dist-ckpt-strictness values we honor (Megatron's names): any mismatch is an error / the
# checkpoint's tensors this run lacks are logged and skipped.
STRICTNESS = ("raise_all", "log_all")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written; the message names the file or directory."""


def checkpoint_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def list_iterations(save_dir: str | os.PathLike) -> list[int]:
    """Iterations with a directory in ``save_dir`` (complete or not), ascending."""
    root = Path(save_dir)
    found = [re.fullmatch(r"iter_(\d+)", p.name) for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    return sorted(int(m.group(1)) for m in found if m)


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
    save_rng: bool = True,
) -> Path:
    """Write ``{save_dir}/iter_{iteration:07d}`` atomically, then point the tracker at it.

    Collective: every rank calls it. The tensors are saved layout-free (full, keyed by name; see
    ``layout.py``) by global rank 0; every rank adds its RNG state; after a barrier rank 0
    checksums every rank's files into the completion marker, renames the directory into place
    and writes the tracker. ``meta`` must be JSON-serializable. Returns the
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
                      "has_rng": save_rng, "world_size": mesh.world_size, "meta": meta}
            _write_durably(tmp / META, json.dumps(record, indent=1).encode())
        if save_rng:
            torch.save(get_rng_state(), tmp / f"rng_rank{mesh.rank}.pt")
        _barrier(mesh)
        if writer:
            _write_durably(tmp / MARKER, json.dumps(manifest(tmp, iteration), indent=1).encode())
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
    root = Path(load_dir)
    if iteration is None:
        iteration = latest_iteration(root)
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
    problem = verify(directory)
    if problem:
        raise CheckpointError(f"checkpoint of iteration {iteration} cannot be trusted: {problem}; {_fallback_hint(root, iteration)}")

    mesh = mesh or Mesh()
    record = read_record(directory / META)
    metadata = read_dcp_metadata(directory)
    with_optim = optimizer is not None and load_optim
    if with_optim and not record.get("has_optimizer", False):
        raise CheckpointError(f"{directory} was saved without optimizer state (--no-save-optim); resume with --no-load-optim")
    # Every rank reads the full tensors (no collectives) and keeps its own part of them.
    full = empty_full_state(model, optimizer, with_optimizer=with_optim, metas=metas)
    _check_tensor_names(full, metadata, directory, mesh, strict, log)
    _dcp_load({"model": full["model"]}, directory, metadata)
    if with_optim:
        _dcp_load({"optimizer": full["optimizer"]}, directory, metadata)
    load_full_state(full, model, optimizer, with_optimizer=with_optim, metas=metas)
    if optimizer is not None and not with_optim:
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
        errors.append(f"--ckpt-format {c.ckpt_format} is not supported: meshtron reads and writes torch_dist (DCP) checkpoints only; "
                      "convert a legacy Megatron checkpoint (--ckpt-format torch) to torch_dist with Megatron first")
    if c.dist_ckpt_strictness not in STRICTNESS:
        errors.append(f"--dist-ckpt-strictness must be one of {', '.join(STRICTNESS)}, got '{c.dist_ckpt_strictness}'")
    if c.ckpt_step < -1:
        errors.append(f"--ckpt-step must be an iteration (>= 0), or -1 for the tracker's; got {c.ckpt_step}")
    if (c.finetune or c.ckpt_step >= 0) and not c.load:
        errors.append(f"{'--finetune' if c.finetune else '--ckpt-step'} needs --load")
    if t.max_consecutive_skipped_steps < 0:
        errors.append(f"--max-consecutive-skipped-steps must be >= 0 (0: no limit), got {t.max_consecutive_skipped_steps}")
    return errors


def _fallback_hint(root: Path, bad: int) -> str:
    """How to load another iteration instead (Megatron's ``--ckpt-step``), naming the complete ones."""
    complete = [i for i in list_iterations(root) if i != bad and (checkpoint_dir(root, i) / MARKER).is_file()]
    if not complete:
        return f"{root} holds no other complete checkpoint"
    pick = max([i for i in complete if i < bad] or complete)
    return f"load another iteration with --ckpt-step N (complete ones in {root}: {', '.join(map(str, complete))}), e.g. --ckpt-step {pick}"


def read_meta(load_dir: str | os.PathLike, iteration: int | None = None) -> dict[str, Any]:
    """The saved ``meta`` of the tracker's (or ``iteration``'s) checkpoint, without loading tensors."""
    root = Path(load_dir)
    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        raise CheckpointError(f"no checkpoint in {root}: point --load at a directory written by --save")
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
    for name, size in sorted(needed.items()):
        data = directory / name
        if not data.is_file():
            raise CheckpointError(f"checkpoint file {data} is missing")
        if data.stat().st_size < size:
            raise CheckpointError(f"checkpoint file {data} is truncated ({data.stat().st_size} of {size} bytes)")
    return metadata


# Keys named after a parameter: the ones a change of model shows up in. The loss scaler's entries
# depend on the precision, which a run may change on resume.
_PARAMETER_KEYED = ("model.", "optimizer.master.", "optimizer.state.")


def _check_tensor_names(full: dict[str, Any], metadata: Any, directory: Path, mesh: Mesh, strict: bool, log: Callable[[str], None]) -> None:
    """Tensors this run needs that the checkpoint lacks are an error; tensors of the checkpoint
    this run does not have (fewer layers, another model) too, unless not ``strict``."""
    wanted = _flat_keys(full)
    run_keys = set(wanted)
    if mesh.pp > 1:  # each stage holds its own layers: the run has their union
        parts: list[Any] = [None] * mesh.pp
        torch.distributed.all_gather_object(parts, wanted, group=mesh.pp_group)
        run_keys = set().union(*parts)
    saved = metadata.state_dict_metadata.keys()
    lacking = [k for k in wanted if k not in saved]
    if lacking:
        raise CheckpointError(f"{directory} lacks {len(lacking)} tensors this run needs, e.g. {lacking[:3]} (another model shape or precision?)")
    sections = tuple(p for p in _PARAMETER_KEYED if p.split(".")[0] in full)
    extra = sorted(k for k in saved if k.startswith(sections) and k not in run_keys)
    if not extra:
        return
    what = f"{directory} holds {len(extra)} tensors this run does not have, e.g. {extra[:5]}"
    if strict:
        raise CheckpointError(
            f"{what}: loading would silently drop them (fewer layers, or another model?). Configure the model as the "
            "checkpoint was saved, or load only the tensors both have with --dist-ckpt-strictness log_all"
        )
    log(f"warning: {what}; they are not loaded (--dist-ckpt-strictness log_all)")


def _dcp_load(state: dict[str, Any], directory: Path, metadata: Any) -> None:
    """``dcp.load`` through the already-read index, its rank-wrapped failures turned into one
    CheckpointError naming the directory."""
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=SafeFileSystemReader(directory, metadata), no_dist=True)
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
