"""Progress bars for long CPU-side work (corpus building, index building, tokenizing, conversion).

A bar goes to stderr, on rank 0 only, and only when it helps: on a terminal, and only once the
work has run for ``DELAY_S`` seconds, so short jobs and logs stay clean. ``MESHTRON_PROGRESS=1``
shows it anyway (from the first update, terminal or not), ``MESHTRON_PROGRESS=0`` never.
Callers update it once per chunk of items, never per item, so the work itself runs as fast
with a bar as without.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

DELAY_S = 2.0  # a job finished sooner than this never shows a bar
CHUNK = 4096  # items between updates in per-item Python loops
ENV = "MESHTRON_PROGRESS"


def _rank() -> int:
    """This process's rank: the process group's once there is one, else the launcher's ``RANK``
    (torch is not imported for this: CPU tools like preprocessing start without it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


@contextlib.contextmanager
def progress(total: int | None, desc: str, unit: str = "it", unit_scale: bool = False) -> Iterator:
    """A tqdm bar of ``total`` ``unit``s (``update(n)`` per chunk); a disabled bar off rank 0,
    off a terminal or when ``MESHTRON_PROGRESS=0``. If the work turns out larger than ``total``
    (whole epochs past a sample count), the bar ends at what was done."""
    from tqdm import tqdm

    forced = os.environ.get(ENV, "")
    if forced == "0" or _rank() != 0:
        disable = True
    else:
        disable = False if forced == "1" else None  # None: tqdm shows it on a terminal only
    bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=sys.stderr, disable=disable,
               delay=0.0 if forced == "1" else DELAY_S, dynamic_ncols=True)  # fmt: skip
    try:
        yield bar
    finally:
        if total is not None and bar.n > total:
            bar.total = bar.n
        bar.close()
