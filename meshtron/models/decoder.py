"""The decoder-only transformer behind every GPT and Llama preset.

Read top to bottom: token (+ learned position) embedding, ``num_layers`` pre-norm blocks of
attention and MLP, a final norm, and the output layer (the embedding matrix itself when tied).
It is an ordinary ``nn.Module``; it also fills in the model contract (``models/contract.py``):
its parallel plan, its pipeline pieces and its loss, so ``parallel/`` can shard, cut and run it
without knowing any of its attribute names.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtron.config import ModelConfig
from meshtron.kernels.dropout_add import dropout_add
from meshtron.layers.attention import Attention, head_dim, num_kv_heads
from meshtron.layers.kv_cache import KVCache, KVCacheBase, LatentKVCache
from meshtron.layers.mla import MultiLatentAttention, rope_table_dim
from meshtron.layers.mlp import MLP, ffn_hidden_size
from meshtron.layers.moe import EXPERT_WEIGHTS, MoELayer, moe_layer_pattern
from meshtron.layers.norms import build_norm
from meshtron.layers.output import OutputLayer
from meshtron.layers.rope import rope_tables
from meshtron.models import contract as c
from meshtron.models.init import WeightInit, init_weights
from meshtron.models.recompute import recompute_contexts
from meshtron.models.mtp import LossSums, PredictionDepth, depth_loss, mtp_plan, shifted_targets, target_keys

# Output projections of each block: initialized with std / sqrt(2 * num_layers) so the residual
# stream's variance does not grow with depth (GPT-2, Megatron's ``output_layer_init_method``).
RESIDUAL_OUTPUTS = ("linear_proj.weight", "linear_fc2.weight")


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), dropout on each branch (fused
    with the add, ``add_branch``). The MLP
    is a mixture of experts in the layers ``--moe-layer-freq`` picks (``moe``); the attention is
    multi-head latent attention with ``--multi-latent-attention`` (DeepSeek-V2); ``causal=False``
    makes the attention bidirectional (encoders).

    ``--apply-residual-connection-post-layernorm`` (Megatron's) takes each residual from the
    norm's output instead of its input: norm(x) + attn(norm(x)). Chained over the blocks this is
    the original post-LN transformer (BERT's), its norms shifted by one: each block's input norm
    is the previous block's output norm (the first's, BERT's embedding norm) and the final norm
    the last block's output norm.
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, moe: bool = False, causal: bool = True):
        super().__init__()
        self.input_layernorm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels)
        self.self_attention = MultiLatentAttention(cfg, layer_number) if cfg.multi_latent_attention else Attention(cfg, layer_number, causal)
        self.pre_mlp_layernorm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels)
        self.mlp = MoELayer(cfg) if moe else MLP(cfg)
        self.recompute_mlp = moe and cfg.moe_layer_recompute
        self.hidden_dropout = cfg.hidden_dropout
        self.dropout_add_kernels = cfg.fused_kernels if cfg.bias_dropout_fusion else "off"
        self.residual_after_norm = cfg.apply_residual_connection_post_layernorm

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCacheBase | None = None,
        padding_mask: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``position_bias``: added to the attention scores (T5's relative positions; standard attention only)."""
        normed = self.input_layernorm(x)
        bias = {} if position_bias is None else {"position_bias": position_bias}
        attn = self.self_attention(normed, cos, sin, position_ids, document_ids, kv_cache, padding_mask, **bias)
        x = self.add_branch(attn, normed if self.residual_after_norm else x)
        normed = self.pre_mlp_layernorm(x)
        if self.recompute_mlp and torch.is_grad_enabled():  # --moe-layer-recompute: the jitter's RNG state is replayed
            mlp = checkpoint(self.mlp, normed, use_reentrant=False, context_fn=functools.partial(recompute_contexts, [self.mlp]))
        else:
            mlp = self.mlp(normed)
        return self.add_branch(mlp, normed if self.residual_after_norm else x)

    def add_branch(self, branch: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + dropout(branch)``: one fused pass under ``--bias-dropout-fusion`` (``kernels/dropout_add``)."""
        return dropout_add(branch, residual, self.hidden_dropout, self.training, self.dropout_add_kernels)


def decoder_plan(cfg: ModelConfig) -> c.Plan:
    """How a decoder is tensor-, sequence- and context-parallel (Megatron's layout).

    Attention: q heads and kv groups split so each rank has whole heads (kv heads replicated when
    fewer than tp), output projection split by the same heads; full-width q/k norms' weights split
    with those heads, their sums of squares summed over tp; MLA likewise by heads, its
    down-projections and latent norms replicated (``layers/mla.py``). MLP: fc1 by output features
    (gate and up separately for SwiGLU), fc2 by input features. Embedding and output layer: by vocabulary, the loss computed on the
    shards. Norms (and other replicated token-wise modules) see 1/tp of the tokens under sequence
    parallelism; learned positions are cut to match the embedding's sequence shard.

    Mixture of experts: routed experts split over ep, and over tp like the MLP with expert tensor
    parallelism (whole on every tp rank without it); the router and shared experts
    whole on every rank (under sequence parallelism each tp rank routes its sequence shard, so
    their gradients are partial over tp like a norm's), the balancing statistics summed over the
    sequence shards.
    """
    heads, kv = cfg.num_attention_heads, num_kv_heads(cfg)
    fc1 = c.Halves(2) if cfg.activation == "swiglu" else c.Contiguous()
    attn = "layers.*.self_attention."
    overlap_chunks = cfg.moe_ep_overlap_chunks if cfg.overlap_moe_expert_parallel_comm else 0
    if cfg.multi_latent_attention:
        by_heads = [(attn + name, c.ColumnParallel()) for name in ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")]
        replicated = [(attn + name, c.SequenceParallelNorm())
                      for name in ("linear_q_down_proj", "q_layernorm", "linear_kv_down_proj", "kv_layernorm")]  # fmt: skip
        attention = [*by_heads, *replicated, (attn + "rope_key_to_heads", c.EnterTensorParallel())]
    elif cfg.qk_layernorm_span == "full":  # a norm over all heads: weights split with the heads, squares summed over tp
        attention = [(attn + "linear_qkv", c.ColumnParallel(c.GroupedHeads(kv, heads // kv, head_dim(cfg)))),
                     (attn + "q_layernorm", c.HeadParallelTable(0, c.Heads(heads, head_dim(cfg)))),
                     (attn + "k_layernorm", c.HeadParallelTable(0, c.Heads(kv, head_dim(cfg)))),
                     (attn + "q_layernorm.head_sum", c.SumOverHeadShards(heads)),
                     (attn + "k_layernorm.head_sum", c.SumOverHeadShards(kv))]  # fmt: skip
    else:  # --qk-layernorm's norms act on this rank's heads: their gradients are partial over tp
        attention = [(attn + "linear_qkv", c.ColumnParallel(c.GroupedHeads(kv, heads // kv, head_dim(cfg)))),
                     *[(attn + name, c.SharedByHeads()) for name in ("q_layernorm", "k_layernorm")]]  # fmt: skip
    blocks = [
        *attention,
        (attn + "linear_proj", c.RowParallel()),
        (attn + "core_attention", c.ContextParallelCore()),
        ("layers.*.mlp.linear_fc1", c.ColumnParallel(fc1)),
        ("layers.*.mlp.linear_fc2", c.RowParallel()),
        ("layers.*.mlp.experts", c.ExpertParallel(cfg.moe_token_dispatcher_type, fc1, overlap_chunks)),
        ("layers.*.mlp.token_sum", c.SequenceSum()),
        ("layers.*.mlp.router", c.SequenceParallelNorm()),
        ("layers.*.mlp.shared_experts", c.SequenceParallelNorm()),
        ("layers.*.mlp.shared_expert_gate", c.SequenceParallelNorm()),
        ("layers.*.input_layernorm", c.SequenceParallelNorm()),
        ("layers.*.pre_mlp_layernorm", c.SequenceParallelNorm()),
    ]
    whole_model = [("embedding", c.VocabParallelEmbedding()), ("position_embedding", c.ScatterToSequence()),
                   ("output", c.VocabParallelOutput()), ("final_norm", c.SequenceParallelNorm())]  # fmt: skip
    return whole_model + blocks + mtp_plan(blocks, cfg.mtp_num_layers)


def decoder_layout_errors(cfg: ModelConfig, tp: int) -> list[str]:
    """Why the decoder's shapes cannot be split over ``tp`` ranks (empty when they can), each
    naming the flag to change. Fewer kv heads than ranks is allowed when tp is a multiple of them."""
    heads, kv = cfg.num_attention_heads, num_kv_heads(cfg)
    ok_tp = [t for t in range(1, heads + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
    errors = []
    if heads % tp:
        errors.append(f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}; "
                      f"use a tensor-parallel size in {ok_tp} or change the number of heads")  # fmt: skip
    if kv % tp and tp % kv:
        errors.append(f"--num-query-groups {kv} (key/value heads) and --tensor-model-parallel-size {tp} must divide "
                      f"one another (kv heads split over the ranks, or each replicated on tp/kv ranks); use a "
                      f"tensor-parallel size in {ok_tp} or change the number of query groups")  # fmt: skip
    ffn = ffn_hidden_size(cfg)
    if ffn % tp:
        errors.append(f"the MLP width {ffn} (--ffn-hidden-size) is not divisible by --tensor-model-parallel-size {tp}; "
                      f"set --ffn-hidden-size to a multiple of {tp}")  # fmt: skip
    return errors


class Decoder(c.TokenLossModel):
    """GPT/Llama decoder over a vocabulary of ``vocab_size`` tokens in a table of
    ``padded_vocab_size`` rows (0: no padding; the caller pads, ``padded_vocab_size()``): padded
    rows are never a token, a label or a logit.

    ``max_seq_length`` sizes the position tables when ``cfg.max_position_embeddings`` is 0.
    Its batch: ``tokens``, ``labels``, ``loss_mask`` [b, s], optional ``position_ids`` (restart at
    each packed document, ``--reset-position-ids``) and ``document_ids`` (attention kept inside a
    document, ``--reset-attention-mask``).
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_seq_length: int, padded_vocab_size: int = 0):
        super().__init__()
        self.cfg, self.hidden_size = cfg, cfg.hidden_size
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size or vocab_size
        self.max_positions = cfg.max_position_embeddings or max_seq_length
        self.use_rope = cfg.position_embedding_type == "rope"
        if cfg.recompute_granularity == "full":
            self.recompute = (cfg.recompute_method, cfg.recompute_num_layers)
        self.embedding = nn.Embedding(self.padded_vocab_size, cfg.hidden_size)
        self.position_embedding = None if self.use_rope else nn.Embedding(self.max_positions, cfg.hidden_size)
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)
        moe = moe_layer_pattern(cfg)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i, moe[i]) for i in range(cfg.num_layers))
        self.final_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, cfg.fused_kernels)
        # Multi-token prediction (models/mtp.py): one block of the last block's kind per depth, numbered after them.
        self.mtp = nn.ModuleList(PredictionDepth(cfg, TransformerBlock(cfg, cfg.num_layers + k, moe[-1]))
                                 for k in range(cfg.mtp_num_layers))  # fmt: skip
        self.mtp_loss_sums = LossSums()
        self.output = OutputLayer(cfg.hidden_size, self.padded_vocab_size, cfg.tie_embeddings, cfg.fused_kernels, vocab_size=vocab_size,
                                   weight_reused=cfg.mtp_num_layers > 0)  # fmt: skip
        # RoPE tables stay fp32 and out of the state dict: a buffer would be cast to bf16 along
        # with the weights by ``model.to(torch.bfloat16)``. Built per device on first use.
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        # Stacked expert weights draw one tensor per global expert id; their fc2 is a residual output too.
        self.weight_init = WeightInit.scaled_by_depth(cfg.init_method_std, cfg.num_layers, RESIDUAL_OUTPUTS + EXPERT_WEIGHTS[1:],
                                                      EXPERT_WEIGHTS)  # fmt: skip
        init_weights(self, self.weight_init)

    # ------------------------------------------------------------------ one process: read top to bottom

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        kv_cache: KVCacheBase | None = None,
    ) -> torch.Tensor:
        """tokens [b, s] -> per-token loss [b, s] (fp32) when ``labels`` is given, else logits [b, s, V].

        With ``kv_cache``, tokens continue the cached sequence and positions default to follow it.
        """
        b, s = tokens.shape
        if kv_cache is not None:
            if document_ids is not None:
                raise ValueError("document_ids cannot be combined with a KV cache")
            if position_ids is None:
                position_ids = torch.arange(kv_cache.length, kv_cache.length + s, device=tokens.device).expand(b, s)
        batch = {"tokens": tokens, "position_ids": position_ids, "document_ids": document_ids, "labels": labels}
        inputs = self.block_inputs(batch)
        inputs["kv_cache"] = kv_cache
        carry, _ = self.forward_blocks(self.embed(batch), inputs, list(self.layers))
        if kv_cache is not None:
            kv_cache.advance(s)
        return self.head(carry, batch)

    # ------------------------------------------------------------------ the contract's pieces

    def parallel_plan(self) -> c.Plan:
        return decoder_plan(self.cfg)

    def pipeline_pieces(self) -> c.PipelinePieces:
        """The last stage holds the embedding too when it is tied or multi-token prediction embeds there."""
        shared = ("embedding", "embedding_dropout") if self.cfg.tie_embeddings or self.cfg.mtp_num_layers else ()
        mtp = ("mtp", "mtp_loss_sums") if self.cfg.mtp_num_layers else ()
        return c.PipelinePieces(("embedding", "position_embedding", "embedding_dropout"), "layers", ("final_norm", "output", *mtp, *shared))

    def prepare_batch(self, batch: c.Batch) -> c.Batch:
        return shifted_targets(batch, self.cfg.mtp_num_layers)

    def embed(self, batch: c.Batch) -> c.Carry:
        tokens, position_ids = batch["tokens"], batch.get("position_ids")
        hidden = self.embedding(tokens)
        if self.position_embedding is not None:
            positions = position_ids if position_ids is not None else torch.arange(tokens.shape[1], device=tokens.device)
            hidden = hidden + self.position_embedding(positions)
        return {"hidden": self.embedding_dropout(hidden)}

    def block_inputs(self, batch: c.Batch) -> dict[str, Any]:
        cos, sin = self.rope_tables(batch["tokens"].device) if self.use_rope else (None, None)
        return {"cos": cos, "sin": sin, "position_ids": batch.get("position_ids"), "document_ids": batch.get("document_ids")}

    def run_blocks(self, carry: c.Carry, inputs: dict[str, Any], blocks: list[nn.Module]) -> tuple[c.Carry, dict[str, torch.Tensor]]:
        """The blocks in order; a mixture-of-experts block's balancing losses are the auxiliary
        terms, named per kind and layer (``load_balancing/3``)."""
        hidden, aux = carry["hidden"], {}
        for block in blocks:
            hidden = block(hidden, **inputs)
            aux.update(_balancing_terms(block))
        return {"hidden": hidden}, aux

    def head(self, carry: c.Carry, batch: c.Batch) -> torch.Tensor | c.SummedTokenLoss | c.HeadWithAux:
        """Per-token loss [b, s] in fp32 with labels in the batch, else logits; with labels and a
        ``loss_mask`` under ``--cross-entropy-loss-fusion``, the masked sum (its gradients taken in
        the forward). With prediction depths and their targets in the batch (``prepare_batch``),
        that with the depths' loss terms."""
        hidden = self.final_norm(carry["hidden"])
        main = self._token_loss(hidden, batch.get("labels"), batch.get("loss_mask"))
        if not self.cfg.mtp_num_layers or target_keys(1)[0] not in batch:
            return main
        return c.HeadWithAux(main, self._multi_token_prediction(hidden, batch))

    def _token_loss(self, hidden: torch.Tensor, labels: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor | c.SummedTokenLoss:
        """The output layer on normalized ``hidden``: logits, per-token losses, or their masked sum (see ``head``)."""
        return token_loss(self, hidden, labels, mask)

    def _multi_token_prediction(self, hidden: torch.Tensor, batch: c.Batch) -> dict[str, torch.Tensor]:
        """Each depth's weighted loss (``mtp_loss/k``) and its block's balancing terms, from the
        main model's final hidden states (after its final norm, as Megatron-Core and DeepSeek's
        inference feed them; ``models/mtp.py``)."""
        inputs, aux = self.block_inputs(batch), {}
        scale = self.cfg.mtp_loss_scaling_factor / self.cfg.mtp_num_layers
        for k, depth in enumerate(self.mtp, start=1):
            tokens, labels, mask = (batch[key] for key in target_keys(k))
            hidden = depth(hidden, self.embedding_dropout(self.embedding(tokens)), inputs)
            loss = self._token_loss(hidden, labels, mask)
            total = loss.total if isinstance(loss, c.SummedTokenLoss) else (loss * mask).sum()
            aux[f"mtp_loss/{k}"] = depth_loss(self.mtp_loss_sums, total, mask, scale)
            aux.update(_balancing_terms(depth.layer))
        return aux

    # ------------------------------------------------------------------ helpers

    def rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (cos, sin) [max_positions, rotary dims] on ``device``, computed once per device: the
        head dim, or MLA's decoupled rope dims; Llama 3.1's or YaRN's scaling as configured."""
        if self._rope_tables is None or self._rope_tables[0].device != device:
            self._rope_tables = rope_tables(self.cfg, rope_table_dim(self.cfg), self.max_positions, device)
        return self._rope_tables

    def new_kv_cache(self, batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device) -> KVCacheBase:
        """An empty cache for generating up to ``max_length`` positions: per-head keys and values,
        or MLA's latent rows (kv_lora_rank + rope dims per token and layer)."""
        cfg = self.cfg
        if cfg.multi_latent_attention:
            return LatentKVCache(cfg.num_layers, batch_size, max_length, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim, dtype, device)
        return KVCache(cfg.num_layers, batch_size, max_length, num_kv_heads(cfg), head_dim(cfg), dtype, device)


def token_loss(model: c.TokenLossModel, hidden: torch.Tensor, labels: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor | c.SummedTokenLoss:
    """``model.output`` (the embedding's weight given when tied) on ``hidden``: logits without
    labels, per-token losses, or with a loss ``mask`` under ``--cross-entropy-loss-fusion`` their
    masked sum, its gradients taken in the forward (shared with BERT's LM head)."""
    tied = model.embedding.weight if model.cfg.tie_embeddings else None
    if labels is not None and mask is not None and model.cfg.cross_entropy_loss_fusion:
        return c.SummedTokenLoss(model.output(hidden, labels, tied_weight=tied, loss_weights=mask))
    return model.output(hidden, labels, tied_weight=tied)


def _balancing_terms(block: TransformerBlock) -> dict[str, torch.Tensor]:
    """A mixture-of-experts block's balancing losses, named per kind and layer (``load_balancing/3``)."""
    if not isinstance(block.mlp, MoELayer):
        return {}
    layer = block.self_attention.layer_number
    return {f"{kind}/{layer}": value for kind, value in block.mlp.last_aux_losses.items()}


def num_parameters(model: Decoder, exclude_embeddings: bool = False) -> int:
    """Parameters of ``model`` (a tied matrix counted once).

    ``exclude_embeddings`` leaves out the token and position tables and an untied output layer,
    the "non-embedding" count used in scaling laws.
    """
    total = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        tables = (model.embedding, model.position_embedding, model.output)  # a tied output layer holds no parameter
        total -= sum(p.numel() for m in tables if m is not None for p in m.parameters())
    return total
