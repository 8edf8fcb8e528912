"""A rank that stops (SIGSTOP: alive, silent) is named by the others, which print their stacks
and exit within the training timeout plus 30 s instead of waiting out the collective timeout."""

import signal
import time

import pytest

from tests.e2e.ranks import Ranks
from tests.e2e.test_agreed_stop import ARGS

pytestmark = pytest.mark.slow
TIMEOUT_S = 15


def test_sigstop_of_one_rank_is_named_and_the_others_exit_in_time(tmp_path):
    run = Ranks([*ARGS, "--train-iters", "100000", "--train-timeout-minutes", str(TIMEOUT_S / 60)], 2, tmp_path)
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
