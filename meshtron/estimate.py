"""``meshtron estimate``: GPU memory of one rank for a config and layout, before renting GPUs.

    meshtron estimate --config run.toml [--world-size N] [--print-mesh] [--flag value ...]

Three parts, for the first pipeline stage (the embedding and the most micro batches in flight):

- parameters: this rank's share, read from the plan's records on the meta-built model
  (``parallel/sizes.py``): the dense part split by tp (and pp), the routed experts by ep and etp;
  in the compute dtype;
- gradients and optimizer state: the fp32 gradient buffer (4 bytes/param, never sharded by the
  distributed optimizer, which reduce-scatters out of it), fp32 masters (4, none in fp32 mode, where
  the master is the param) and the update rule's state (AdamW's two moments, 8; Muon's momentum of
  a matrix, 4; SGD's momentum, 4), the last two split by the distributed
  optimizer over the group each parameter reduces over: dp x cp for dense parameters, the
  expert-data-parallel group (dp x cp / ep) for routed experts; FSDP2 shards all three over the
  same groups and keeps fp32 params;
- activations: what autograd keeps per token per block in the fused GPU path (see
  ``activation_bytes_per_token_layer``), times each block's tokens (T5's decoder blocks see the
  decoder's, the retriever's towers a query and a context each), the stage's blocks and the micro
  batches in flight, plus the output layer's loss workspace;
- FP8 weight copies: with FP8 and several micro batches a step, the FP8 copies of the stage's
  block weights kept for the step (``fp8_weight_copy_bytes``).

Transient buffers of the allocator (fragmentation, cuBLAS workspaces, all-to-all staging), uneven
expert loads (the routed-expert terms assume every expert gets its share) and the inference path
are not modeled.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from meshtron.config import Config, TrainConfig, build_config, data_parallel_size, recomputes_core_attention, virtual_stages
from meshtron.data.data_sources import names_data
from meshtron.data.default_data import EMBEDDED_VOCAB_SIZE
from meshtron.training.vocab import model_vocab_size, run_tokenizer
from meshtron.validation import validate
from meshtron.kernels.cross_entropy import CHUNK_ELEMENTS, default_chunk_size
from meshtron.kernels.cross_entropy_sum import LOGITS_BUDGET_BYTES, block_tokens_for
from meshtron.kernels.fp8 import resolve_backend
from meshtron.kernels.fp8_scaling import Fp8Recipe
from meshtron.layers.attention import head_dim, num_kv_heads
from meshtron.layers.mlp import ffn_hidden_size
from meshtron.layers.moe.experts import expert_ffn_hidden_size
from meshtron.layers.moe.fp8_grouped_gemm import fp8_experts
from meshtron.models import num_blocks, padded_vocab_size, parameter_count, pipeline_costs, spec_for
from meshtron.models.mtp import mtp_parameter_count
from meshtron.parallel.mesh import GROUP_DIMS, Mesh
from meshtron.parallel.pipeline_balance import pipeline_split
from meshtron.parallel.pipeline_schedules import model_chunk
from meshtron.parallel.sizes import rank_parameters
from meshtron.optim.update_rules import rule_of_param

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "auto": 2}  # auto: bf16, the GPU default


@dataclass
class MemoryEstimate:
    dense_params: int  # this rank's parameters outside the routed experts
    expert_params: int  # this rank's routed-expert parameters
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    loss_bytes: int
    gathered_bytes: int = 0  # FSDP2's unsharded copies while a block runs (``fsdp_gathered_bytes``)
    fp8_weight_bytes: int = 0  # the block weights' FP8 copies kept for a step (``fp8_weight_copy_bytes``)

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def total_bytes(self) -> int:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes + self.loss_bytes + self.gathered_bytes
                + self.fp8_weight_bytes)  # fmt: skip

    def table(self) -> str:
        rows = [("parameters", self.param_bytes), ("gradients (fp32 buffer)", self.grad_bytes),
                ("optimizer (masters + state)", self.optimizer_bytes), ("activations", self.activation_bytes),
                ("loss workspace", self.loss_bytes)] + ([("FSDP2 gathered (transient)", self.gathered_bytes)] if self.gathered_bytes else [])
        rows += [("FP8 weight copies (a step)", self.fp8_weight_bytes)] if self.fp8_weight_bytes else []
        rows += [("total", self.total_bytes)]  # fmt: skip
        split = f" (dense {self.dense_params / 1e6:,.1f} M, routed experts {self.expert_params / 1e6:,.1f} M)" if self.expert_params else ""
        lines = [f"parameters on this rank: {self.params / 1e6:,.1f} M{split}"]
        lines += [f"  {name:<28} {value / GIB:8.2f} GiB" for name, value in rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class StageParameters:
    """One rank's parameters on the first pipeline stage: ``dense`` (reduced over dp x cp) and
    ``expert`` (routed experts, reduced over the expert-data-parallel group)."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def _vocab(cfg: Config) -> int:
    m = cfg.model
    return padded_vocab_size(m.vocab_size or 32000, m.make_vocab_size_divisible_by, cfg.parallel.tensor_parallel)


def micro_batches(cfg: Config, world_size: int = 1) -> int:
    """Micro batches a data-parallel rank runs per step out of ``world_size``."""
    t = cfg.train
    return t.global_batch_size // max(1, t.micro_batch_size * data_parallel_size(cfg, world_size))


def first_stage_blocks(cfg: Config, count: int, world_size: int = 1) -> list[int]:
    """Indices (of ``count`` blocks in model order) that pipeline rank 0 holds, over its virtual
    chunks, under the split training uses (``pipeline_split``, refined for the micro batches a
    data-parallel rank runs out of ``world_size``)."""
    from meshtron.parallel.setup import schedule_kind

    p = cfg.parallel
    if p.pipeline_parallel == 1:
        return list(range(count))
    blocks = num_blocks(cfg.model)
    virtual = virtual_stages(p, blocks)
    micro = micro_batches(cfg, world_size)
    costs = pipeline_costs(cfg.model, _vocab(cfg), cfg.data.seq_length)
    kind = schedule_kind(p, virtual)
    ranges = pipeline_split(p, blocks, virtual, costs, kind, micro)
    return [i for v in range(virtual) for i in ranges[model_chunk(kind, p.pipeline_parallel, 0, v)]]


def stage_parameters(cfg: Config, world_size: int = 1, matrices: bool = False) -> StageParameters:
    """Parameters of one rank on the first pipeline stage (the embedding's; with pp 1 the whole
    model); ``matrices``: only those that are matrices (``ParamMeta.matrix``, Muon's)."""
    p = cfg.parallel
    parts = rank_parameters(cfg.model, _vocab(cfg), cfg.data.seq_length, p.tensor_parallel, p.expert_parallel, p.expert_tensor_parallel)
    blocks = [parts.blocks[i] for i in first_stage_blocks(cfg, len(parts.blocks), world_size)]
    if matrices:
        tail = parts.tail_matrix if p.pipeline_parallel == 1 else 0
        return StageParameters(parts.head_matrix + tail + sum(b.dense_matrix for b in blocks), sum(b.expert_matrix for b in blocks))
    tail = parts.tail if p.pipeline_parallel == 1 else 0
    return StageParameters(parts.head + tail + sum(b.dense for b in blocks), sum(b.expert for b in blocks))


def model_parameters(cfg: Config) -> tuple[int, int, int]:
    """(total, active per token, active without the input embedding): the whole model's counts,
    where a mixture-of-experts layer's active parameters are its top-k and shared experts."""
    m, vocab = cfg.model, _vocab(cfg)
    active = parameter_count(m, vocab, cfg.data.seq_length, active=True)
    return parameter_count(m, vocab, cfg.data.seq_length), active, active - vocab * m.hidden_size


def token_shard(cfg: Config) -> int:
    """How many ranks share a sequence's tokens in the replicated modules (tp under sequence parallelism)."""
    p = cfg.parallel
    return p.tensor_parallel if p.sequence_parallel and p.tensor_parallel > 1 else 1


def attention_bytes_per_token(cfg: Config, a: int, linear_in: int, keep_core: bool) -> float:
    """Per token, one rank: a standard attention keeps its QKV output (alive because v is a view
    of it), RoPE'd q and k (with RoPE), with ``--qk-layernorm`` the q norm's input and the norms'
    statistics (full-width norms: both inputs and outputs in fp32), the attention output and log-sum-exp (``keep_core``) and
    the projection's input (counted as a contiguous copy; a kernel whose output is laid out
    [b, s, heads, d] makes it a view). MLA keeps its down-projections' outputs (whole on every
    rank, sequence-sharded under sp; the latent norms keep them), the normed latents the
    up-projections keep (gathered), and per head the key/value up-projection's output (v is a
    view of it), the RoPE'd query and the assembled key, the attention output and log-sum-exp
    and the projection's input."""
    m, tp = cfg.model, cfg.parallel.tensor_parallel
    heads = m.num_attention_heads

    def core(width: int) -> float:
        return a * width + 4 * heads if keep_core else 0

    if m.multi_latent_attention:
        q_width, lora, rank = heads * (m.qk_head_dim + m.qk_pos_emb_head_dim), m.q_lora_rank, m.kv_lora_rank
        down = a * (rank + m.qk_pos_emb_head_dim + lora) / token_shard(cfg)
        by_heads = 2 * a * q_width + a * heads * (m.qk_head_dim + m.v_head_dim) + core(heads * m.v_head_dim) + linear_in * heads * m.v_head_dim
        return down + linear_in * (rank + lora) + by_heads / tp
    q, kv = heads * head_dim(m), num_kv_heads(m) * head_dim(m)
    roped = a * (q + kv) if m.position_embedding_type == "rope" else 0  # learned positions attend q, k, v as views
    # --qk-layernorm: the q norm keeps its input (q's heads flattened out of QKV: a copy; k stays a
    # view) and both keep fp32 statistics per head row. Full-width (OLMoE's, torch ops): each keeps
    # its input and its normed output in fp32 and one fp32 statistic per token.
    qk_norms = a * q + 4 * (heads + num_kv_heads(m)) if m.qk_layernorm else 0
    if m.qk_layernorm and m.qk_layernorm_span == "full":
        qk_norms = 8 * (q + kv) + 8
    return (a * (q + 2 * kv) + roped + qk_norms + core(q) + linear_in * q) / tp


def moe_bytes_per_token(cfg: Config, a: int) -> float:
    """Per token, one rank, of a mixture-of-experts layer (r = bytes of the router dtype):

    the router's softmax outputs (fp32 [E], twice: routing and balancing), int64 expert and token
    indices (4 k) and the routing weights (r k); per each of the top-k copies of the token the
    expert input row (kept by the grouped GEMM; a tp rank's own rows, which it has alone under
    sequence parallelism and keeps 1/tp of otherwise, unless etp = tp shares them; gathered over
    etp), the expert's hidden state (fc1's output and the activation's, of those rows, split over
    etp) and the combine's copy of the expert output, kept to weight it by the routing
    probability: dropless with fused kernels one row in the compute dtype (the gather kernel's
    input), else two rows in r bytes (the reference's upcast, and the weighted row kept by its
    scatter-add); the shared experts' hidden state, whole on every tp rank. With
    ``--moe-pad-expert-input-to-capacity`` every expert computes its whole capacity.
    """
    m, p = cfg.model, cfg.parallel
    shard, h, ffn, k = token_shard(cfg), m.hidden_size, expert_ffn_hidden_size(m), m.moe_router_topk
    r = DTYPE_BYTES.get(m.moe_router_dtype, 8) if m.moe_router_dtype else a
    kept_per_ffn = (3 if m.activation == "swiglu" else 2) * a
    padded = m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor
    copies = k * (m.moe_expert_capacity_factor if padded else 1)
    tp, etp = p.tensor_parallel, p.expert_tensor_parallel
    shared_by_etp = shard == 1 and etp == tp  # the etp group is the tp group and holds the same rows
    own = 1 if shared_by_etp else 1 / tp  # this rank's share of the copies: its sequence shard, or its 1/tp of shared rows
    rows = own if shared_by_etp else own * etp  # gathered over etp
    fused_combine = m.fused_kernels != "off" and m.moe_expert_capacity_factor <= 0 and r != 8
    combine = (a if fused_combine else 2 * r) * h / shard
    routed = copies * (a * h * rows + kept_per_ffn * ffn * rows / etp + combine)
    # The input cast to r, kept for the gate's backward; not by the fp32 gate of bf16 operands (kernels/fp32_gate.py).
    cast = r * h if r != a and not (r == 4 and cfg.train.precision in ("bf16", "auto")) else 0
    router = 2 * 4 * m.num_experts + 4 * 8 * k + r * k + cast
    shared = kept_per_ffn * m.moe_shared_expert_intermediate_size
    return (router + shared) / shard + routed


def activation_bytes_per_token_layer(cfg: Config, granularity: str | None = None, is_moe: bool = False) -> float:
    """Bytes autograd keeps per token of one block (a = bytes of the compute dtype):

    input x and its norm's output (a h each; the norm keeps x, the QKV linear its input), the
    attention's (``attention_bytes_per_token``), then the same two for the MLP's norm (2 a h),
    fc1's output (2 a ffn, kept by SwiGLU) and SwiGLU's output (a ffn, kept by fc2), or a
    mixture of experts' (``moe_bytes_per_token``). Tensor-parallel parts divide by tp; x and the
    norm outputs do not (with sequence parallelism x does; a linear still keeps its gathered
    input). FP8 linears keep 1-byte copies of their inputs. ``selective`` recompute drops the
    attention output and log-sum-exp.
    """
    m, p, t = cfg.model, cfg.parallel, cfg.train
    a = DTYPE_BYTES[t.precision]
    linear_in = 1 if m.fp8_format else a  # what a linear keeps of its input
    residual = 2 * a * m.hidden_size / token_shard(cfg)  # x before each norm
    norm_outputs = 2 * linear_in * m.hidden_size  # kept (gathered, under sp) by the QKV and fc1 linears
    keep_core = not recomputes_core_attention(m, granularity)
    attention = attention_bytes_per_token(cfg, a, linear_in, keep_core)
    if is_moe:  # --moe-layer-recompute: the layer keeps only its input, the norm output counted above
        return residual + norm_outputs + attention + (0 if m.moe_layer_recompute else moe_bytes_per_token(cfg, a))
    ffn = ffn_hidden_size(m)
    mlp = (2 if m.activation == "swiglu" else 1) * a * ffn + linear_in * ffn
    return residual + norm_outputs + attention + mlp / p.tensor_parallel


def _cross_attention_bytes(cfg: Config) -> tuple[float, float]:
    """T5's cross-attention, per (decoder token, encoder token) of one rank: its norm's input and
    output, q, the attention output and log-sum-exp, the projection's input; the encoder
    tokens' keys and values."""
    m, tp = cfg.model, cfg.parallel.tensor_parallel
    a = DTYPE_BYTES[cfg.train.precision]
    width, linear_in = m.num_attention_heads * head_dim(m), 1 if m.fp8_format else a
    per_decoder_token = a * m.hidden_size / token_shard(cfg) + linear_in * m.hidden_size
    per_decoder_token += (2 * a * width + 4 * m.num_attention_heads + linear_in * width) / tp
    return per_decoder_token, 2 * a * width / tp


def block_activations(cfg: Config) -> list[tuple[float, float]]:
    """(tokens, bytes) of one micro batch for every block in model order: its tokens on this
    rank (for the hidden state full recompute keeps) and what it keeps for backward."""
    t, cp = cfg.train, cfg.parallel.context_parallel
    per_token = activation_bytes_per_token_layer(cfg)
    cross_q, cross_kv = _cross_attention_bytes(cfg)
    out = []
    for block in spec_for(cfg.model).block_shapes(cfg):
        tokens = t.micro_batch_size * block.tokens / cp
        if block.cross_tokens:  # the queries on its own tokens, the keys and values on the other sequence's
            out.append((tokens, tokens * (per_token + cross_q) + t.micro_batch_size * block.cross_tokens / cp * cross_kv))
        else:
            out.append((tokens, tokens * (activation_bytes_per_token_layer(cfg, is_moe=True) if block.moe else per_token)))
    return out


def activation_bytes(cfg: Config, world_size: int = 1) -> int:
    """Activations of the first pipeline stage: its blocks x micro batches in flight (1F1B keeps
    up to pp of them on the first stage), or under full recompute the checkpointed inputs plus one
    recomputed group; with ``--moe-layer-recompute`` or full recompute of a MoE model plus one MoE
    layer's activations. At pp 1 the stage is
    the last too: each multi-token prediction depth keeps a block like the last (never recomputed)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    all_blocks = block_activations(cfg)
    blocks = [all_blocks[i] for i in first_stage_blocks(cfg, len(all_blocks), world_size)]
    depths = all_blocks[-1][1] * m.mtp_num_layers if p.pipeline_parallel == 1 else 0
    micro = micro_batches(cfg, world_size)
    in_flight = min(p.pipeline_parallel, micro) if p.pipeline_parallel > 1 else 1
    # --moe-layer-recompute: one MoE layer's activations exist again while its backward runs. Full
    # recompute counts the rerun group below; its MoE layer's backward adds the expert rows'
    # gradients and all-to-all buffers while the rerun's tensors are freed one by one: at most a
    # row per copy more than the rerun saved (a CPU layer measured 0.4 of this term), counted as
    # the whole term. Nothing of a passed block's rerun stays: a MoE layer keeps no rerun's
    # losses, whose graph held its attention's activations (models/recompute.py; the measured
    # peaks before that: benchmarks/estimate_recheck.py).
    moe_rerun = 0
    if m.num_experts and (m.moe_layer_recompute or m.recompute_granularity == "full"):
        moe_rerun = max(tokens for tokens, _ in blocks) * moe_bytes_per_token(cfg, DTYPE_BYTES[t.precision])
    if m.recompute_granularity != "full":
        return int(sum(kept for _, kept in blocks) * in_flight + moe_rerun + depths)
    kept_per_token = m.hidden_size * DTYPE_BYTES[t.precision] / token_shard(cfg)
    n = min(m.recompute_num_layers, len(blocks))
    if m.recompute_method == "uniform":  # groups of n blocks, each keeping its input
        starts = range(0, len(blocks), n)
        stage = sum(blocks[i][0] * kept_per_token for i in starts)
        recomputed = max(sum(kept for _, kept in blocks[i : i + n]) for i in starts)
    else:  # block: the first n blocks keep their inputs, the rest everything
        stage = sum(tokens * kept_per_token for tokens, _ in blocks[:n]) + sum(kept for _, kept in blocks[n:])
        recomputed = sum(kept for _, kept in blocks[:n])
    return int(stage * in_flight + recomputed + moe_rerun + depths)


def loss_bytes(cfg: Config) -> int:
    """The output layer's workspace (one rank): the final norm's input and output, a chunk of
    logits (``CHUNK_ELEMENTS``; the whole fp32 logits and their gradient when fused kernels are
    off; under ``--cross-entropy-loss-fusion``, the logits of a token block up to
    ``LOGITS_BUDGET_BYTES`` and the weight gradient kept until backward; with ``--fp8-output-layer``
    the call's FP8 copies too: ``fp8_output_bytes``), and the fp32 sum of the
    hidden-state gradient, over the tokens that have labels (T5's decoder tokens); what a call keeps
    for backward once per call (the main head's and each multi-token prediction depth's). Counted where
    pp is 1 (with pp > 1 the last stage holds it and fewer micro batches); the retriever's
    in-batch scores are negligible."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    seq = spec_for(m).output_tokens(cfg.data)
    if p.pipeline_parallel > 1 or not seq:
        return 0
    a = DTYPE_BYTES[t.precision]
    tokens = t.micro_batch_size * seq // p.context_parallel
    vocab = _vocab(cfg) // p.tensor_parallel
    kept, transient = tokens * m.hidden_size * (2 * a + 4), 0
    if m.fused_kernels == "off":
        kept += tokens * vocab * 4 * 2
    elif m.cross_entropy_loss_fusion:
        kept, transient = kept + vocab * m.hidden_size * a, min(LOGITS_BUDGET_BYTES, tokens * vocab * a)
        if m.fp8_format and m.fp8_output_layer:
            transient += fp8_output_bytes(tokens, vocab, m.hidden_size, a)
    else:
        transient = min(CHUNK_ELEMENTS, tokens * vocab) * a
    return int(kept * (1 + m.mtp_num_layers) + transient)


def fp8_output_bytes(tokens: int, vocab: int, hidden: int, a: int) -> int:
    """What ``--fp8-output-layer`` holds during one fused-loss call (``kernels/fp8_output.py``), 1
    byte an element: the hidden states' and the weight's two copies each, and one chunk's gradient in
    both layouts with the chunk's contiguous transposed weight rows (``a``: the compute dtype's
    bytes, which size the token blocks). Counted for every head (one with a bias stays bf16)."""
    block = block_tokens_for(tokens, vocab, a, LOGITS_BUDGET_BYTES)
    chunk = default_chunk_size(block, vocab)
    return 2 * tokens * hidden + 2 * vocab * hidden + 2 * block * chunk + hidden * chunk


def estimate(cfg: Config, world_size: int = 1) -> MemoryEstimate:
    """The memory of one rank of a ``world_size``-process run of ``cfg``."""
    p, t = cfg.parallel, cfg.train
    dp_cp = max(1, data_parallel_size(cfg, world_size) * p.context_parallel)
    edp = max(1, dp_cp * p.tensor_parallel // (p.expert_parallel * p.expert_tensor_parallel))
    params = stage_parameters(cfg, world_size)

    def sharded(per_param: int, shard: bool = True) -> int:
        """``per_param`` bytes of every parameter, each part split over the group it reduces over."""
        return per_param * params.dense // (dp_cp if shard else 1) + per_param * params.expert // (edp if shard else 1)

    matrices = stage_parameters(cfg, world_size, matrices=True)

    def optimizer_bytes(per_param: int, shard: bool) -> int:
        """``per_param`` bytes of every parameter plus its rule's state (``rule_state_bytes``: Muon's
        matrices differ from the rest), each part split over the group it reduces over when ``shard``
        (the layer-wise split of whole parameters, for Muon and SGD, balanced by size: counted as even)."""
        matrix, other = per_param + rule_state_bytes(t, True), per_param + rule_state_bytes(t, False)
        dense = matrix * matrices.dense + other * (params.dense - matrices.dense)
        expert = matrix * matrices.expert + other * (params.expert - matrices.expert)
        return dense // (dp_cp if shard else 1) + expert // (edp if shard else 1)

    if p.fsdp and dp_cp > 1:  # fp32 sharded params (the masters), gradients and the rules' state; one rank trains plainly
        param_bytes, grad_bytes, opt_bytes = sharded(4), sharded(4), optimizer_bytes(0, True)
    else:
        # fp32 masters, the rules' state, and AdamW's fused step's uint8 parameter-group index per element
        # (the step is fused wherever it runs on a GPU, unless --optimizer-impl reference or another rule).
        fused = t.optimizer == "adam" and (t.optimizer_impl == "fused" or (t.optimizer_impl == "auto" and t.device != "cpu"))
        param_bytes, grad_bytes = DTYPE_BYTES[t.precision] * params.total, 4 * params.total
        opt_bytes = optimizer_bytes((4 if t.precision != "fp32" else 0) + (1 if fused else 0), p.use_distributed_optimizer)
    return MemoryEstimate(params.dense, params.expert, param_bytes, grad_bytes, opt_bytes, activation_bytes(cfg, world_size), loss_bytes(cfg),
                          fsdp_gathered_bytes(cfg, world_size), fp8_weight_copy_bytes(cfg, world_size))  # fmt: skip


def fp8_weight_copy_bytes(cfg: Config, world_size: int = 1) -> int:
    """The FP8 copies a step of several micro batches keeps of the first stage's block weights
    (``kernels/step_cache.py``): both layouts, 1 byte each, of every linear weight in the blocks
    (meshtron's FP8 linears; none on torchao's backend or under ``--compile``, which cast per micro
    batch; a linear too narrow for FP8 is counted all the same) and, with FP8 experts, of the routed
    experts' weights; whole weights, also under FSDP2 (the copies are of the gathered weight). Zero
    without FP8 or with one micro batch a step."""
    m, p = cfg.model, cfg.parallel
    if not m.fp8_format or micro_batches(cfg, world_size) <= 1:
        return 0
    parts = rank_parameters(m, _vocab(cfg), cfg.data.seq_length, p.tensor_parallel, p.expert_parallel, p.expert_tensor_parallel)
    blocks = [parts.blocks[i] for i in first_stage_blocks(cfg, len(parts.blocks), world_size)]
    meshtron_linears = resolve_backend(Fp8Recipe(m.fp8_format, m.fp8_recipe), m.fp8_backend, p.tensor_parallel > 1) == "meshtron"
    linears = sum(b.dense_matrix for b in blocks) if meshtron_linears and not cfg.train.compile else 0
    experts = sum(b.expert_matrix for b in blocks) if fp8_experts(m) else 0
    return 2 * (linears + experts)


def fsdp_gathered_bytes(cfg: Config, world_size: int = 1) -> int:
    """FSDP2's unsharded buffers at their peak, in the backward of a block: the root's parameters
    (embedding, final norm, output layer: the root is not resharded after forward) and two blocks'
    gathered in the compute dtype (the running block and the one prefetched), and the running
    block's unsharded gradient, in the compute dtype and again in fp32 for the reduce-scatter.
    Zero without FSDP2 or without data-parallel ranks to shard over."""
    p, t = cfg.parallel, cfg.train
    if not p.fsdp or data_parallel_size(cfg, world_size) * p.context_parallel <= 1:
        return 0
    a = DTYPE_BYTES[t.precision]
    parts = rank_parameters(cfg.model, _vocab(cfg), cfg.data.seq_length, p.tensor_parallel, p.expert_parallel, p.expert_tensor_parallel)
    root = parts.head + (parts.tail if p.pipeline_parallel == 1 else 0)
    sizes = sorted((parts.blocks[i].dense + parts.blocks[i].expert for i in first_stage_blocks(cfg, len(parts.blocks), world_size)),
                   reverse=True)  # fmt: skip
    return a * root + a * sum(sizes[:2]) + (a + 4) * sizes[0]


def rule_state_bytes(t: TrainConfig, matrix: bool) -> int:
    """Bytes per parameter of its update rule's state (masters apart): AdamW's two moments (8 in
    fp32), Muon's momentum (4, matrices only), SGD's momentum (4; none without momentum)."""
    rule = rule_of_param(t.optimizer, matrix)
    if rule == "muon":
        return 4
    if rule == "sgd":
        return 4 if t.sgd_momentum else 0
    return sum(DTYPE_BYTES[d] for d in (t.exp_avg_dtype, t.exp_avg_sq_dtype))


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.1f} M"


def training_vocab_size(cfg: Config) -> int:
    """The padded vocabulary the run would train with: its tokenizer's when it names one (or the
    embedded corpus's when it names no data), else ``--vocab-size`` (32000 by default)."""
    if not (cfg.data.mock or names_data(cfg.data)):
        return max(cfg.model.vocab_size, EMBEDDED_VOCAB_SIZE)
    return model_vocab_size(cfg, run_tokenizer(cfg))


def mesh_table(cfg: Config, world_size: int) -> str:
    """Every rank's coordinates, then the groups (``Mesh.describe``)."""
    mesh = Mesh.from_config(cfg.parallel, world_size=world_size, rank=0, local_rank=0)
    lines = [mesh.describe(), "  rank  " + " ".join(f"{d:>6}" for d in GROUP_DIMS)]
    for r in range(world_size):
        c = mesh.coords(r)
        lines.append(f"  {r:>4}  " + " ".join(f"{c[d]:>6}" for d in GROUP_DIMS))
    return "\n".join(lines)


def default_batches(cfg: Config, config_file: str | None, overrides: list[str], world_size: int) -> str | None:
    """Batch sizes the user gave neither on the command line nor in the config: micro batch 1 and
    a global batch of micro x dp (Megatron-LM's rule without --global-batch-size), set on ``cfg``
    and stated. The training defaults (8 and 16) suit small CPU runs, not a preset's layout."""
    from meshtron.config import load_file, parse_overrides

    given = {*parse_overrides(overrides), *(f"train.{k}" for k in (load_file(config_file) if config_file else {}).get("train", {}))}
    t, missing = cfg.train, [f for f in ("micro_batch_size", "global_batch_size") if f"train.{f}" not in given]
    if not missing:
        return None
    if "micro_batch_size" in missing:
        t.micro_batch_size = 1
    if "global_batch_size" in missing:
        t.global_batch_size = t.micro_batch_size * max(1, data_parallel_size(cfg, world_size))
    said = {"micro_batch_size": "micro 1", "global_batch_size": "global = micro x dp, Megatron-LM's rule"}
    return (f"batch: micro {t.micro_batch_size}, global {t.global_batch_size} (not given, so {' and '.join(said[f] for f in missing)}; "
            "set them with --micro-batch-size, --global-batch-size)")  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshtron estimate", description="predict per-GPU memory of a run")
    parser.add_argument("--config", default=None)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--print-mesh", action="store_true", help="also print every rank's place in the layout")
    known, overrides = parser.parse_known_args(argv)
    cfg = build_config(known.config, overrides)
    batch_note = default_batches(cfg, known.config, overrides, known.world_size)
    validate(cfg, world_size=known.world_size)
    cfg.model.vocab_size = training_vocab_size(cfg)
    if known.print_mesh:
        print(mesh_table(cfg, known.world_size))
    p, m = cfg.parallel, cfg.model
    dp = data_parallel_size(cfg, known.world_size)
    edp = p.tensor_parallel * p.context_parallel * dp // (p.expert_parallel * p.expert_tensor_parallel)
    experts = f", ep {p.expert_parallel}, etp {p.expert_tensor_parallel}, edp {edp}" if m.num_experts else ""
    print(f"layout: world {known.world_size}, tp {p.tensor_parallel}, pp {p.pipeline_parallel}, cp {p.context_parallel}, "
          f"dp {dp}{experts}, sp {p.sequence_parallel}, distributed optimizer {p.use_distributed_optimizer}, fsdp {p.fsdp}, "
          f"recompute '{m.recompute_granularity or 'none'}'")  # fmt: skip
    if batch_note:
        print(batch_note)
    print(f"vocabulary: {m.vocab_size} rows (padded)")
    total, active, active_body = model_parameters(cfg)
    depths = ""
    if m.mtp_num_layers:
        mtp, n = mtp_parameter_count(m, _vocab(cfg), cfg.data.seq_length), m.mtp_num_layers
        depths = f" ({_count(total - mtp)} main model, {_count(mtp)} in {n} multi-token prediction depth{'s' if n > 1 else ''})"
    if active < total:
        print(f"model: {_count(total)} parameters{depths}, {_count(active)} active per token "
              f"({_count(active_body)} without the input embedding); {m.num_experts} experts, top-{m.moe_router_topk}, "
              f"{m.num_experts // p.expert_parallel} per ep rank")  # fmt: skip
    else:
        print(f"model: {_count(total)} parameters{depths}")
    print(estimate(cfg, known.world_size).table())
    return 0
