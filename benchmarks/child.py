"""Each benchmark side runs in a child process (clean peak memory, one CUDA context per side) and
reports one ``RESULT {json}`` line on stdout; these two functions are both ends of that."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

PREFIX = "RESULT "


def report(result: dict[str, Any]) -> None:
    """The child's last word: its result as one JSON line."""
    print(PREFIX + json.dumps(result), flush=True)


def run_child(cmd: list[str], name: str) -> dict[str, Any] | None:
    """Run ``cmd``, pass on the end of its stderr, and return its last RESULT (None, said, on failure)."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-4000:])
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        print(f"{name}: failed (exit {proc.returncode}) after {time.perf_counter() - start:.0f}s")
        return None
    return json.loads(lines[-1][len(PREFIX):])
