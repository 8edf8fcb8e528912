"""Fused ops: each a plain-PyTorch reference (the CPU path, and the numbers tests hold kernels to)
and, where it pays, a Triton kernel for NVIDIA and AMD GPUs.

Triton is optional: it is imported only when a kernel is about to run, so this package imports
and runs on a machine without it. ``model.fused_kernels`` picks the path per op:

- ``auto``: the Triton kernel for a GPU tensor when Triton is installed, the reference otherwise;
- ``on``: the Triton kernel always (an error when Triton is missing; on a CPU only under
  ``TRITON_INTERPRET=1``, which is how kernels are tested without a GPU);
- ``off``: the reference everywhere, and the unfused output layer + loss.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Callable

import torch

FUSED_KERNEL_MODES = ("auto", "on", "off")


# Looked up once at import, not behind functools.cache: torch.compile traces ``use_triton`` inside
# compiled blocks, and a plain function returning a constant is what dynamo inlines cleanly.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_INSTALLED


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: the CPU tests), where
    some kernels take their reference's rounding or a simpler launch."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(mode: str, x: torch.Tensor) -> bool:
    """Whether the op on ``x`` should run its Triton kernel under ``model.fused_kernels = mode``."""
    return triton_runs_on(mode, x.device)


def triton_runs_on(mode: str, device: torch.device) -> bool:
    """Whether ops on ``device`` run their Triton kernels under ``model.fused_kernels = mode``."""
    if mode == "off":
        return False
    if mode == "on":
        if not triton_available():
            raise RuntimeError("model.fused_kernels is 'on' but Triton is not installed; pip install triton or use auto")
        return True
    if mode != "auto":
        raise ValueError(f"model.fused_kernels must be one of {FUSED_KERNEL_MODES}, got '{mode}'")
    return device.type == "cuda" and triton_available()


def opaque_op(name: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register the decorated function as the custom op ``name``, one opaque node to
    ``torch.compile`` (which so never traces into Triton or a choice of GEMM), and return a caller
    that goes through the op only while compiling, or for meta tensors (its ``register_fake``
    shapes). Eager calls run the function itself: the custom-op layer cost about twice the
    function's own host time per call (measured on the CPU), and the FP8 casts it wraps are
    launched 96 times a step at B3."""

    def register(fn: Callable) -> Callable:
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args)

        @functools.wraps(fn)
        def call(first: torch.Tensor, *args):
            if torch.compiler.is_compiling() or first.is_meta:
                return op(first, *args)
            return fn(first, *args)

        call.register_fake = op.register_fake
        return call

    return register
