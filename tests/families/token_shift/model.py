"""A tiny family that shows what adding one takes: an attention-free language model whose blocks
move each token's features toward the previous token's (RWKV's token shift) ahead of an MLP, with
the input embedding tied to the output layer (a piece both pipeline ends hold).

This module is the model, its plan and what a rank of it holds; ``__init__.py`` registers it.
Nothing in ``meshtron/`` names it: it trains, saves, reshards and is estimated through its spec
(``tests/unit/test_family_registry.py``), and matches one process under tp2, pp2, dp2 and tp2 x
pp2 (``tests/distributed/test_model_contract.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import ModelConfig
from meshtron.layers.mlp import MLP
from meshtron.layers.norms import build_norm
from meshtron.layers.output import OutputLayer
from meshtron.models import contract as mc
from meshtron.models.init import WeightInit, init_weights


class TokenShift(nn.Module):
    """``x + w * (x[t-1] - x)`` per channel (the first token's predecessor is zero): causal, and
    reaching across positions, so a sequence cut over ranks (sp, cp) would lose its boundaries."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        previous = F.pad(x, (0, 0, 1, 0))[:, :-1]
        return x + self.weight * (previous - x)


class ShiftBlock(nn.Module):
    """x + mlp(norm(shift(x)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.shift = TokenShift(cfg.hidden_size)
        self.norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(self.shift(x)))


class TokenShiftLM(mc.TokenLossModel):
    """Token embedding, shift blocks, final norm, the embedding as the output layer's weight."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_seq_length: int, padded_vocab_size: int = 0):
        super().__init__()
        self.cfg, self.max_positions, self.hidden_size = cfg, max_seq_length, cfg.hidden_size
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size or vocab_size
        self.embedding = nn.Embedding(self.padded_vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(ShiftBlock(cfg) for _ in range(cfg.num_layers))
        self.final_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels)
        self.output = OutputLayer(cfg.hidden_size, self.padded_vocab_size, tied=True, fused_kernels=cfg.fused_kernels, vocab_size=vocab_size)
        self.weight_init = WeightInit.scaled_by_depth(cfg.init_method_std, cfg.num_layers, ("linear_fc2.weight",))
        init_weights(self, self.weight_init)

    def parallel_plan(self) -> mc.Plan:
        fc1 = mc.Halves(2) if self.cfg.activation == "swiglu" else mc.Contiguous()
        return [
            ("embedding", mc.VocabParallelEmbedding()),
            ("output", mc.VocabParallelOutput()),
            ("layers.*.mlp.linear_fc1", mc.ColumnParallel(fc1)),
            ("layers.*.mlp.linear_fc2", mc.RowParallel()),
        ]

    def pipeline_pieces(self) -> mc.PipelinePieces:
        return mc.PipelinePieces(("embedding",), "layers", ("final_norm", "output", "embedding"))

    def embed(self, batch: mc.Batch) -> mc.Carry:
        return {"hidden": self.embedding(batch["tokens"])}

    def block_inputs(self, batch: mc.Batch) -> dict[str, Any]:
        return {}

    def run_blocks(self, carry, inputs, blocks):
        hidden = carry["hidden"]
        for block in blocks:
            hidden = block(hidden)
        return {"hidden": hidden}, {}

    def head(self, carry: mc.Carry, batch: mc.Batch) -> torch.Tensor:
        return self.output(self.final_norm(carry["hidden"]), batch["labels"], tied_weight=self.embedding.weight)
