"""The error every check of a user's input raises, and how it suggests a fix for a misspelling."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""


def unknown_name(what: str, name: str, known: list[str]) -> str:
    """A message for an unknown ``name``, suggesting the closest of ``known`` (or listing them)."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known: {', '.join(sorted(known))}"
    return f"unknown {what} '{name}'{hint}"
