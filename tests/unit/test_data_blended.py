"""Blending: Megatron's greedy order, achieved ratios, delegation and --data-path parsing."""

import numpy as np
import pytest

from meshtron.data.blended import BlendedDataset, build_blending_indices, parse_data_path


def megatron_loop(weights, size):
    """The reference C++ loop, transcribed."""
    current = [0] * len(weights)
    out = []
    for i in range(size):
        target = max(float(i), 1.0)
        errors = [w * target - c for w, c in zip(weights, current)]
        best = errors.index(max(errors))
        out.append((best, current[best]))
        current[best] += 1
    return out


def test_matches_reference_loop_and_ratios():
    weights = [0.2, 0.3, 0.5]
    di, si = build_blending_indices(weights, 1000)
    assert list(zip(di.tolist(), si.tolist())) == megatron_loop(weights, 1000)
    counts = np.zeros(3)
    for i, d in enumerate(di):
        counts[d] += 1
        assert np.all(np.abs(counts - np.array(weights) * (i + 1)) <= 1.0), i
    assert counts.tolist() == [200, 300, 500]


def test_blended_dataset_delegates_and_is_deterministic():
    a = [("a", k) for k in range(400)]
    b = [("b", k) for k in range(800)]
    ds = BlendedDataset([a, b], [1, 3], 1000, seed=1)  # unnormalized weights are normalized
    again = BlendedDataset([a, b], [1, 3], 1000, seed=1)
    items = [ds[i] for i in range(len(ds))]
    assert items == [again[i] for i in range(len(again))]
    assert sum(1 for name, _ in items if name == "a") == 250
    assert [k for name, k in items if name == "b"] == list(range(750))
    assert [k for name, k in items if name == "a"] == list(range(250))


def test_too_small_member_is_an_error():
    with pytest.raises(ValueError, match="needs 500 samples from dataset 1"):
        BlendedDataset([list(range(1000)), list(range(10))], [0.5, 0.5], 1000, seed=0)


def test_parse_data_path():
    assert parse_data_path(["data/x"]) == (["data/x"], [1.0])
    prefixes, weights = parse_data_path(["3", "a", "1", "b"])
    assert prefixes == ["a", "b"] and weights == [0.75, 0.25]
    for bad in (["0.3", "a", "b"], ["a", "b"], []):
        with pytest.raises(ValueError, match="--data-path"):
            parse_data_path(bad)
