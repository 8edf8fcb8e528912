"""PyTorch's flight recorder, read when the watchdog names a hang: each rank's last collectives.

With ``TORCH_FR_BUFFER_SIZE`` (``TORCH_NCCL_TRACE_BUFFER_SIZE`` before PyTorch 2.7) set before the
process groups start, PyTorch keeps a ring buffer of each rank's recent collectives (which group,
operation, sizes, and how far each got: enqueued, started, completed), for NCCL and, on recent
PyTorch, gloo. meshtron turns it on with ``DEFAULT_ENTRIES`` unless the environment names a size
(0 turns it off), as torchtitan does. The process groups' own timeout comes a minute after the
watchdog's, so PyTorch's dump on timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``) would never run: the
watchdog asks for the dump instead. Each live rank writes its buffer where PyTorch's own dump goes
(``TORCH_FR_DUMP_TEMP_FILE``, else ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, else
``/tmp/nccl_trace_rank_``, followed by the rank) and logs, per process group, the collectives
enqueued but not completed: the ones the missing rank never joined.

Reading the files of every rank together: ``python -m torch.distributed.flight_recorder.fr_trace
DIR`` (``-j`` prints each rank's entries) matches collectives across ranks and names the first
mismatch; it needs NCCL's dumps (gloo's on PyTorch 2.13 name no process group, which it indexes
by). One file is a pickled dict: ``entries`` (``profiling_name`` such as ``nccl:all_reduce``,
``process_group``, ``collective_seq_id``, ``state``, ``input_sizes``, ``frames``: the Python stack
that issued it) and ``pg_status`` (per group: the last enqueued, started and completed sequence id).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT_ENTRIES = 2000
SIZE_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FILE_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
DEFAULT_FILE = "/tmp/nccl_trace_rank_"


def enable() -> None:
    """Record collectives from the first process group on, unless the environment says otherwise."""
    if not any(v in os.environ for v in SIZE_VARIABLES):
        os.environ[SIZE_VARIABLES[0]] = str(DEFAULT_ENTRIES)


def dump(rank: int) -> list[str]:
    """This rank's buffer written to its file, and the lines saying where and what is pending."""
    if not int(next((os.environ[v] for v in SIZE_VARIABLES if v in os.environ), "0") or 0):
        return [f"flight recorder off: set {SIZE_VARIABLES[0]}={DEFAULT_ENTRIES} for each rank's last collectives"]
    try:
        from torch._C._distributed_c10d import _dump_fr_trace as dumped, _dump_fr_trace_json as read
    except ImportError:  # PyTorch before 2.7: NCCL's only
        try:
            from torch._C._distributed_c10d import _dump_nccl_trace as dumped, _dump_nccl_trace_json as read
        except ImportError:
            return ["flight recorder: this PyTorch has none to dump"]
    raw, trace = dumped(), json.loads(read())  # the file is PyTorch's pickle (what fr_trace reads); the log reads the JSON
    path = Path(f"{next((os.environ[v] for v in FILE_VARIABLES if os.environ.get(v)), DEFAULT_FILE)}{rank}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
        where = f"written to {path} (every rank's: python -m torch.distributed.flight_recorder.fr_trace {path.parent})"
    except OSError as exc:
        where = f"not written ({exc})"
    return [f"flight recorder: {len(trace.get('entries', []))} collectives {where}", *pending(trace)]


def pending(trace: dict) -> list[str]:
    """Per process group, the collectives enqueued but not completed (oldest first)."""
    lines = []
    for group, status in sorted(trace.get("pg_status", {}).items()):
        done = int(status.get("last_completed_collective", -1))  # numbers in the pickle, strings in the JSON
        if int(status.get("last_enqueued_collective", -1)) <= done:
            continue
        waiting = [e for e in trace.get("entries", []) if str(e["pg_id"]) == str(group) and not e.get("is_p2p") and int(e["collective_seq_id"]) > done]
        ops = ", ".join(f"#{e['collective_seq_id']} {e['profiling_name']} {e['input_sizes']} ({e['state']})" for e in waiting[:3])
        name = next((e["process_group"][1] for e in waiting), "")
        lines.append(f"flight recorder: process group {group}{f' ({name})' if name else ''} completed #{done}, waits in {ops or 'an unrecorded one'}")
    return lines or ["flight recorder: no collective waits (a point-to-point transfer or the host may)"]
