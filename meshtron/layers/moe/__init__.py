"""Mixture-of-experts layer (router, balancing losses, dispatch, grouped-GEMM experts).

The model builds ``MoELayer(cfg)`` where ``moe_layer_pattern(cfg)`` says so, collects each
layer's ``last_aux_losses`` as named auxiliary terms, and initializes the stacked expert weights
(names ending in ``EXPERT_WEIGHTS``) expert by expert (``models/init.py``). ``moe_config_errors`` joins
the config validation.
"""

from meshtron.layers.moe.experts import EXPERT_WEIGHTS
from meshtron.layers.moe.layer import MoELayer
from meshtron.layers.moe.layer_pattern import moe_layer_pattern
from meshtron.layers.moe.validation import moe_config_errors

__all__ = ["EXPERT_WEIGHTS", "MoELayer", "moe_config_errors", "moe_layer_pattern"]
