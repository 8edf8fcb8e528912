"""The built-in families, one module each, registered by importing it: one line per family."""

from meshtron.models.families import bert, decoder, ict, t5  # noqa: F401
