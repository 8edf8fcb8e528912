"""``meshtron checkpoint info DIR``: whether a checkpoint can be trusted (the first line: OK, or
FAILED and why) and what it holds (``--tensors`` lists every tensor), without loading a tensor (the index is read by the restricted unpickler, the files are checked
against the completion marker)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from meshtron.checkpoint.checkpoint import (
    META,
    CheckpointError,
    checkpoint_dir,
    latest_iteration,
    read_dcp_metadata,
    read_record,
)
from meshtron.checkpoint.save_dir import list_iterations
from meshtron.checkpoint.integrity import verify


def describe(root: Path, iteration: int | None = None, tensors: bool = False) -> tuple[str, bool]:
    """The report for ``iteration`` (default: the tracker's, else the newest directory), its
    verdict on the first line, and whether the checkpoint is complete and intact. ``tensors``:
    list every tensor's name, shape and dtype (hundreds of lines for a real model)."""
    iterations = list_iterations(root)
    if not iterations:
        raise CheckpointError(f"no checkpoint in {root}: expected iter_NNNNNNN directories written by --save")
    tracker = latest_iteration(root)
    chosen = iteration if iteration is not None else tracker if tracker is not None else iterations[-1]
    directory = checkpoint_dir(root, chosen)
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint for iteration {chosen}: {directory} does not exist")
    lines = [f"{root}: iterations {', '.join(map(str, iterations))} (tracker: {tracker if tracker is not None else 'none'})",
             f"iteration {chosen}: {directory}"]  # fmt: skip
    problem = verify(directory)
    files = [p for p in directory.iterdir() if p.is_file()]
    on_disk = sum(p.stat().st_size for p in files)
    lines.append(f"  checksums: FAILED: {problem}" if problem else f"  checksums: verified OK ({len(files)} files, {on_disk} bytes)")
    try:
        lines.append("  " + _saved_under(read_record(directory / META)))
        listing = _tensors(directory)
        lines += listing if tensors else [f"{listing[0]} (--tensors lists them)"]
    except CheckpointError as exc:
        lines.append(f"  unreadable: {exc}")
        problem = problem or str(exc)
    verdict = f"FAILED: iteration {chosen} of {root}: {problem}" if problem else f"OK: iteration {chosen} of {root} is complete and intact"
    return "\n".join([verdict, *lines]), problem is None


def _tensors(directory: Path) -> list[str]:
    """Each tensor's name, global shape and dtype, from the DCP index."""
    entries = sorted(read_dcp_metadata(directory).state_dict_metadata.items())
    nbytes = sum(math.prod(e.size) * e.properties.dtype.itemsize for _, e in entries)
    rows = [(k, str(list(e.size)), str(e.properties.dtype).removeprefix("torch.")) for k, e in entries]
    widths = [max((len(r[i]) for r in rows), default=0) for i in (0, 1)]
    return [f"  tensors: {len(entries)}, {nbytes} bytes"] + [f"    {k:<{widths[0]}}  {shape:<{widths[1]}}  {dtype}" for k, shape, dtype in rows]


def _saved_under(record: dict) -> str:
    """The layout and contents a ``meta.json`` records."""
    world = record.get("world_size", 1)
    par = record["meta"].get("config", {}).get("parallel")
    layout = "layout unknown"
    if par:
        tp, cp, pp = par["tensor_parallel"], par["context_parallel"], par["pipeline_parallel"]
        layout = f"tp {tp} x cp {cp} x dp {world // (tp * cp * pp)} x pp {pp}"
        layout += "".join(f", {name}" for name, on in (("distributed optimizer", par.get("use_distributed_optimizer")), ("fsdp", par.get("fsdp"))) if on)
    yes = {True: "yes", False: "no"}
    return (f"saved by {world} process{'es' if world > 1 else ''} ({layout}); optimizer state: {yes[record.get('has_optimizer', False)]}; "
            f"RNG states: {yes[record.get('has_rng', True)]}")  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshtron checkpoint", description="inspect checkpoints")
    sub = parser.add_subparsers(dest="action", required=True)
    info = sub.add_parser("info", help="the verdict (OK or FAILED, why) first, then iterations, layout, sizes and checksums")
    info.add_argument("dir", help="directory written by --save")
    info.add_argument("--ckpt-step", type=int, default=None, help="iteration to describe (default: the tracker's)")
    info.add_argument("--tensors", action="store_true", help="also list every tensor's name, global shape and dtype")
    args = parser.parse_args(argv)
    report, ok = describe(Path(args.dir), args.ckpt_step, args.tensors)
    print(report)
    return 0 if ok else 1
