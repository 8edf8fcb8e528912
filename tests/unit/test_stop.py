"""The stop signals and the stop flags' checks (the agreement across ranks is drilled in tests/e2e/test_agreed_stop.py)."""

import os
import signal

import pytest
import torch

from meshtron.config import build_config
from meshtron.errors import ConfigError
from meshtron.training.stop import DEADLINE, SIGNAL, StopAgreement, StopSignals, describe
from meshtron.validation import validate


def test_exit_signal_is_caught_then_the_previous_handler_comes_back():
    lines = []
    before = signal.getsignal(signal.SIGUSR1)
    signals = StopSignals("SIGUSR1", lines.append).install()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert signals.received == "SIGUSR1" and lines == ["SIGUSR1: saving and stopping at an iteration all ranks agree on"]
    signals.restore()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_first_ctrl_c_asks_for_a_stop_and_leaves_the_second_to_the_default_action():
    signals = StopSignals("SIGTERM", lambda line: None).install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.received == "SIGINT"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # the next one kills the process
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_one_process_decides_at_once_from_its_signal_and_clock():
    signals = StopSignals("SIGTERM", lambda line: None)
    past = StopAgreement(1, torch.device("cpu"), exit_duration_in_mins=1e-9, start=0.0)
    assert past.agree(past.local_reasons(signals)) == DEADLINE
    signals.received = "SIGTERM"
    assert describe(past.agree(past.local_reasons(signals))) == "signal and wall-clock limit (--exit-duration-in-mins)"
    assert StopAgreement(1, torch.device("cpu"), 0.0, 0.0).local_reasons(signals) == SIGNAL


@pytest.mark.parametrize("flags, message", [
    (["--exit-signal", "SIGKILL"], "--exit-signal must be one of SIGTERM, SIGINT, SIGUSR1, SIGUSR2"),
    (["--exit-duration-in-mins", "-1"], "--exit-duration-in-mins must be >= 0"),
    (["--train-timeout-minutes", "-2"], "--train-timeout-minutes must be >= 0"),
    (["--hang-step-factor", "1.5"], "--hang-step-factor 1.5 would call ordinary step-time noise a hang"),
    (["--straggler-minmax-count", "0"], "--straggler-minmax-count must be >= 1"),
])  # fmt: skip
def test_bad_stop_flags_are_refused_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(build_config(None, ["--mock-data", *flags]))
