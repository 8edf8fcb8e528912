"""BERT (Megatron's ``pretrain_bert.py`` model): a bidirectional encoder trained by masked-LM and
sentence-order prediction.

Read top to bottom: token + learned position (+ token type: with the binary head, or with
``--bert-tokentypes``) embeddings, ``num_layers`` blocks of the decoder's ``TransformerBlock``
with bidirectional attention over the real tokens (pre-LN as Megatron's BERT, or post-LN with
``--apply-residual-connection-post-layernorm``, which is Hugging Face's BERT exactly, see
``hf_bert.py``), a final norm, then two heads: the LM head (dense, GELU, LayerNorm, the output
projection tied to the embedding, with a bias) over every position, and the pooler ([CLS]'s
hidden state, dense, tanh) with the sentence-order (binary) head.

The loss is Megatron's: masked-LM cross-entropy averaged over the masked tokens of the global
batch (``total`` / ``count``) plus the sentence-order cross-entropy averaged over its samples,
an auxiliary term of ``LossOutput`` (each micro batch's mean; the runner averages the means over
equally large micro batches, which is the global per-sample mean). Both are logged.

Its batch is ``meshtron.data.bert_dataset``'s: ``tokens``, ``types``, ``labels``, ``loss_mask``,
``padding_mask``, ``is_random``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import Config, ModelConfig
from meshtron.layers.norms import build_norm
from meshtron.layers.output import OutputLayer
from meshtron.models import contract as c
from meshtron.models.decoder import RESIDUAL_OUTPUTS, TransformerBlock, decoder_plan, token_loss
from meshtron.models.init import WeightInit, init_weights

SOP_LOSS = "sop_loss"  # the auxiliary term's name in logs


class LMHead(nn.Module):
    """dense -> GELU -> LayerNorm before the output projection (Megatron's ``BertLMHead``,
    Hugging Face's ``cls.predictions.transform``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(hidden), approximate=self.approximate))


class FirstToken(nn.Module):
    """Each sequence's [CLS] row, ``[b, s, h] -> [b, h]``: the plan's hook
    (``FirstTokenOfSequence``) to fetch it from the tp rank holding it under sequence parallelism."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, 0]


class BertEncoder(c.ModelFamily):
    """BERT's body: token + learned position (+ token type) embeddings, ``num_layers`` bidirectional
    blocks and the final norm. The masked-LM model adds its heads on top; the retriever
    (``models/ict.py``) runs two of them (or one, shared) as its query and context towers, which
    therefore take a BERT checkpoint's weights under the same names."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_seq_length: int, token_types: int, padded_vocab_size: int = 0):
        super().__init__()
        self.cfg, self.hidden_size = cfg, cfg.hidden_size
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size or vocab_size
        self.max_positions = cfg.max_position_embeddings or max_seq_length
        if cfg.recompute_granularity == "full":
            self.recompute = (cfg.recompute_method, cfg.recompute_num_layers)
        h = cfg.hidden_size
        self.embedding = nn.Embedding(self.padded_vocab_size, h)
        self.position_embedding = nn.Embedding(self.max_positions, h)
        self.tokentype_embedding = nn.Embedding(token_types, h) if token_types else None
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i, causal=False) for i in range(cfg.num_layers))
        self.final_norm = build_norm(cfg.normalization, h, cfg.norm_epsilon, cfg.fused_kernels)
        # The decoder's rule; subclasses call ``init_weights`` once their heads exist.
        self.weight_init = WeightInit.scaled_by_depth(cfg.init_method_std, cfg.num_layers, RESIDUAL_OUTPUTS)

    def parallel_plan(self) -> c.Plan:
        """The decoder's: the blocks, embedding, positions and output layer are the same modules
        under the same names; token types, like positions, cut to the sequence shard under sp."""
        return [("tokentype_embedding", c.ScatterToSequence()), *decoder_plan(self.cfg)]

    def embed(self, batch: c.Batch) -> c.Carry:
        tokens = batch["tokens"]
        hidden = self.embedding(tokens) + self.position_embedding(torch.arange(tokens.shape[1], device=tokens.device))
        if self.tokentype_embedding is not None:
            types = batch.get("types")
            hidden = hidden + self.tokentype_embedding(types if types is not None else torch.zeros_like(tokens))
        return {"hidden": self.embedding_dropout(hidden)}

    def block_inputs(self, batch: c.Batch) -> dict[str, Any]:
        return {"cos": None, "sin": None, "padding_mask": batch.get("padding_mask")}

    def run_blocks(self, carry: c.Carry, inputs: dict[str, Any], blocks: list[nn.Module]) -> tuple[c.Carry, dict[str, torch.Tensor]]:
        hidden = carry["hidden"]
        for block in blocks:
            hidden = block(hidden, **inputs)
        return {"hidden": hidden}, {}


class Bert(BertEncoder, c.TokenLossModel):
    """BERT over a vocabulary of ``vocab_size`` tokens in ``padded_vocab_size`` rows (as the
    decoder's); positions up to ``cfg.max_position_embeddings`` (else ``max_seq_length``)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_seq_length: int, padded_vocab_size: int = 0):
        binary = cfg.bert_binary_head
        super().__init__(cfg, vocab_size, max_seq_length, tokentype_rows(cfg), padded_vocab_size)
        h = cfg.hidden_size
        self.lm_head = LMHead(cfg)
        self.output = OutputLayer(h, self.padded_vocab_size, cfg.tie_embeddings, cfg.fused_kernels, bias=True, vocab_size=vocab_size)
        self.first_token = FirstToken() if binary else None
        self.pooler = nn.Linear(h, h) if binary else None
        self.binary_head = nn.Linear(h, 2) if binary else None
        init_weights(self, self.weight_init)

    # ------------------------------------------------------------------ one process: read top to bottom

    def forward(self, tokens: torch.Tensor, types: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
        """tokens [b, s] -> {"lm": logits [b, s, V] (per-token loss [b, s] with ``labels``),
        "sop": sentence-order logits [b, 2] (with the binary head)}."""
        batch = {"tokens": tokens, "types": types, "padding_mask": padding_mask, "labels": labels}
        out, _ = self.run_stage(None, {k: v for k, v in batch.items() if v is not None}, list(self.layers), True, True)
        return out

    # ------------------------------------------------------------------ the contract's pieces

    def parallel_plan(self) -> c.Plan:
        """The body's, plus the heads: the LM head's dense and norm run per token (on the sequence
        shard under sp, so their gradients are partial over tp, like a norm's); the pooler and the
        sentence-order head, small and whole on every rank, read [CLS] through ``first_token``."""
        return [("lm_head", c.SequenceParallelNorm()), ("first_token", c.FirstTokenOfSequence()), *super().parallel_plan()]

    def pipeline_pieces(self) -> c.PipelinePieces:
        tied = ("embedding",) if self.cfg.tie_embeddings else ()
        embed = ("embedding", "position_embedding", "tokentype_embedding", "embedding_dropout")
        head = ("final_norm", "lm_head", "output", "first_token", "pooler", "binary_head", *tied)
        return c.PipelinePieces(embed, "layers", head)

    def head(self, carry: c.Carry, batch: c.Batch) -> dict[str, Any]:
        """{"lm": per-token loss [b, s] (fp32) with labels in the batch, their masked sum
        (``SummedTokenLoss``, over the labelled rows only) with a loss mask too under
        ``--cross-entropy-loss-fusion``, else logits; "sop": the sentence-order logits [b, 2] of the
        [CLS] token, with the binary head}."""
        hidden = self.final_norm(carry["hidden"])
        out = {"lm": token_loss(self, self.lm_head(hidden), batch.get("labels"), batch.get("loss_mask"))}
        if self.binary_head is not None:
            out["sop"] = self.binary_head(torch.tanh(self.pooler(self.first_token(hidden))))
        return out

    def loss(self, batch: c.Batch, outputs: dict[str, torch.Tensor]) -> c.LossOutput:
        """The masked-LM loss as every token-loss model's, plus the sentence-order term."""
        loss = super().loss(batch, outputs["lm"])
        if "sop" in outputs:
            loss.aux[SOP_LOSS] = F.cross_entropy(outputs["sop"].float(), batch["is_random"])
        return loss


def tokentype_rows(cfg: ModelConfig) -> int:
    """Rows of the token-type embedding. Megatron's BERT has them only with the binary head (2:
    segment A or B, which only the sentence-order task tells apart); ``--bert-tokentypes`` keeps
    them without it, as Hugging Face's BERT always has them (``type_vocab_size``)."""
    return cfg.bert_tokentypes or (2 if cfg.bert_binary_head else 0)


def bert_config_errors(cfg: Config) -> list[str]:
    """What BERT does not take (yet), each naming the flag to change."""
    m, d, p = cfg.model, cfg.data, cfg.parallel
    errors = []
    if m.position_embedding_type != "learned_absolute":
        errors.append(f"BERT uses learned absolute positions; drop --position-embedding-type {m.position_embedding_type}")
    if m.bert_tokentypes < 0 or (m.bert_binary_head and m.bert_tokentypes == 1):
        errors.append(f"--bert-tokentypes {m.bert_tokentypes}: use 0 (Megatron's rule) or at least 2 (the sentence-order "
                      "head reads segments 0 and 1)")  # fmt: skip
    if m.num_experts or m.multi_latent_attention:
        errors.append("BERT is built with dense MLPs and standard attention; drop --num-experts / --multi-latent-attention")
    if p.context_parallel > 1:
        errors.append("BERT under context parallelism is not implemented (the ring attention is causal); set --context-parallel-size 1")
    if (d.data_path or (d.mock and d.tokenizer_type)) and d.tokenizer_type not in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        errors.append(f"BERT's data needs [CLS]/[SEP]/[MASK]: use --tokenizer-type BertWordPieceLowerCase or "
                      f"BertWordPieceCase (got '{d.tokenizer_type}')"
                      f"{'; or drop it (--mock-data needs no tokenizer)' if d.mock else ''}")  # fmt: skip
    if cfg.logging.generate_prompt:
        errors.append("BERT does not generate text; drop --generate-prompt")
    return errors
