"""A rank that stops (SIGSTOP: alive, silent) is named by the others, which print their stacks and
the collectives they wait in (PyTorch's flight recorder, which gloo keeps too, dumped to a file)
and exit within the training timeout plus 30 s instead of waiting out the collective timeout."""

import pickle
import re
import signal
import time

import pytest

from tests.e2e.ranks import Ranks
from tests.e2e.test_agreed_stop import ARGS

pytestmark = pytest.mark.slow
TIMEOUT_S = 15


def test_sigstop_of_one_rank_is_named_and_the_others_exit_in_time(tmp_path):
    dumps = tmp_path / "fr" / "rank_"
    run = Ranks([*ARGS, "--train-iters", "100000", "--train-timeout-minutes", str(TIMEOUT_S / 60)], 2, tmp_path,
                env={"TORCH_FR_DUMP_TEMP_FILE": str(dumps)})  # fmt: skip
    run.wait_for("iteration       3/")
    run.procs[1].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    while run.procs[0].poll() is None and time.monotonic() - stopped < TIMEOUT_S + 60:
        time.sleep(0.2)
    took = time.monotonic() - stopped
    codes = run.wait(timeout=0)  # rank 1 is killed here (SIGKILL ends a stopped process)
    out = run.output(0)
    assert codes[0] == 4, out[-3000:]
    assert took < TIMEOUT_S + 30, took
    assert "rank 0: hang: iteration" in out and "over the --train-timeout-minutes 0.25" in out, out[-3000:]
    assert "ranks that did not arrive: 1 (no heartbeat" in out
    assert 'Thread 0x' in out and 'File "' in out  # this rank's stacks
    assert "rank 0: flight recorder: " in out and f"collectives written to {dumps}0 (every rank's: python -m" in out, out[-3000:]
    waits = re.search(r"rank 0: flight recorder: process group \d+ \((\w+)\) completed #\d+, waits in #\d+ gloo:all_reduce", out)
    assert waits and waits.group(1) in ("dp", "tp", "default_pg"), out[-3000:]  # the group the gradients or the stop flag wait in
    trace = pickle.loads((tmp_path / "fr" / "rank_0").read_bytes())
    assert trace["entries"] and any(s["last_enqueued_collective"] > s["last_completed_collective"] for s in trace["pg_status"].values())
