"""T5 (Megatron's ``pretrain_t5.py`` model): an encoder–decoder trained by span corruption.

Read top to bottom: one word embedding and one table of learned absolute positions, shared by
both stacks (Megatron's T5 keeps one ``LanguageModelEmbedding``); ``encoder_num_layers`` blocks of
the decoder's ``TransformerBlock`` with bidirectional attention over the real encoder tokens, the
last followed by the encoder's final norm; ``decoder_num_layers`` blocks of causal self-attention,
cross-attention to the encoder's output (``layers/cross_attention.py``) and the MLP; the decoder's
final norm and the LM head: the output projection tied to the embedding, with a vocabulary bias
(Megatron's ``T5LMHead``). Pre-LN, LayerNorm, GELU and biases as Megatron's T5 (a T5 v1.0-like
variant with absolute positions, not Hugging Face's T5 with relative position buckets, RMSNorm
without biases and its tied logits scaled by 1/sqrt(hidden), so no Hugging Face import).

``--position-embedding-type relative`` replaces the absolute positions by T5's relative position
buckets (``layers/relative_position.py``): one learned table [buckets, heads] per stack,
bidirectional buckets in the encoder, causal ones in the decoder's self-attention (none in
cross-attention), each stack's bias added to the scores of all its blocks. The encoder's table is
a piece of the first pipeline stage, the decoder's of the last, so pp 2 runs encoder | decoder.

The loss is cross-entropy over the decoder's labels where ``loss_mask`` is set, ``total`` /
``count`` as every token-loss model's. Its batch is ``meshtron.data.t5_dataset``'s:
``encoder_tokens``, ``decoder_tokens``, ``labels``, ``loss_mask``, ``encoder_padding_mask``
(``decoder_padding_mask`` is not read: padding follows the real decoder tokens, which causal
attention never lets them see).

Pipeline: the blocks are one sequence, encoder then decoder (``layers.0 ..`` encoder, then the
decoder's), so pp 2 with as many of each puts the encoder on stage 0 and the decoder on stage 1.
The carry between stages holds both streams, ``{"encoder", "decoder"}``: the first stage embeds
both; encoder stages carry the embedded decoder input through, decoder stages the encoder's
(normed) output. The encoder's final norm lives in its last block, so whichever stage runs that
block norms the output every decoder block reads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshtron.config import Config, ModelConfig, encoder_decoder_layers
from meshtron.layers.attention import head_dim, num_kv_heads
from meshtron.layers.cross_attention import CrossAttention
from meshtron.layers.kv_cache import KVCache
from meshtron.layers.norms import build_norm
from meshtron.layers.output import OutputLayer
from meshtron.layers.relative_position import RelativePositionBias
from meshtron.models import contract as c
from meshtron.models.decoder import RESIDUAL_OUTPUTS, TransformerBlock, decoder_plan
from meshtron.models.init import WeightInit, init_weights
from meshtron.models.sizes import BLOCK, model_sizes

Memory = list[tuple[torch.Tensor, torch.Tensor]]  # per decoder block: the cross-attention's keys and values


class T5EncoderBlock(TransformerBlock):
    """A bidirectional block over the real encoder tokens; the last (``final_norm``) also norms
    the encoder's output."""

    def __init__(self, cfg: ModelConfig, layer_number: int, last: bool):
        super().__init__(cfg, layer_number, causal=False)
        self.final_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels) if last else None

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None, position_bias: torch.Tensor | None = None) -> torch.Tensor:
        x = super().forward(x, None, None, padding_mask=padding_mask, position_bias=position_bias)
        return x if self.final_norm is None else self.final_norm(x)


class T5DecoderBlock(TransformerBlock):
    """Pre-norm: x + self_attn(norm(x)) (causal), x + cross_attn(norm(x), encoder output), then
    x + mlp(norm(x)); residuals from the norms' outputs under post-LN, as ``TransformerBlock``'s."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__(cfg, layer_number, causal=True)
        self.pre_cross_attn_layernorm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels)
        self.cross_attention = CrossAttention(cfg, layer_number)

    def forward(self, x: torch.Tensor, encoder_output: torch.Tensor | None, encoder_padding_mask: torch.Tensor | None,
                kv_cache: KVCache | None = None, memory: tuple[torch.Tensor, torch.Tensor] | None = None,
                position_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``kv_cache``: x continues the cached decoder sequence; ``memory``: the cross-attention's
        keys and values, computed once per prompt (generation); ``position_bias``: the
        self-attention's relative position bias."""
        normed = self.input_layernorm(x)
        attn = self.self_attention(normed, None, None, kv_cache=kv_cache, position_bias=position_bias)
        x = self.add_branch(attn, self._residual(x, normed))
        normed = self.pre_cross_attn_layernorm(x)
        x = self.add_branch(self.cross_attention(normed, encoder_output, encoder_padding_mask, memory), self._residual(x, normed))
        normed = self.pre_mlp_layernorm(x)
        return self.add_branch(self.mlp(normed), self._residual(x, normed))

    def _residual(self, x: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return normed if self.residual_after_norm else x


class T5(c.TokenLossModel):
    """T5 over a vocabulary of ``vocab_size`` tokens in ``padded_vocab_size`` rows (as the decoder's); learned positions up
    to ``cfg.max_position_embeddings`` (else ``max_seq_length``) for both stacks, or relative ones."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_seq_length: int, padded_vocab_size: int = 0):
        super().__init__()
        self.cfg, self.hidden_size = cfg, cfg.hidden_size
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size or vocab_size
        self.max_positions = cfg.max_position_embeddings or max_seq_length
        self.num_encoder_layers, self.num_decoder_layers = encoder_decoder_layers(cfg)
        if cfg.recompute_granularity == "full":
            self.recompute = (cfg.recompute_method, cfg.recompute_num_layers)
        h, enc = cfg.hidden_size, self.num_encoder_layers
        self.embedding = nn.Embedding(self.padded_vocab_size, h)
        self.relative = cfg.position_embedding_type == "relative"
        self.position_embedding = None if self.relative else nn.Embedding(self.max_positions, h)
        tables = (cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance, cfg.num_attention_heads)
        self.encoder_relative_position = RelativePositionBias(*tables, bidirectional=True) if self.relative else None
        self.decoder_relative_position = RelativePositionBias(*tables, bidirectional=False) if self.relative else None
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)
        encoder = [T5EncoderBlock(cfg, i, last=i == enc - 1) for i in range(enc)]
        self.layers = nn.ModuleList([*encoder, *(T5DecoderBlock(cfg, i) for i in range(self.num_decoder_layers))])
        self.final_norm = build_norm(cfg.normalization, h, cfg.norm_epsilon, cfg.fused_kernels)
        self.output = OutputLayer(h, self.padded_vocab_size, cfg.tie_embeddings, cfg.fused_kernels, bias=True, vocab_size=vocab_size)
        self.weight_init = WeightInit.scaled_by_depth(cfg.init_method_std, cfg.num_layers, RESIDUAL_OUTPUTS)
        init_weights(self, self.weight_init)

    # ------------------------------------------------------------------ one process: read top to bottom

    def forward(self, encoder_tokens: torch.Tensor, decoder_tokens: torch.Tensor, encoder_padding_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """encoder_tokens [b, t], decoder_tokens [b, s] -> per-token loss [b, s] (fp32) with
        ``labels``, else logits [b, s, V]."""
        batch = {"encoder_tokens": encoder_tokens, "decoder_tokens": decoder_tokens,
                 "encoder_padding_mask": encoder_padding_mask, "labels": labels}  # fmt: skip
        out, _ = self.run_stage(None, {k: v for k, v in batch.items() if v is not None}, list(self.layers), True, True)
        return out

    # ------------------------------------------------------------------ generation: encoder once, decoder step by step

    def encode(self, encoder_tokens: torch.Tensor, encoder_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's normed output [b, t, h]."""
        hidden = self._embed_tokens(encoder_tokens, 0)
        bias = self._position_bias(self.encoder_relative_position, hidden.shape[1], hidden.shape[1])
        for block in self.layers[: self.num_encoder_layers]:
            hidden = block(hidden, encoder_padding_mask, bias)
        return hidden

    def cross_attention_memory(self, encoder_output: torch.Tensor) -> Memory:
        """Every decoder block's cross-attention keys and values of ``encoder_output``."""
        return [block.cross_attention.memory(encoder_output) for block in self.layers[self.num_encoder_layers :]]

    def decode(self, decoder_tokens: torch.Tensor, memory: Memory, encoder_padding_mask: torch.Tensor | None = None,
               kv_cache: KVCache | None = None) -> torch.Tensor:  # fmt: skip
        """Logits [b, s, V] of ``decoder_tokens`` [b, s], which continue ``kv_cache``'s sequence
        when one is given (positions follow it)."""
        start = kv_cache.length if kv_cache is not None else 0
        hidden = self._embed_tokens(decoder_tokens, start)
        # The new positions' bias against every cached key as well as their own.
        bias = self._position_bias(self.decoder_relative_position, decoder_tokens.shape[1], start + decoder_tokens.shape[1])
        for block, block_memory in zip(self.layers[self.num_encoder_layers :], memory):
            hidden = block(hidden, None, encoder_padding_mask, kv_cache, block_memory, bias)
        if kv_cache is not None:
            kv_cache.advance(decoder_tokens.shape[1])
        return self.head({"decoder": hidden}, {})

    def new_kv_cache(self, batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        """An empty cache of the decoder's self-attention keys and values (``layer_number`` of a
        decoder block counts decoder blocks from 0)."""
        return KVCache(self.num_decoder_layers, batch_size, max_length, num_kv_heads(self.cfg), head_dim(self.cfg), dtype, device)

    # ------------------------------------------------------------------ the contract's pieces

    def parallel_plan(self) -> c.Plan:
        """The decoder's plan (the same names for both stacks' blocks, embedding, positions and
        output), plus the cross-attention split by heads like self-attention (q and the per-head
        [k, v] rows by output, the projection by input), the relative position tables by their
        heads' columns and the extra norms."""
        cross = "layers.*.cross_attention."
        return [
            ("*_relative_position", c.HeadParallelTable(dim=1)),
            (cross + "linear_q", c.ColumnParallel()),
            (cross + "linear_kv", c.ColumnParallel()),
            (cross + "linear_proj", c.RowParallel()),
            ("layers.*.pre_cross_attn_layernorm", c.SequenceParallelNorm()),
            ("layers.*.final_norm", c.SequenceParallelNorm()),
            *decoder_plan(self.cfg),
        ]

    def pipeline_pieces(self) -> c.PipelinePieces:
        """The encoder's relative position table goes with the embedding (first stage), the
        decoder's with the head (last stage)."""
        tied = ("embedding",) if self.cfg.tie_embeddings else ()
        positions = "encoder_relative_position" if self.relative else "position_embedding"
        head = ("decoder_relative_position",) if self.relative else ()
        return c.PipelinePieces(("embedding", positions, "embedding_dropout"), "layers", ("final_norm", "output", *head, *tied))

    def embed(self, batch: c.Batch) -> c.Carry:
        return {"encoder": self._embed_tokens(batch["encoder_tokens"], 0), "decoder": self._embed_tokens(batch["decoder_tokens"], 0)}

    def block_inputs(self, batch: c.Batch) -> dict[str, Any]:
        """The encoder's padding mask, and each relative position bias this stage holds the table of."""
        t, s = batch["encoder_tokens"].shape[1], batch["decoder_tokens"].shape[1]
        return {"encoder_padding_mask": batch.get("encoder_padding_mask"),
                "encoder_bias": self._position_bias(self.encoder_relative_position, t, t),
                "decoder_bias": self._position_bias(self.decoder_relative_position, s, s)}  # fmt: skip

    def run_blocks(self, carry: c.Carry, inputs: dict[str, Any], blocks: list[nn.Module]) -> tuple[c.Carry, dict[str, torch.Tensor]]:
        """Encoder blocks advance the encoder stream, decoder blocks the decoder stream reading
        the encoder's (by then normed) output; a stream no block of this run touches passes on."""
        encoder, decoder, mask = carry["encoder"], carry["decoder"], inputs["encoder_padding_mask"]
        for block in blocks:
            decoding = isinstance(block, T5DecoderBlock)
            bias = inputs["decoder_bias" if decoding else "encoder_bias"]
            if self.relative and bias is None:
                raise RuntimeError(f"this pipeline stage runs {'decoder' if decoding else 'encoder'} blocks without that stack's "
                                   "relative position table: split the stages encoder | decoder (validation says how)")  # fmt: skip
            if decoding:
                decoder = block(decoder, encoder, mask, position_bias=bias)
            else:
                encoder = block(encoder, mask, bias)
        return {"encoder": encoder, "decoder": decoder}, {}

    def head(self, carry: c.Carry, batch: c.Batch) -> torch.Tensor:
        """Per-token loss [b, s] in fp32 with labels in the batch, else logits."""
        tied = self.embedding.weight if self.cfg.tie_embeddings else None
        return self.output(self.final_norm(carry["decoder"]), batch.get("labels"), tied_weight=tied)

    def carry_shapes(self, batch: c.Batch, seq_shards: int) -> dict[str, tuple[int, ...]]:
        (b, t), s = batch["encoder_tokens"].shape, batch["decoder_tokens"].shape[1]
        return {"encoder": (b, t // seq_shards, self.hidden_size), "decoder": (b, s // seq_shards, self.hidden_size)}

    # ------------------------------------------------------------------ helpers

    def _embed_tokens(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        embedded = self.embedding(tokens)
        if self.position_embedding is not None:
            embedded = embedded + self.position_embedding(torch.arange(start, start + tokens.shape[1], device=tokens.device))
        return self.embedding_dropout(embedded)

    @staticmethod
    def _position_bias(table: RelativePositionBias | None, q_len: int, kv_len: int) -> torch.Tensor | None:
        """A stack's relative position bias; None with absolute positions or on a stage without the table."""
        return None if table is None else table(q_len, kv_len)


def t5_parameter_parts(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0) -> dict[str, int]:
    """Read off the meta-built model (``models.sizes``): the parameters of one encoder block
    without the encoder's final norm (``block``), and of a decoder block's cross-attention its
    ``cross_q`` (query and output projections, on decoder tokens) and ``cross_kv`` (on encoder
    tokens), for counting FLOPs."""
    sizes = model_sizes(cfg, vocab_size, max_seq_length)
    first_decoder = encoder_decoder_layers(cfg)[0]
    part = {"block": 0, "cross_q": 0, "cross_kv": 0}
    for p in sizes.params:
        if p.place == BLOCK and p.block == 0 and ".final_norm." not in p.name:
            part["block"] += p.numel
        elif p.place == BLOCK and p.block == first_decoder and ".cross_attention." in p.name:
            part["cross_kv" if ".linear_kv." in p.name else "cross_q"] += p.numel
    return part


def t5_flops_per_token(cfg: ModelConfig, vocab_size: int, encoder_length: int, decoder_length: int) -> float:
    """T5's training FLOPs of one sample over its ``encoder_length + decoder_length`` tokens, by
    the rules of ``flops.flops_per_token``: 6 per parameter and token it multiplies (encoder blocks
    and the cross-attention's key/value projections on encoder tokens; decoder blocks, the rest of
    the cross-attention and the output projection on decoder tokens), bidirectional attention in
    the encoder (12 L t^2 h), causal self-attention (6 L s^2 h) and cross-attention (12 L s t h) in
    the decoder."""
    part, h = t5_parameter_parts(cfg, vocab_size, encoder_length), cfg.hidden_size
    (enc, dec), t, s = encoder_decoder_layers(cfg), encoder_length, decoder_length
    linear = t * (enc * part["block"] + dec * part["cross_kv"]) + s * (dec * (part["block"] + part["cross_q"]) + vocab_size * h)
    attention = 12.0 * enc * t * t * h + 6.0 * dec * s * s * h + 12.0 * dec * s * t * h
    return (6.0 * linear + attention) / (t + s)


def t5_config_errors(cfg: Config) -> list[str]:
    """What T5 does not take (yet), each naming the flag to change."""
    m, d, p = cfg.model, cfg.data, cfg.parallel
    errors = []
    if m.position_embedding_type not in ("learned_absolute", "relative"):
        errors.append(f"T5 takes learned absolute positions (Megatron's default) or relative ones; drop --position-embedding-type "
                      f"{m.position_embedding_type}")  # fmt: skip
    if m.position_embedding_type == "relative":
        errors.extend(_relative_position_errors(cfg))
    if m.num_experts or m.multi_latent_attention:
        errors.append("T5 is built with dense MLPs and standard attention; drop --num-experts / --multi-latent-attention")
    if m.num_query_groups and m.num_query_groups != m.num_attention_heads:
        errors.append("T5's attention has as many key/value heads as query heads; drop --num-query-groups")
    if m.encoder_num_layers < 0 or m.decoder_num_layers < 0 or min(encoder_decoder_layers(m)) < 1:
        errors.append("T5 needs at least one encoder and one decoder block: set --encoder-num-layers / --decoder-num-layers "
                      "(or --num-layers)")  # fmt: skip
    enc, dec = d.encoder_seq_length or d.seq_length, d.decoder_seq_length
    positions = m.max_position_embeddings or d.seq_length
    if m.position_embedding_type == "learned_absolute" and max(enc, dec) > positions:
        errors.append(f"T5's encoder ({enc}) and decoder ({dec}) lengths must fit --max-position-embeddings {positions}; raise it")
    if d.encoder_seq_length and d.encoder_seq_length != d.seq_length:
        errors.append(f"--encoder-seq-length {d.encoder_seq_length} and --seq-length {d.seq_length} differ; T5's sequence "
                      f"length is its encoder's: set one, or both equal")  # fmt: skip
    if p.sequence_parallel and p.tensor_parallel > 1 and (enc % p.tensor_parallel or dec % p.tensor_parallel):
        errors.append(f"--sequence-parallel splits both the encoder ({enc}) and decoder ({dec}) sequences over "
                      f"{p.tensor_parallel} ranks; use lengths that are multiples of it or drop --sequence-parallel")  # fmt: skip
    if p.context_parallel > 1:
        errors.append("T5 under context parallelism is not implemented (the ring attention is causal self-attention); "
                      "set --context-parallel-size 1")  # fmt: skip
    if (d.data_path or (d.mock and d.tokenizer_type)) and d.tokenizer_type not in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        errors.append(f"T5's data needs [BOS]/[EOS]/[MASK] and sentinels: use --tokenizer-type BertWordPieceLowerCase or "
                      f"BertWordPieceCase (got '{d.tokenizer_type}')"
                      f"{'; or drop it (--mock-data needs no tokenizer)' if d.mock else ''}")  # fmt: skip
    if cfg.logging.generate_prompt:
        errors.append("T5 does not sample during training; drop --generate-prompt and use `meshtron generate --load DIR --prompt ...`")
    return errors


def _relative_position_errors(cfg: Config) -> list[str]:
    """The relative tables' sizes, and the pipeline split they need (each stack's table sits on one stage)."""
    m, p = cfg.model, cfg.parallel
    errors = []
    if m.relative_attention_num_buckets < 4 or m.relative_attention_max_distance <= m.relative_attention_num_buckets // 2:
        errors.append(f"--relative-attention-max-distance {m.relative_attention_max_distance} must exceed half of "
                      f"--relative-attention-num-buckets {m.relative_attention_num_buckets} (at least 4), where the "
                      f"logarithmic buckets start; change either")  # fmt: skip
    enc = encoder_decoder_layers(m)[0]
    if p.pipeline_parallel > 1 and (p.pipeline_parallel != 2 or p.virtual_pipeline_parallel > 1 or p.num_layers_per_virtual_pipeline_stage
                                    or p.first_pipeline_stage_layers != enc):  # fmt: skip
        errors.append(f"T5's relative position tables sit with the encoder on the first stage and the decoder on the last: "
                      f"use --pipeline-model-parallel-size 2 without virtual stages and --decoder-first-pipeline-num-layers {enc}")  # fmt: skip
    return errors
