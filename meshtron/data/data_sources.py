"""Where the data of each split is named: ``--data-path`` divided by ``--split``, or per-split blends.

Megatron's flags, with its meanings: ``--data-args-path FILE`` holds the ``--data-path`` value
(for blends too long for a command line); ``--train-data-path``, ``--valid-data-path`` and
``--test-data-path`` give each split its own blend, written as ``--data-path`` is, whose
datasets go whole to that split; ``--per-split-data-args-path FILE`` holds those three as JSON
(``{"train": ..., "valid": ..., "test": ...}``, each a list or a whitespace-separated string).
The files are read once, when the config is built, into the fields the builder reads. One data
source per run: the two ways, and mock data, exclude each other, and ``--split`` has nothing to
divide beside per-split blends.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshtron.errors import ConfigError

SPLIT_FLAGS = {"train": "--train-data-path", "valid": "--valid-data-path", "test": "--test-data-path"}


def split_blends(d: Any) -> list[list[str]]:
    """The train, valid and test blends of a ``DataConfig`` (empty lists without per-split data)."""
    return [getattr(d, f"{split}_data_path") for split in SPLIT_FLAGS]


def has_per_split_data(d: Any) -> bool:
    return any(split_blends(d))


def names_data(d: Any) -> bool:
    """Whether the run names its data files (else mock data or the embedded corpus)."""
    return bool(d.data_path) or has_per_split_data(d)


def resolve_data_sources(d: Any, split_given: bool) -> None:
    """Read ``--data-args-path`` and ``--per-split-data-args-path`` into a ``DataConfig`` and check
    that it names one data source; ``split_given``: ``--split`` was given explicitly."""
    if d.data_args_path:
        if d.data_path:
            raise ConfigError("--data-path and --data-args-path both name the data; keep one")
        d.data_path = _read(d.data_args_path, "--data-args-path").split()
        if not d.data_path:
            raise ConfigError(f"--data-args-path {d.data_args_path} is empty; it holds the --data-path value (a prefix or weight/prefix pairs)")
    if d.per_split_data_args_path:
        if has_per_split_data(d):
            raise ConfigError("--per-split-data-args-path and --train/valid/test-data-path both name the data; keep one")
        for split, tokens in _read_per_split(d.per_split_data_args_path).items():
            setattr(d, f"{split}_data_path", tokens)
    if not has_per_split_data(d):
        return
    if d.data_path:
        raise ConfigError("--data-path (or --data-args-path) and per-split data (--train/valid/test-data-path, --per-split-data-args-path) "
                          "both name the data; keep one")  # fmt: skip
    if d.mock:
        raise ConfigError("--mock-data and per-split data (--train/valid/test-data-path) are both set; keep one")
    if split_given:
        raise ConfigError("--split divides --data-path's documents; per-split data gives each split its own blend: drop --split")
    if not d.train_data_path:
        raise ConfigError("per-split data without a train blend: add --train-data-path (or a \"train\" entry in --per-split-data-args-path)")


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None


def _read_per_split(path: str) -> dict[str, list[str]]:
    """The JSON file's blends by split; a split it leaves out (or null) has no data."""
    try:
        raw = json.loads(_read(path, "--per-split-data-args-path"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--per-split-data-args-path {path} is not JSON: {exc}") from None
    if not isinstance(raw, dict) or set(raw) - set(SPLIT_FLAGS):
        raise ConfigError(f"--per-split-data-args-path {path} must be a JSON object with keys train, valid, test (each a blend "
                          f"like --data-path's), got {list(raw) if isinstance(raw, dict) else type(raw).__name__}")  # fmt: skip
    out = {}
    for split, value in raw.items():
        if value is None:
            continue
        tokens = value.split() if isinstance(value, str) else value
        if not isinstance(tokens, list) or not all(isinstance(t, (str, int, float)) for t in tokens):
            raise ConfigError(f"--per-split-data-args-path {path}: \"{split}\" must be a list or a string like --data-path's value")
        out[split] = [str(t) for t in tokens]
    return out
