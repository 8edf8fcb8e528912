"""Layout-invariant initialization, shared by every model family."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from meshtron.layers.norms import RMSNorm


@torch.no_grad()
def init_by_name(model: nn.Module, std: float, residual_std: float, residual_suffixes: tuple[str, ...],
                 seed: int | None = None) -> None:  # fmt: skip
    """Megatron-style init: N(0, std) weights (``residual_std`` for names ending in
    ``residual_suffixes``, the blocks' output projections), zero biases, unit norm gains.

    Each tensor is drawn from its own generator keyed by ``seed`` (default: the seed given to
    ``torch.manual_seed``) and its parameter name. A weight thus depends on nothing but the seed
    and its name: not on construction order, on how many random numbers were drawn before, or on
    which other layers exist (a pipeline stage holding layers 8-15 gets the same weights as the
    full model). Drawn on the parameter's device; a model on the ``meta`` device (shapes only, as
    ``hf-export`` builds it) is left undrawn.
    """
    seed = torch.initial_seed() if seed is None else seed
    norm_params = {id(p) for m in model.modules() if isinstance(m, (nn.LayerNorm, RMSNorm)) for p in m.parameters()}
    for name, param in model.named_parameters():
        if param.is_meta:
            continue
        if id(param) in norm_params:
            param.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            key = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
            generator = torch.Generator(device=param.device).manual_seed(key)
            param.normal_(0.0, residual_std if name.endswith(residual_suffixes) else std, generator=generator)
