"""ICT (Megatron's ``pretrain_ict.py``): the Inverse Cloze Task retriever, a bi-encoder that learns
to find the block of text a sentence was taken from.

Read top to bottom: the query tower encodes ``[CLS] sentence [SEP]``, the context tower
``[CLS] title [SEP] block [SEP]``. Both are ``BertEncoder``s (BERT's embeddings, bidirectional
blocks and final norm, under BERT's parameter names, so ``--bert-load`` starts them from a BERT
checkpoint); ``--biencoder-shared-query-context-model`` makes one tower encode both sides. A
side's embedding is its [CLS] state, projected to ``--biencoder-projection-dim`` when set.

Scores are query · context over every context of the micro batch *on every data-parallel rank*
(Megatron's in-batch negatives span the data-parallel batch): the contexts pass through
``candidates``, which the parallel plan replaces by a differentiable gather over dp
(``GatherOverDataParallel``). ``--retriever-score-scaling`` divides them by sqrt(hidden size).
The loss is each query's cross-entropy against its own block, summed over this rank's queries
and normalized by the global batch's query count (``loss_count``) as a token loss is; in-batch
top-k accuracies (``--retriever-report-topk-accuracies``) are its metrics.

Layouts: dp (the gather) and tp (each tower's blocks, embeddings and final norm under BERT's
plan; the projections are replicated), with sequence parallelism too: the final norm runs on
every token of the rank's sequence shard, then ``first_token`` (the plan's ``FirstTokenOfSequence``)
fetches [CLS] from the tp rank holding it. One pipeline stage only, and no context parallelism:
``ict_config_errors`` says so.

Batch: ``data/ict_dataset.py``'s ``query_tokens``, ``query_padding_mask``, ``context_tokens``,
``context_padding_mask`` (its ``block_indices`` are for evidence indexing, not read here).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import Config, ModelConfig
from meshtron.models import contract as c
from meshtron.models.bert import BertEncoder, FirstToken, bert_config_errors, tokentype_rows
from meshtron.models.decoder import RESIDUAL_OUTPUTS
from meshtron.models.init import WeightInit, init_weights
from meshtron.models.sizes import BLOCK, model_sizes

SIDES = ("query", "context")


class InBatchCandidates(nn.Module):
    """One process: this micro batch's contexts are all the candidates, and this rank's rows
    start at 0. The parallel plan's hook (``GatherOverDataParallel``)."""

    def forward(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        return rows, 0


class ICT(c.ModelFamily):
    """The retriever over a vocabulary of ``vocab_size`` tokens in ``padded_vocab_size`` rows (as the decoder's)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_seq_length: int, padded_vocab_size: int = 0):
        super().__init__()
        self.cfg, self.hidden_size = cfg, cfg.hidden_size
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size or vocab_size
        if cfg.recompute_granularity == "full":
            self.recompute = (cfg.recompute_method, cfg.recompute_num_layers)
        names = ("shared",) if cfg.biencoder_shared_query_context_model else SIDES
        # Token types as BERT has them (with its binary head), so a BERT checkpoint maps one to one;
        # every token is segment A.
        self.towers = nn.ModuleDict({n: BertEncoder(cfg, vocab_size, max_seq_length, tokentype_rows(cfg), padded_vocab_size)
                                     for n in names})  # fmt: skip
        dim = cfg.biencoder_projection_dim
        self.projections = nn.ModuleDict({n: nn.Linear(cfg.hidden_size, dim) for n in names}) if dim else None
        self.first_token = FirstToken()
        self.candidates = InBatchCandidates()
        self.weight_init = WeightInit.scaled_by_depth(cfg.init_method_std, cfg.num_layers, RESIDUAL_OUTPUTS)
        init_weights(self, self.weight_init)

    def tower_name(self, side: str) -> str:
        return "shared" if "shared" in self.towers else side

    def encode(self, side: str, tokens: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        """One side's embeddings ``[b, d]`` of ``tokens [b, s]`` (one process: retrieval evaluation)."""
        batch = {"tokens": tokens, "padding_mask": padding_mask}
        tower = self.towers[self.tower_name(side)]
        carry, _ = tower.forward_blocks(tower.embed(batch), tower.block_inputs(batch), list(tower.layers))
        return self._embedding(side, carry["hidden"])

    def _embedding(self, side: str, hidden: torch.Tensor) -> torch.Tensor:
        name = self.tower_name(side)
        # The norm runs on every token (the sequence shard under sp, as the plan's
        # SequenceParallelNorm expects); it is token-wise, so [CLS]'s row is the one of [CLS] alone.
        cls = self.first_token(self.towers[name].final_norm(hidden))
        return self.projections[name](cls) if self.projections is not None else cls

    # ------------------------------------------------------------------ the contract's pieces

    def parallel_plan(self) -> c.Plan:
        """Each tower's BERT plan under its prefix, [CLS] fetched from its tp rank under sp, and
        the gather of the candidates."""
        towers = [(f"towers.{n}.{pattern}", style) for n, tower in self.towers.items() for pattern, style in tower.parallel_plan()]
        return [*towers, ("first_token", c.FirstTokenOfSequence()), ("candidates", c.GatherOverDataParallel())]

    def pipeline_pieces(self) -> c.PipelinePieces:
        """One stage holds everything (``ict_config_errors`` refuses pp): the towers hold their
        embeddings and norms beside their blocks."""
        return c.PipelinePieces(("towers",), "towers", ("towers", "first_token", "projections", "candidates"))

    def blocks(self) -> nn.Module:
        """Every tower's transformer blocks, query tower's first: what recompute, compile, FP8 and
        FSDP act on block by block."""
        return nn.ModuleList([layer for tower in self.towers.values() for layer in tower.layers])

    def pretrained_encoders(self) -> tuple[str, ...]:
        return tuple(f"towers.{n}" for n in self.towers)

    def embed(self, batch: c.Batch) -> c.Carry:
        return {side: self.towers[self.tower_name(side)].embed(_side(batch, side))["hidden"] for side in SIDES}

    def block_inputs(self, batch: c.Batch) -> dict[str, Any]:
        return {side: self.towers[self.tower_name(side)].block_inputs(_side(batch, side)) for side in SIDES}

    def run_blocks(self, carry: c.Carry, inputs: dict[str, Any], blocks: list[nn.Module]) -> tuple[c.Carry, dict[str, torch.Tensor]]:
        """Each block runs on the side(s) whose tower holds it (both, for the shared tower)."""
        hidden = dict(carry)
        for block in blocks:
            for side in SIDES:
                if any(block is layer for layer in self.towers[self.tower_name(side)].layers):
                    hidden[side] = block(hidden[side], **inputs[side])
        return hidden, {}

    def head(self, carry: c.Carry, batch: c.Batch) -> dict[str, torch.Tensor]:
        """{"query": this rank's query embeddings [b, d], "context": every dp rank's context
        embeddings [dp * b, d], "positives": each query's own block among them [b]}."""
        query = self._embedding("query", carry["query"])
        contexts, first = self.candidates(self._embedding("context", carry["context"]))
        positives = torch.arange(first, first + query.shape[0], device=query.device)
        return {"query": query, "context": contexts, "positives": positives}

    def loss(self, batch: c.Batch, outputs: dict[str, torch.Tensor]) -> c.LossOutput:
        scores = retrieval_scores(outputs["query"], outputs["context"], self.cfg)
        positives = outputs["positives"]
        total = F.cross_entropy(scores, positives, reduction="sum")
        metrics = topk_accuracies(scores.detach(), positives, self.cfg.retriever_report_topk_accuracies)
        return c.LossOutput(total=total, count=self.loss_count(batch), metrics=metrics)

    def loss_count(self, batch: c.Batch) -> torch.Tensor:
        tokens = batch["query_tokens"]
        return torch.tensor(float(tokens.shape[0]), device=tokens.device)

    def carry_shapes(self, batch: c.Batch, seq_shards: int) -> dict[str, tuple[int, ...]]:
        return {side: (batch[f"{side}_tokens"].shape[0], batch[f"{side}_tokens"].shape[1] // seq_shards, self.hidden_size) for side in SIDES}


def _side(batch: c.Batch, side: str) -> c.Batch:
    """The BERT batch of one side of an ICT batch."""
    return {"tokens": batch[f"{side}_tokens"], "padding_mask": batch[f"{side}_padding_mask"]}


def retrieval_scores(queries: torch.Tensor, contexts: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """``[q, d] x [k, d] -> [q, k]`` similarity in fp32, over sqrt(hidden size) with ``--retriever-score-scaling``."""
    scores = queries.float() @ contexts.float().t()
    return scores / math.sqrt(cfg.hidden_size) if cfg.retriever_score_scaling else scores


def topk_accuracies(scores: torch.Tensor, positives: torch.Tensor, ks: list[int]) -> dict[str, torch.Tensor]:
    """``{"top{k}_acc": fraction of rows whose positive is among their k best scores}``."""
    out = {}
    for k in ks:
        best = scores.topk(min(k, scores.shape[1]), dim=1).indices
        out[f"top{k}_acc"] = (best == positives[:, None]).any(dim=1).float().mean()
    return out


def ict_flops_shape(cfg: ModelConfig, vocab_size: int, seq_length: int) -> tuple[int, int]:
    """``flops_shape`` per token of a sample: the query and the context each pass a tower (shared
    or not), whose multiplying parameters are its blocks and final norm (read off the meta-built
    model, ``models.sizes``); lookups (embedding, positions, token types) multiply nothing and the
    projection reads one token per sequence, so both are left out."""
    towers = 1 if cfg.biencoder_shared_query_context_model else 2
    sizes = model_sizes(cfg, vocab_size, seq_length)
    body = sum(p.numel for p in sizes.params if p.place == BLOCK or ".final_norm." in p.name)
    return 2 * body // towers, 2 * cfg.num_layers

def ict_config_errors(cfg: Config) -> list[str]:
    """What the retriever does not take, each naming the flag to change: BERT's rules, one stage."""
    m, p = cfg.model, cfg.parallel
    errors = [e.replace("BERT", "ICT") for e in bert_config_errors(cfg)]
    if p.pipeline_parallel > 1:
        errors.append("ICT runs its two towers as one pipeline stage; set --pipeline-model-parallel-size 1")
    if m.biencoder_projection_dim < 0:
        errors.append(f"--biencoder-projection-dim must be >= 0 (0: no projection), got {m.biencoder_projection_dim}")
    if any(k < 1 for k in m.retriever_report_topk_accuracies):
        errors.append(f"--retriever-report-topk-accuracies takes positive k, got {m.retriever_report_topk_accuracies}")
    return errors
