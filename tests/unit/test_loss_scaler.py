"""Dynamic loss scaling follows Megatron's growth / hysteresis / backoff rule step by step."""

import pytest

from meshtron.optim.loss_scaler import ConstantLossScaler, DynamicLossScaler

# (found_inf, scale after the update) with initial 8, growth every 3 clean steps, hysteresis 2.
PATTERN = [
    (False, 8), (False, 8), (False, 16),  # 3 clean steps grow the scale
    (True, 16),  # first overflow spends hysteresis only
    (True, 8), (True, 4),  # hysteresis spent: every overflow backs off
    (False, 4), (False, 4), (False, 8),  # growth refills hysteresis
    (True, 8), (False, 8), (False, 8),  # overflow resets the clean-step count...
    (True, 4),  # ...and the second overflow since growth backs off
    (False, 4), (False, 4), (False, 8),
]


def make():
    return DynamicLossScaler(initial_scale=8, min_scale=1, growth_interval=3, hysteresis=2)


def test_scale_sequence_under_overflows():
    scaler = make()
    got = []
    for found_inf, _ in PATTERN:
        scaler.update(found_inf)
        got.append(scaler.scale)
    assert got == [s for _, s in PATTERN]


def test_backoff_stops_at_min_scale():
    scaler = DynamicLossScaler(initial_scale=4, min_scale=2, hysteresis=1)
    for expected in (2, 2, 2):
        scaler.update(True)
        assert scaler.scale == expected


def test_state_dict_round_trip_continues_identically():
    a = make()
    for found_inf, _ in PATTERN[:10]:
        a.update(found_inf)
    b = make()
    b.load_state_dict(a.state_dict())
    for found_inf, _ in PATTERN[10:]:
        a.update(found_inf)
        b.update(found_inf)
        assert a.scale == b.scale


def test_constant_scaler_never_changes():
    scaler = ConstantLossScaler(1.0)
    scaler.update(True)
    scaler.load_state_dict({"scale": 1024.0})
    assert scaler.scale == 1.0 and scaler.state_dict() == {"scale": 1.0}


def test_rejects_bad_parameters():
    with pytest.raises(ValueError):
        DynamicLossScaler(initial_scale=1, min_scale=2)
    with pytest.raises(ValueError):
        DynamicLossScaler(hysteresis=0)
