"""Every random generator a run draws from, saved per rank beside the tensors (``rng_rank{r}.pt``)
in types that ``torch.load(weights_only=True)`` accepts, so loading them runs no code."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def get_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and the current CUDA device's generator states."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {**np_state, "state": {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"]}},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore ``get_rng_state()``'s result; a CUDA state is applied only where CUDA exists."""
    random.setstate(state["python"])
    np_state = state["numpy"]
    key = np.asarray(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state({**np_state, "state": {"key": key, "pos": np_state["state"]["pos"]}})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
