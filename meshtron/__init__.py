"""meshtron: train transformer language models from one GPU to thousands."""

__version__ = "0.1.0"
