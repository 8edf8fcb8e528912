"""``--ckpt-keep-last N``: after a checkpoint is complete, remove the older complete ones beyond
the newest N. It runs only once the new checkpoint and its tracker are in place, so the one
being written is never a candidate and the newest complete one always stays; checkpoints newer
than the one just saved (left by another run) are not touched. A directory is renamed out of
the ``iter_*`` pattern before it is removed: a crash mid-removal leaves no half checkpoint that
looks complete."""

from __future__ import annotations

import shutil
from pathlib import Path

from meshtron.checkpoint.save_dir import complete_iterations


def prune(root: Path, keep_last: int, just_saved: int) -> list[int]:
    """Remove all but the newest ``keep_last`` complete checkpoints up to ``just_saved``; returns
    the iterations removed."""
    if keep_last < 1:
        return []
    older = [i for i in complete_iterations(root) if i <= just_saved]
    keep = set(older[-keep_last:]) | {just_saved}
    removed = [i for i in older if i not in keep]
    for iteration in removed:
        doomed = root / f"iter_{iteration:07d}.removing"
        (root / f"iter_{iteration:07d}").rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return removed
