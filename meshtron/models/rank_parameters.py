"""The parameters one rank holds under a layout, without building the model (``meshtron estimate``).

Each piece is split as the family's parallel plan splits it: linears by heads or features over tp
(a column-parallel bias too, a row-parallel bias whole; full-width q/k norms with their heads),
the vocabulary by rows (the output bias with it), while norms, routers, shared experts and MLA's down-projections and latent norms stay
whole. That is the *dense* part, which reduces (and shards) over dp x cp. The routed experts are
the *expert* part: ``E / ep`` experts per rank, each split over etp, reducing over the
expert-data-parallel group. Pieces come in pipeline order: ``head`` (what the first stage adds:
embeddings), one count per block, ``tail`` (what the last stage adds: final norms, heads, output
layer). At tp = ep = etp = 1 they add up to ``parameter_count``.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.config import ModelConfig, encoder_decoder_layers
from meshtron.layers.attention import head_dim, num_kv_heads, qk_norm_widths
from meshtron.layers.mlp import ffn_hidden_size
from meshtron.layers.moe.experts import expert_ffn_hidden_size
from meshtron.layers.moe.layer_pattern import moe_layer_pattern
from meshtron.models.bert import tokentype_rows
from meshtron.models.registry import spec_for


@dataclass(frozen=True)
class BlockParameters:
    """One block's parameters on one rank: ``dense`` (split by tp) and ``expert`` (routed experts)."""

    dense: int
    expert: int = 0


@dataclass(frozen=True)
class RankParameters:
    """``head`` + ``blocks`` + ``tail`` of one tp/ep/etp rank (all of them when pp is 1)."""

    head: int
    blocks: list[BlockParameters]
    tail: int

    @property
    def total(self) -> int:
        return self.head + self.tail + sum(b.dense + b.expert for b in self.blocks)


def _norm(cfg: ModelConfig, dim: int) -> int:
    return dim * (2 if cfg.normalization == "LayerNorm" else 1)


def _column(fan_in: int, fan_out: int, bias: int, tp: int) -> int:
    return (fan_in * fan_out + bias * fan_out) // tp


def _row(fan_in: int, fan_out: int, bias: int, tp: int) -> int:
    return fan_in * fan_out // tp + bias * fan_out


def _attention(cfg: ModelConfig, tp: int) -> int:
    """Self-attention of one rank: whole heads (kv heads one per rank when fewer than tp); MLA by
    heads after its down-projections and latent norms, which every rank holds whole."""
    h, heads, bias = cfg.hidden_size, cfg.num_attention_heads, int(cfg.add_bias_linear)
    if cfg.multi_latent_attention:
        rank, rope = cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim
        latent_norm = (lambda dim: _norm(cfg, dim)) if cfg.qk_layernorm else (lambda dim: 0)
        q_out, lora = heads * (cfg.qk_head_dim + rope), cfg.q_lora_rank
        query = h * lora + latent_norm(lora) + lora * q_out // tp if lora else h * q_out // tp
        key_value = h * (rank + rope) + latent_norm(rank) + rank * heads * (cfg.qk_head_dim + cfg.v_head_dim) // tp
        return query + key_value + _row(heads * cfg.v_head_dim, h, bias, tp)
    d, kv = head_dim(cfg), num_kv_heads(cfg)
    kv_per_rank = kv // tp if kv % tp == 0 else 1
    qkv_bias = int(cfg.add_bias_linear or cfg.add_qkv_bias)
    qk_norms = _norm(cfg, sum(qk_norm_widths(cfg))) if cfg.qk_layernorm else 0  # whole on every rank: one head's
    if cfg.qk_layernorm and cfg.qk_layernorm_span == "full":  # split with the heads
        qk_norms = heads * d // tp + kv_per_rank * d
    return _column(h, heads * d, qkv_bias, tp) + 2 * kv_per_rank * d * (h + qkv_bias) + _row(heads * d, h, bias, tp) + qk_norms


def _mlp(cfg: ModelConfig, ffn: int, bias: int, split: int) -> int:
    fc1_out = 2 * ffn if cfg.activation == "swiglu" else ffn
    return _column(cfg.hidden_size, fc1_out, bias, split) + _row(ffn, cfg.hidden_size, bias, split)


def _block(cfg: ModelConfig, is_moe: bool, tp: int, ep: int, etp: int) -> BlockParameters:
    """A transformer block: its two norms, attention and MLP or mixture of experts (router, shared
    experts and their gate whole on every rank; routed experts ``E / ep`` per rank, split by etp)."""
    h, bias = cfg.hidden_size, int(cfg.add_bias_linear)
    dense = 2 * _norm(cfg, h) + _attention(cfg, tp)
    if not is_moe:
        return BlockParameters(dense + _mlp(cfg, ffn_hidden_size(cfg), bias, tp))
    shared = cfg.moe_shared_expert_intermediate_size
    dense += cfg.num_experts * h + (_mlp(cfg, shared, bias, 1) if shared else 0) + (h if shared and cfg.moe_shared_expert_gate else 0)
    return BlockParameters(dense, cfg.num_experts // ep * _mlp(cfg, expert_ffn_hidden_size(cfg), 0, etp))


def _positions(cfg: ModelConfig, max_seq_length: int) -> int:
    return 0 if cfg.position_embedding_type == "rope" else (cfg.max_position_embeddings or max_seq_length) * cfg.hidden_size


def rank_parameters(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0, tp: int = 1, ep: int = 1, etp: int = 1) -> RankParameters:
    """This rank's parameters of the model ``build_model(cfg, vocab_size, max_seq_length)`` under
    tensor parallelism ``tp``, expert parallelism ``ep`` and expert tensor parallelism ``etp``
    (its family's ``rank_parameters``)."""
    return spec_for(cfg).rank_parameters(cfg, vocab_size, max_seq_length, tp, ep, etp)


def _embeddings(cfg: ModelConfig, vocab_size: int, max_seq_length: int, tp: int) -> int:
    """The first stage's token table (split by vocabulary) and learned positions (whole)."""
    return vocab_size * cfg.hidden_size // tp + _positions(cfg, max_seq_length)


def _output(cfg: ModelConfig, vocab_size: int, tp: int) -> int:
    return 0 if cfg.tie_embeddings else vocab_size * cfg.hidden_size // tp


def decoder_rank_parameters(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0, tp: int = 1, ep: int = 1,
                            etp: int = 1) -> RankParameters:  # fmt: skip
    blocks = [_block(cfg, is_moe, tp, ep, etp) for is_moe in moe_layer_pattern(cfg)]
    return RankParameters(_embeddings(cfg, vocab_size, max_seq_length, tp), blocks, _norm(cfg, cfg.hidden_size) + _output(cfg, vocab_size, tp))


def t5_rank_parameters(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0, tp: int = 1, ep: int = 1, etp: int = 1) -> RankParameters:
    """Encoder blocks (the last with the encoder's final norm), then decoder blocks."""
    h, bias, norm = cfg.hidden_size, int(cfg.add_bias_linear), _norm(cfg, cfg.hidden_size)
    encoder, decoder = encoder_decoder_layers(cfg)
    block = _block(cfg, False, tp, 1, 1).dense
    width = cfg.num_attention_heads * head_dim(cfg)
    cross = _column(h, width, bias, tp) + _column(h, 2 * width, bias, tp) + _row(width, h, bias, tp)
    blocks = [BlockParameters(block + norm * (i == encoder - 1)) for i in range(encoder)]
    blocks += [BlockParameters(block + norm + cross)] * decoder
    tail = norm + vocab_size // tp + _output(cfg, vocab_size, tp)
    return RankParameters(_embeddings(cfg, vocab_size, max_seq_length, tp), blocks, tail)


def bert_rank_parameters(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0, tp: int = 1, ep: int = 1, etp: int = 1) -> RankParameters:
    """Token types; LM head (dense, norm) whole, output bias by vocabulary; binary head whole."""
    h, norm = cfg.hidden_size, _norm(cfg, cfg.hidden_size)
    blocks = [_block(cfg, is_moe, tp, ep, etp) for is_moe in moe_layer_pattern(cfg)]
    binary = (h * h + h) + (2 * h + 2) if cfg.bert_binary_head else 0
    head = _embeddings(cfg, vocab_size, max_seq_length, tp) + tokentype_rows(cfg) * h
    return RankParameters(head, blocks, norm + h * h + h + norm + vocab_size // tp + _output(cfg, vocab_size, tp) + binary)


def ict_rank_parameters(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0, tp: int = 1, ep: int = 1, etp: int = 1) -> RankParameters:
    """Two towers (or one shared), BERT encoders without an output layer, each with its projection."""
    h, norm = cfg.hidden_size, _norm(cfg, cfg.hidden_size)
    blocks = [_block(cfg, is_moe, tp, ep, etp) for is_moe in moe_layer_pattern(cfg)]
    towers, dim = 1 if cfg.biencoder_shared_query_context_model else 2, cfg.biencoder_projection_dim
    projection = h * dim + dim if dim else 0
    head = _embeddings(cfg, vocab_size, max_seq_length, tp) + tokentype_rows(cfg) * h
    return RankParameters(towers * head, blocks * towers, towers * (norm + projection))
