"""The errors the CLI turns into one clear line (no torch import needed to name them), and how a
misspelling gets a suggested fix."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written; the message names the file or directory."""


class DivergenceError(RuntimeError):
    """The run diverged; the message names the iteration, the rank and, when found, the module."""


def unknown_name(what: str, name: str, known: list[str]) -> str:
    """A message for an unknown ``name``, suggesting the closest of ``known`` (or listing them)."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known: {', '.join(sorted(known))}"
    return f"unknown {what} '{name}'{hint}"
