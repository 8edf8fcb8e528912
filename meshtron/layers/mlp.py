"""The feed-forward block: GELU (GPT) or SwiGLU (Llama); with ``--bias-gelu-fusion`` fc1's bias
joins the GELU in one kernel (``enable_bias_gelu_fusion``).

Parameter names follow Megatron-Core (``linear_fc1``, ``linear_fc2``) so that checkpoint
conversion and tensor-parallel layer swaps can find them by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import ModelConfig
from meshtron.kernels.bias_gelu import bias_gelu
from meshtron.kernels.swiglu import swiglu


def ffn_hidden_size(cfg: ModelConfig) -> int:
    """``cfg.ffn_hidden_size``, or the conventional default when it is 0.

    SwiGLU has three matrices instead of two, so Llama shrinks the width to 2/3 of 4h to keep the
    parameter count of a GELU MLP, then rounds up to a multiple of 256 for GEMM-friendly shapes.
    """
    if cfg.ffn_hidden_size:
        return cfg.ffn_hidden_size
    if cfg.activation == "swiglu":
        width = int(2 * 4 * cfg.hidden_size / 3)
        return 256 * ((width + 255) // 256)
    return 4 * cfg.hidden_size


def gelu_approximation(cfg: ModelConfig) -> str:
    """F.gelu's ``approximate``: tanh for GPT-2's GELU (Megatron's --openai-gelu), else the exact erf form."""
    return "tanh" if cfg.activation == "gelu_tanh" else "none"


def mlp_activation(h: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The MLP's nonlinearity on fc1's output; swiglu halves the width (shared with MoE experts)."""
    if cfg.activation == "swiglu":
        return swiglu(h, cfg.fused_kernels)
    return F.gelu(h, approximate=gelu_approximation(cfg))


class MLP(nn.Module):
    """gelu / gelu_tanh: fc2(gelu(fc1(x))); swiglu: fc2(silu(gate) * up) with [gate; up] = fc1(x).

    SwiGLU's gate and up projections are one fused ``linear_fc1`` (output 2*ffn, gate first) so
    a single GEMM reads the input once, as in Megatron-Core. ``width`` overrides the model's FFN
    width (MoE shared experts have their own).
    """

    def __init__(self, cfg: ModelConfig, width: int = 0):
        super().__init__()
        ffn = width or ffn_hidden_size(cfg)
        self.cfg = cfg
        fc1_out = 2 * ffn if cfg.activation == "swiglu" else ffn
        self.linear_fc1 = nn.Linear(cfg.hidden_size, fc1_out, bias=cfg.add_bias_linear)
        self.linear_fc2 = nn.Linear(ffn, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if getattr(self.linear_fc1, "skip_bias_add", False):  # set by enable_bias_gelu_fusion: the bias is ours to add
            return self.linear_fc2(bias_gelu(h, self.linear_fc1.bias, gelu_approximation(self.cfg), self.cfg.fused_kernels))
        return self.linear_fc2(mlp_activation(h, self.cfg))


def enable_bias_gelu_fusion(blocks: nn.Module) -> int:
    """Megatron's ``--bias-gelu-fusion`` on the GELU MLPs under ``blocks`` that have a bias: their
    ``linear_fc1`` leaves its bias to the MLP (``skip_bias_add``), which adds it inside the fused
    bias + GELU (``kernels/bias_gelu``). Only linears that take the switch get it (meshtron's:
    gradient-accumulation fusion's, FP8's, the column-parallel one); a plain ``nn.Linear`` keeps its
    bias and the MLP its unfused GELU. Returns how many MLPs were switched."""
    switched = 0
    for mlp in blocks.modules():
        gelu = isinstance(mlp, MLP) and mlp.cfg.activation != "swiglu" and mlp.linear_fc1.bias is not None
        if gelu and hasattr(type(mlp.linear_fc1), "skip_bias_add"):
            mlp.linear_fc1.skip_bias_add = True
            switched += 1
    return switched
