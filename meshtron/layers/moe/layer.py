"""The mixture-of-experts layer: a drop-in replacement for the MLP of a transformer block.

router -> permute (tokens sorted by expert) -> grouped GEMM experts -> unpermute (weighted sum
of each token's k outputs) [+ shared experts]. Auxiliary losses are recorded on the layer, not
added anywhere: see ``MoELayer.forward``.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.config import ModelConfig
from meshtron.layers.mlp import MLP
from meshtron.layers.moe.balancing import TokenSum, aux_loss_coeff, statistics_needed
from meshtron.layers.moe.dispatch import permute, plan_dispatch, unpermute
from meshtron.layers.moe.experts import Experts
from meshtron.layers.moe.layer_pattern import moe_layer_pattern
from meshtron.layers.moe.router import Router


class MoELayer(nn.Module):
    """x [b, s, h] -> [b, s, h]. Submodules ``router``, ``experts``, optional ``shared_experts``
    (a plain MLP every token passes, DeepSeek's and Qwen-MoE's) and ``shared_expert_gate``, and
    ``token_sum``, which completes the balancing statistics (and sinkhorn's plan) over the whole
    sequence."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.aux_loss_coeff = aux_loss_coeff(cfg, sum(moe_layer_pattern(cfg)))
        self.needed = statistics_needed(cfg.moe_router_load_balancing_type, self.aux_loss_coeff, cfg.moe_z_loss_coeff)
        self.router = Router(cfg)
        self.token_sum = TokenSum()
        self.experts = Experts(cfg)
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_experts = MLP(cfg, width=shared) if shared else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared and cfg.moe_shared_expert_gate else None
        self.last_aux_losses: dict[str, torch.Tensor] = {}
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.rerunning = False  # a checkpoint reruns the layer in backward (set by ``models/recompute.py``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Also sets ``last_aux_losses`` and ``last_tokens_per_expert`` for the model to collect.

        ``last_aux_losses``: {"load_balancing", "z_loss"} (those with a nonzero coefficient),
        differentiable scalars over this call's b*s tokens, already times their coefficients;
        the model adds them to its objective as named auxiliary terms (summed over layers, see
        ``balancing``). ``last_tokens_per_expert`` [E]: integer counts of the copies the experts
        computed (after dropping), for load logging.
        """
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        cfg = self.cfg
        routing = self.router(tokens, b, self.needed, self.token_sum, (self.aux_loss_coeff, cfg.moe_z_loss_coeff))
        if not self.rerunning:  # a rerun's losses, kept, would keep its graph and activations alive (``models/recompute.py``)
            self.last_aux_losses = routing.losses
        plan = plan_dispatch(
            routing.probs, routing.experts, cfg.num_experts, cfg.moe_expert_capacity_factor,
            cfg.moe_token_drop_policy, cfg.moe_pad_expert_input_to_capacity, seq_length=s, fused_kernels=cfg.fused_kernels,
        )  # fmt: skip
        self.last_tokens_per_expert = plan.tokens_per_expert  # integers: no gradient to detach from
        rows = permute(tokens, plan, cfg.fused_kernels)
        if self.shared_experts is None:
            return unpermute(self.experts(rows, plan.group_sizes), plan, b * s, x.dtype, cfg.fused_kernels).view(b, s, h)
        # The experts run the shared ones where that hides the expert-parallel exchange (``Experts``: ``beside``).
        expert_output, shared = self.experts(rows, plan.group_sizes, beside=lambda: self._shared_experts(tokens))
        return (unpermute(expert_output, plan, b * s, x.dtype, cfg.fused_kernels) + shared).view(b, s, h)

    def _shared_experts(self, tokens: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts(tokens)
        if self.shared_expert_gate is not None:
            shared = shared * torch.sigmoid(self.shared_expert_gate(tokens))
        return shared
