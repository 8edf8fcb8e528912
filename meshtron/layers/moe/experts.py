"""The routed experts: E feed-forward networks stored as two stacked weights, run as grouped GEMMs.

Stacked ``weight1`` [E, fc1, h] and ``weight2`` [E, h, ffn] (each expert in nn.Linear layout,
fc1 = 2*ffn with [gate; up] for SwiGLU) let one grouped GEMM serve all experts and let expert
parallelism keep a slice of experts by slicing dim 0. No biases: MoE models run without them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshtron.config import ModelConfig
from meshtron.kernels import use_triton
from meshtron.layers.mlp import ffn_hidden_size, mlp_activation
from meshtron.layers.moe.fp8_grouped_gemm import fp8_experts, fp8_grouped_mm, fp8_grouped_usable
from meshtron.layers.moe.grouped_gemm import grouped_mm

# Parameter-name endings of stacked expert weights; their dim 0 is the expert id. weight2 is a
# residual-branch output, initialized like the dense MLP's linear_fc2.
EXPERT_WEIGHTS = ("experts.weight1", "experts.weight2")


def expert_ffn_hidden_size(cfg: ModelConfig) -> int:
    """Each expert's FFN width: ``--moe-ffn-hidden-size``, else the dense MLP's."""
    return cfg.moe_ffn_hidden_size or ffn_hidden_size(cfg)


class Experts(nn.Module):
    """Expert input [R, h], rows grouped by expert (``group_sizes`` [E]) -> output [R, h].

    ``beside``: work of the layer's that does not depend on the experts (its shared experts),
    handed in so that an expert-parallel replacement can run it while rows travel; the call then
    returns (output, its result). Here it simply runs after the experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        ffn = expert_ffn_hidden_size(cfg)
        fc1_out = 2 * ffn if cfg.activation == "swiglu" else ffn
        self.cfg = cfg
        # Drawn from the global RNG like nn.Linear's; the model re-draws them (models/init.py, expert by expert).
        self.weight1 = nn.Parameter(torch.randn(cfg.num_experts, fc1_out, cfg.hidden_size) * cfg.init_method_std)
        self.weight2 = nn.Parameter(torch.randn(cfg.num_experts, cfg.hidden_size, ffn) * cfg.init_method_std)
        self.grad_accum_fusion = False  # set by apply_gradient_accumulation_fusion

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor, beside: Callable[[], torch.Tensor] | None = None):
        out = expert_ffn(x, self.weight1, self.weight2, group_sizes, self.cfg, self.grad_accum_fusion)
        return out if beside is None else (out, beside())


def expert_ffn(x: torch.Tensor, weight1: torch.Tensor, weight2: torch.Tensor, group_sizes: torch.Tensor, cfg: ModelConfig,
               fuse_wgrad: bool = False) -> torch.Tensor:  # fmt: skip
    """Rows [R, h] grouped by ``group_sizes`` [E'] through the E' experts stacked in ``weight1`` /
    ``weight2`` (all of them, or an expert-parallel rank's slice) -> [R, h]. Call it once per
    forward per weight when ``fuse_wgrad`` (each call reports its weight's gradient as landed)."""
    fuse_wgrad = fuse_wgrad and use_triton(cfg.fused_kernels, x)  # the fused weight gradient is a Triton kernel
    hidden = mlp_activation(_grouped(x, weight1, group_sizes, cfg, fuse_wgrad), cfg)
    return _grouped(hidden, weight2, group_sizes, cfg, fuse_wgrad)


def _grouped(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, cfg: ModelConfig, fuse_wgrad: bool) -> torch.Tensor:
    """One grouped GEMM of the experts: FP8 under ``--fp8-format`` where the shapes allow it, else bf16."""
    if fp8_experts(cfg) and fp8_grouped_usable(x, weight):
        return fp8_grouped_mm(x, weight, group_sizes, cfg.moe_grouped_gemm, cfg.fused_kernels, fuse_wgrad)
    return grouped_mm(x, weight, group_sizes, cfg.moe_grouped_gemm, fuse_wgrad)
