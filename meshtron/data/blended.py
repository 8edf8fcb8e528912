"""Weighted blends of datasets, sample by sample, with Megatron-LM's greedy blending order."""

from __future__ import annotations

import functools

import numpy as np
import torch


def parse_data_path(tokens: list[str]) -> tuple[list[str], list[float]]:
    """``["prefix"]`` or ``["0.3", "a", "0.7", "b"]`` -> (prefixes, weights normalized to sum 1)."""
    if not tokens:
        raise ValueError("--data-path is empty; give a prefix or weight/prefix pairs")
    if len(tokens) == 1:
        return [tokens[0]], [1.0]
    if len(tokens) % 2:
        raise ValueError(f"--data-path with several entries must be weight/prefix pairs like '0.3 a 0.7 b', got {tokens}")
    try:
        weights = [float(w) for w in tokens[0::2]]
    except ValueError:
        raise ValueError(f"--data-path with several entries must be weight/prefix pairs like '0.3 a 0.7 b', got {tokens}") from None
    if min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"--data-path weights must be non-negative with a positive sum, got {weights}")
    total = sum(weights)
    return list(tokens[1::2]), [w / total for w in weights]


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each sample, the dataset whose achieved count lags its target ``weight * max(i, 1)`` most.

    Returns read-only (dataset index, sample index within that dataset); ties go to the lower
    dataset index. Memoized: the builder sizes members from the same arrays the blend then uses.
    """
    return _blending_indices(tuple(float(x) for x in weights), int(size))


@functools.lru_cache(maxsize=8)
def _blending_indices(w: tuple[float, ...], size: int) -> tuple[np.ndarray, np.ndarray]:
    counts = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    order = range(len(w))
    for i in range(size):
        target = max(i, 1)
        best = max(order, key=lambda d: (w[d] * target - counts[d], -d))
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    dataset_index.flags.writeable = False
    dataset_sample_index.flags.writeable = False
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``; ``seed`` is kept for the description."""

    def __init__(self, datasets: list, weights: list[float], size: int, seed: int):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendedDataset needs one weight per dataset, got {len(datasets)} datasets and {len(weights)} weights")
        total = float(sum(weights))
        self.datasets, self.weights, self.size, self.seed = datasets, [w / total for w in weights], size, seed
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, size)
        for d, ds in enumerate(datasets):
            used = self.dataset_sample_index[self.dataset_index == d]
            if used.size and int(used.max()) >= len(ds):
                raise ValueError(f"blend needs {int(used.max()) + 1} samples from dataset {d} but it has {len(ds)}; build it larger")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        if not 0 <= i < self.size:
            raise IndexError(f"blended sample {i} out of range [0, {self.size})")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
