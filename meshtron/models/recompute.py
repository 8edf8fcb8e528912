"""What the modules a checkpoint reruns in backward must know: ``torch.utils.checkpoint``'s
``context_fn`` for full recompute and ``--moe-layer-recompute``.

- FP8 delayed scaling casts with the scales the forward used (``kernels/fp8_recompute.py``);
- a mixture-of-experts layer keeps no auxiliary losses from the rerun (``MoELayer.rerunning``).
  The model collected the forward's; the rerun's, kept on the layer until its next forward, would
  keep the rerun's graph from them back to the block's input alive, and with it the activations
  it saved: the router's, the pre-MLP norm's and, under full recompute, the attention's. The
  backward would then hold one such set more for every MoE block it has passed (DeepSeek-V2-Lite
  x 27 at 16k tokens a micro batch: about 16 GiB per rank, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

from torch import nn

from meshtron.kernels.fp8_recompute import recompute_contexts as fp8_contexts
from meshtron.layers.moe.layer import MoELayer


def recompute_contexts(modules: Iterable[nn.Module]) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(forward context, recompute context) for a checkpoint over ``modules``."""
    modules = list(modules)
    forward, fp8_rerun = fp8_contexts(modules)
    layers = [m for module in modules for m in module.modules() if isinstance(m, MoELayer)]
    return forward, _rerun(fp8_rerun, layers)


@contextlib.contextmanager
def _rerun(fp8_rerun: contextlib.AbstractContextManager, layers: list[MoELayer]) -> Iterator[None]:
    with fp8_rerun:
        for layer in layers:
            layer.rerunning = True
        try:
            yield
        finally:
            for layer in layers:
                layer.rerunning = False
