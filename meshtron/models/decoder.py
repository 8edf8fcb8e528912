"""The decoder-only transformer behind every GPT and Llama preset.

Read top to bottom: token (+ learned position) embedding, ``num_layers`` pre-norm blocks of
attention and MLP, a final norm, and the output projection (the embedding matrix itself when
tied). It is an ordinary ``nn.Module``; parallelism is applied from outside by swapping its
linear layers, so nothing here knows about ranks.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtron.config import ModelConfig
from meshtron.kernels.cross_entropy import linear_cross_entropy
from meshtron.layers.attention import Attention, head_dim, num_kv_heads
from meshtron.layers.kv_cache import KVCache
from meshtron.layers.mlp import MLP, ffn_hidden_size
from meshtron.layers.norms import RMSNorm, build_norm
from meshtron.layers.rope import rope_frequencies

# Output projections of each block: initialized with std / sqrt(2 * num_layers) so the residual
# stream's variance does not grow with depth (GPT-2, Megatron's ``output_layer_init_method``).
_RESIDUAL_OUTPUTS = ("linear_proj.weight", "linear_fc2.weight")


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), dropout on each branch."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        self.input_layernorm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels)
        self.self_attention = Attention(cfg, layer_number)
        self.pre_mlp_layernorm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x), cos, sin, position_ids, document_ids, kv_cache)
        x = x + self.dropout(attn)
        return x + self.dropout(self.mlp(self.pre_mlp_layernorm(x)))


class Decoder(nn.Module):
    """GPT/Llama decoder over a vocabulary of ``vocab_size`` (already padded by the caller).

    ``max_seq_length`` sizes the position tables when ``cfg.max_position_embeddings`` is 0.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_seq_length: int):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.max_positions = cfg.max_position_embeddings or max_seq_length
        self.use_rope = cfg.position_embedding_type == "rope"
        self.embedding = nn.Embedding(vocab_size, cfg.hidden_size)
        self.position_embedding = None if self.use_rope else nn.Embedding(self.max_positions, cfg.hidden_size)
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        # RoPE tables stay fp32 and out of the state dict: a buffer would be cast to bf16 along
        # with the weights by ``model.to(torch.bfloat16)``. Built per device on first use.
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.init_weights()

    def init_weights(self, seed: int | None = None) -> None:
        """Megatron-style init: N(0, std) weights (residual outputs scaled), zero biases, unit norms.

        Each tensor is drawn from its own generator keyed by ``seed`` (default: the seed given to
        ``torch.manual_seed``) and its parameter name. A weight thus depends on nothing but the
        seed and its name: not on construction order, on how many random numbers were drawn
        before, or on which other layers exist (a pipeline stage holding layers 8-15 gets the
        same weights as the full model). Drawn on the parameter's device.
        """
        seed = torch.initial_seed() if seed is None else seed
        norm_params = {id(p) for m in self.modules() if isinstance(m, (nn.LayerNorm, RMSNorm)) for p in m.parameters()}
        residual_std = self.cfg.init_method_std / math.sqrt(2 * self.cfg.num_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if id(param) in norm_params:
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    param.zero_()
                else:
                    std = residual_std if name.endswith(_RESIDUAL_OUTPUTS) else self.cfg.init_method_std
                    key = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
                    param.normal_(0.0, std, generator=torch.Generator(device=param.device).manual_seed(key))

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """tokens [b, s] -> per-token loss [b, s] (fp32) when ``labels`` is given, else logits [b, s, V].

        ``position_ids`` [b, s] restart at each packed document (``--reset-position-ids``);
        ``document_ids`` [b, s] keep attention inside a document (``--reset-attention-mask``).
        With ``kv_cache``, tokens continue the cached sequence and positions default to follow it.
        """
        b, s = tokens.shape
        if kv_cache is not None:
            if document_ids is not None:
                raise ValueError("document_ids cannot be combined with a KV cache")
            if position_ids is None:
                position_ids = torch.arange(kv_cache.length, kv_cache.length + s, device=tokens.device).expand(b, s)
        hidden = self.embedding(tokens)
        if self.position_embedding is not None:
            positions = position_ids if position_ids is not None else torch.arange(s, device=tokens.device)
            hidden = hidden + self.position_embedding(positions)
        hidden = self.embedding_dropout(hidden)
        cos, sin = self.rope_tables(tokens.device) if self.use_rope else (None, None)
        hidden = self.run_layers(hidden, cos, sin, position_ids, document_ids, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(s)
        hidden = self.final_norm(hidden)
        if labels is None:
            return self.logits(hidden)
        return self.output_loss(hidden, labels)

    def run_layers(self, hidden: torch.Tensor, *args) -> torch.Tensor:
        """The blocks in order (``args``: what each block takes after ``hidden``).

        With ``--recompute-granularity full`` and gradients on, blocks run inside activation
        checkpoints, which keep only their input and rerun the forward during backward (same
        random state, so the gradients are those of a plain run). ``uniform``: every run of
        ``recompute_num_layers`` blocks is one checkpoint. ``block``: the first
        ``recompute_num_layers`` blocks are checkpointed one by one, the rest keep their activations.
        """
        c = self.cfg
        if c.recompute_granularity != "full" or not torch.is_grad_enabled():
            return self._run_span(0, len(self.layers), hidden, *args)
        n = c.recompute_num_layers
        if c.recompute_method == "uniform":
            for start in range(0, len(self.layers), n):
                hidden = checkpoint(self._run_span, start, start + n, hidden, *args, use_reentrant=False)
            return hidden
        for i in range(min(n, len(self.layers))):
            hidden = checkpoint(self._run_span, i, i + 1, hidden, *args, use_reentrant=False)
        return self._run_span(n, len(self.layers), hidden, *args)

    def _run_span(self, start: int, end: int, hidden: torch.Tensor, *args) -> torch.Tensor:
        for layer in self.layers[start:end]:
            hidden = layer(hidden, *args)
        return hidden

    def rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (cos, sin) [max_positions, head_dim] on ``device``, computed once per device."""
        if self._rope_tables is None or self._rope_tables[0].device != device:
            c = self.cfg
            self._rope_tables = rope_frequencies(
                head_dim(c), self.max_positions, c.rotary_base, c.rope_scaling, c.rope_scaling_factor,
                c.rope_low_freq_factor, c.rope_high_freq_factor, c.rope_original_max_position_embeddings, device,
            )  # fmt: skip
        return self._rope_tables

    def output_weight(self) -> torch.Tensor:
        """The output projection [V, h]: the embedding matrix when tied."""
        return self.embedding.weight if self.output is None else self.output.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.output_weight())

    def output_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy [b, s] in fp32 (label -100 gives 0).

        Unless ``fused_kernels`` is off, the [b, s, V] logits are never held at once (see
        ``meshtron.kernels.cross_entropy``); subclasses that shard the vocabulary override this.
        """
        return linear_cross_entropy(hidden, self.output_weight(), labels, self.cfg.fused_kernels)


def num_parameters(model: Decoder, exclude_embeddings: bool = False) -> int:
    """Parameters of ``model`` (a tied matrix counted once).

    ``exclude_embeddings`` leaves out the token and position tables and an untied output layer,
    the "non-embedding" count used in scaling laws.
    """
    total = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        tables = (model.embedding, model.position_embedding, model.output)
        total -= sum(p.numel() for m in tables if m is not None for p in m.parameters())
    return total


def parameter_count(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0) -> int:
    """What ``num_parameters(Decoder(cfg, vocab_size, max_seq_length))`` returns, without building it.

    For sizing models that do not fit in memory (presets, the memory estimator).
    """
    h, bias = cfg.hidden_size, int(cfg.add_bias_linear)
    norm = h * (2 if cfg.normalization == "LayerNorm" else 1)
    qkv_out = (cfg.num_attention_heads + 2 * num_kv_heads(cfg)) * head_dim(cfg)
    attention = h * qkv_out + bias * qkv_out + cfg.num_attention_heads * head_dim(cfg) * h + bias * h
    ffn = ffn_hidden_size(cfg)
    fc1_out = 2 * ffn if cfg.activation == "swiglu" else ffn
    mlp = h * fc1_out + bias * fc1_out + ffn * h + bias * h
    layer = 2 * norm + attention + mlp
    positions = 0 if cfg.position_embedding_type == "rope" else (cfg.max_position_embeddings or max_seq_length) * h
    output = 0 if cfg.tie_embeddings else vocab_size * h
    return vocab_size * h + positions + cfg.num_layers * layer + norm + output
