"""A model family that exists only to prove the model contract: a decoder whose block runs
attention and the MLP side by side on one norm's output (GPT-J / PaLM's "parallel" block), with
an auxiliary loss on each block's output.

It is written as a new family would be: its modules (reusing meshtron's layers), its plan, its
pipeline pieces, its loss and what one rank of it holds; ``__init__.py`` registers it, and nothing
in ``meshtron/`` knows it exists. ``tests/distributed/test_model_contract.py`` runs it under tp2,
pp2, dp2 and tp2 x pp2 against one process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshtron.config import ModelConfig
from meshtron.layers.attention import Attention, head_dim, num_kv_heads
from meshtron.layers.mlp import MLP
from meshtron.layers.norms import build_norm
from meshtron.layers.output import OutputLayer
from meshtron.layers.rope import rope_frequencies
from meshtron.models import contract as mc
from meshtron.models.init import WeightInit, init_weights

AUX_COEFF = 1e-2


class ParallelBlock(nn.Module):
    """x + attention(norm(x)) + mlp(norm(x)): one norm, both branches on its output."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        self.norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels)
        self.attention = Attention(cfg, layer_number)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos, sin, position_ids=None, document_ids=None) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attention(h, cos, sin, position_ids, document_ids) + self.mlp(h)


class ParallelBlockDecoder(mc.TokenLossModel):
    """Token embedding, parallel blocks, final norm, untied output layer; RoPE positions. The
    tables have ``padded_vocab_size`` rows (0: ``vocab_size``), the padding never a token."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_seq_length: int, padded_vocab_size: int = 0):
        super().__init__()
        self.cfg, self.max_positions, self.hidden_size = cfg, max_seq_length, cfg.hidden_size
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size or vocab_size
        if cfg.recompute_granularity == "full":
            self.recompute = (cfg.recompute_method, cfg.recompute_num_layers)
        self.embedding = nn.Embedding(self.padded_vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(ParallelBlock(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels)
        self.output = OutputLayer(cfg.hidden_size, self.padded_vocab_size, tied=False, fused_kernels=cfg.fused_kernels, vocab_size=vocab_size)
        self.weight_init = WeightInit(cfg.init_method_std, cfg.init_method_std / 4, ("linear_proj.weight", "linear_fc2.weight"))
        init_weights(self, self.weight_init)

    def parallel_plan(self) -> mc.Plan:
        cfg = self.cfg
        kv = num_kv_heads(cfg)
        return [
            ("embedding", mc.VocabParallelEmbedding()),
            ("output", mc.VocabParallelOutput()),
            ("layers.*.attention.linear_qkv", mc.ColumnParallel(mc.GroupedHeads(kv, cfg.num_attention_heads // kv, head_dim(cfg)))),
            ("layers.*.attention.linear_proj", mc.RowParallel()),
            ("layers.*.attention.core_attention", mc.ContextParallelCore()),
            ("layers.*.mlp.linear_fc1", mc.ColumnParallel(mc.Halves(2))),
            ("layers.*.mlp.linear_fc2", mc.RowParallel()),
            ("layers.*.norm", mc.SequenceParallelNorm()),
            ("final_norm", mc.SequenceParallelNorm()),
        ]

    def pipeline_pieces(self) -> mc.PipelinePieces:
        return mc.PipelinePieces(("embedding",), "layers", ("final_norm", "output"))

    def embed(self, batch: mc.Batch) -> mc.Carry:
        return {"hidden": self.embedding(batch["tokens"])}

    def block_inputs(self, batch: mc.Batch) -> dict[str, Any]:
        cos, sin = rope_frequencies(head_dim(self.cfg), self.max_positions, device=batch["tokens"].device)
        return {"cos": cos, "sin": sin, "position_ids": batch.get("position_ids")}

    def run_blocks(self, carry, inputs, blocks):
        hidden, aux = carry["hidden"], {}
        for block in blocks:
            hidden = block(hidden, **inputs)
            # A per-layer penalty on the block's output: an auxiliary term arising on every stage.
            aux[f"activation/{block.attention.layer_number}"] = AUX_COEFF * hidden.float().square().mean()
        return {"hidden": hidden}, aux

    def head(self, carry: mc.Carry, batch: mc.Batch) -> torch.Tensor:
        return self.output(self.final_norm(carry["hidden"]), batch["labels"])
