"""``meshtron estimate``: GPU memory of one rank for a config and layout, before renting GPUs.

    meshtron estimate --config run.toml [--world-size N] [--print-mesh] [--flag value ...]

Three parts, for the pipeline stage that holds the most (the first: the embedding and the most
micro batches in flight):

- parameters: this rank's share (linears and vocabulary split by tp; norms whole), in the
  compute dtype;
- gradients and optimizer state: the fp32 gradient buffer (4 bytes/param, never sharded by the
  distributed optimizer, which reduce-scatters out of it), fp32 masters (4, none in fp32 mode, where
  the master is the param) and Adam's two moments (8), the last two split over dp x cp by the
  distributed optimizer; FSDP2 shards all three and keeps fp32 params;
- activations: what autograd keeps per token per layer in the fused GPU path (see
  ``activation_bytes_per_token_layer``), times tokens, layers and micro batches in flight, plus the
  output layer's loss workspace.

Transient buffers of the allocator (fragmentation, cuBLAS workspaces) are not modeled, nor the
inference path.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from meshtron.config import Config, build_config, data_parallel_size, num_blocks, pipeline_virtual_size
from meshtron.data.default_data import EMBEDDED_VOCAB_SIZE
from meshtron.training.vocab import model_vocab_size, run_tokenizer
from meshtron.validation import validate
from meshtron.kernels.cross_entropy import CHUNK_ELEMENTS
from meshtron.kernels.cross_entropy_sum import LOGITS_BUDGET_BYTES
from meshtron.layers.attention import head_dim, num_kv_heads
from meshtron.layers.mlp import ffn_hidden_size
from meshtron.models import padded_vocab_size
from meshtron.models.decoder import parameter_count
from meshtron.parallel.mesh import GROUP_DIMS, Mesh
from meshtron.parallel.pipeline_balance import modeled_costs, pipeline_split

GIB = 2**30
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "auto": 2}  # auto: bf16, the GPU default


@dataclass
class MemoryEstimate:
    params: int  # this rank's parameters
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    loss_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes + self.loss_bytes

    def table(self) -> str:
        rows = [("parameters", self.param_bytes), ("gradients (fp32 buffer)", self.grad_bytes),
                ("optimizer (masters + Adam)", self.optimizer_bytes), ("activations", self.activation_bytes),
                ("loss workspace", self.loss_bytes), ("total", self.total_bytes)]  # fmt: skip
        lines = [f"parameters on this rank: {self.params / 1e6:,.1f} M"]
        lines += [f"  {name:<28} {value / GIB:8.2f} GiB" for name, value in rows]
        return "\n".join(lines)


def _vocab(cfg: Config) -> int:
    m = cfg.model
    return padded_vocab_size(m.vocab_size or 32000, m.make_vocab_size_divisible_by, cfg.parallel.tensor_parallel)


def stage_parameters(cfg: Config, world_size: int = 1) -> int:
    """Parameters of one rank on the first pipeline stage (the largest with tied embeddings)."""
    m, p, tp = cfg.model, cfg.parallel, cfg.parallel.tensor_parallel
    vocab, h = _vocab(cfg), m.hidden_size
    norm = h * (2 if m.normalization == "LayerNorm" else 1)
    total = parameter_count(m, vocab, cfg.data.seq_length)
    table = vocab * h * (1 if m.tie_embeddings else 2)
    positions = 0 if m.position_embedding_type == "rope" else (m.max_position_embeddings or cfg.data.seq_length) * h
    layer = (total - table - positions - norm) // m.num_layers
    kv_extra = 2 * head_dim(m) * h * max(0, tp // num_kv_heads(m) - 1) // tp  # kv heads copied when fewer than tp
    layer_shard = (layer - 2 * norm) // tp + 2 * norm + kv_extra
    layers = first_rank_layers(cfg, world_size)
    out = 0 if p.pipeline_parallel > 1 or m.tie_embeddings else vocab * h // tp
    last_norm = norm if p.pipeline_parallel == 1 else 0
    return vocab * h // tp + positions + layers * layer_shard + out + last_norm


def first_rank_layers(cfg: Config, world_size: int = 1) -> int:
    """Layers on pipeline rank 0 under the split training uses (``pipeline_split``, refined for
    the micro batches a data-parallel rank runs out of ``world_size``)."""
    from meshtron.parallel.setup import schedule_kind

    p, t = cfg.parallel, cfg.train
    if p.pipeline_parallel == 1:
        return cfg.model.num_layers
    virtual = pipeline_virtual_size(cfg)
    micro = t.global_batch_size // max(1, t.micro_batch_size * data_parallel_size(cfg, world_size))
    costs = modeled_costs(cfg.model, _vocab(cfg), cfg.data.seq_length)
    split = pipeline_split(p, num_blocks(cfg.model), virtual, costs, schedule_kind(p, virtual), micro)
    return sum(len(r) for r in split[:: p.pipeline_parallel])


def activation_bytes_per_token_layer(cfg: Config, granularity: str | None = None) -> float:
    """Bytes autograd keeps per token of one block (a = bytes of the compute dtype):

    input x and its norm's output (a h each; the norm keeps x, the QKV linear its input), the QKV
    output (a (h + 2 kv); alive because v is a view of it), RoPE'd q and k (a (h + kv)), attention
    output and its log-sum-exp (a h + 4 heads), the projection's input (a h, a contiguous copy),
    then the same two for the MLP's norm (2 a h), fc1's output (2 a ffn, kept by SwiGLU) and
    SwiGLU's output (a ffn, kept by fc2). Tensor-parallel parts divide by tp; x and the norm
    outputs do not (with sequence parallelism x does; a linear still keeps its gathered input).
    FP8 linears keep 1-byte copies of their inputs. ``selective`` recompute drops the attention
    output and log-sum-exp.
    """
    m, p, t = cfg.model, cfg.parallel, cfg.train
    a = _DTYPE_BYTES[t.precision]
    tp, sp = p.tensor_parallel, p.sequence_parallel and p.tensor_parallel > 1
    h, kv, ffn = m.hidden_size, num_kv_heads(m) * head_dim(m), ffn_hidden_size(m)
    q = m.num_attention_heads * head_dim(m)
    linear_in = 1 if m.fp8_format else a  # what a linear keeps of its input
    swiglu = m.activation == "swiglu"
    residual = 2 * a * h / (tp if sp else 1)  # x before each norm
    norm_outputs = 2 * linear_in * h  # kept (gathered, under sp) by the QKV and fc1 linears
    attention = a * (q + 2 * kv) + a * (q + kv) + linear_in * q
    if (granularity if granularity is not None else m.recompute_granularity) != "selective":
        attention += a * q + 4 * m.num_attention_heads
    mlp = (2 if swiglu else 1) * a * ffn + linear_in * ffn
    return residual + norm_outputs + (attention + mlp) / tp


def activation_bytes(cfg: Config, world_size: int = 1) -> int:
    """Activations of the first pipeline stage: its layers x micro batches in flight (1F1B keeps
    up to pp of them on the first stage), or under full recompute the checkpointed inputs plus one
    recomputed group."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch_size * cfg.data.seq_length / p.context_parallel
    layers = first_rank_layers(cfg, world_size)
    micro = t.global_batch_size // (t.micro_batch_size * max(1, data_parallel_size(cfg, world_size)))
    in_flight = min(p.pipeline_parallel, micro) if p.pipeline_parallel > 1 else 1
    per_layer = activation_bytes_per_token_layer(cfg)
    if m.recompute_granularity == "full":
        a, sp = _DTYPE_BYTES[t.precision], p.sequence_parallel and p.tensor_parallel > 1
        n = min(m.recompute_num_layers, layers)
        kept = m.hidden_size * a / (p.tensor_parallel if sp else 1)
        checkpoints = -(-layers // n) if m.recompute_method == "uniform" else n
        plain = 0 if m.recompute_method == "uniform" else layers - n
        stage = tokens * (checkpoints * kept + plain * per_layer) * in_flight + tokens * n * per_layer
    else:
        stage = tokens * layers * per_layer * in_flight
    return int(stage)


def loss_bytes(cfg: Config) -> int:
    """The output layer's workspace (one rank): the final norm's input and output, a chunk of
    logits (``CHUNK_ELEMENTS``; the whole fp32 logits and their gradient when fused kernels are
    off; under ``--cross-entropy-loss-fusion``, the logits of a token block up to
    ``LOGITS_BUDGET_BYTES`` and the weight gradient kept until backward), and the fp32 sum of the
    hidden-state gradient. Counted where pp is 1 (with pp > 1 the last stage holds it and fewer
    micro batches)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.pipeline_parallel > 1:
        return 0
    a = _DTYPE_BYTES[t.precision]
    tokens = t.micro_batch_size * cfg.data.seq_length // p.context_parallel
    vocab = _vocab(cfg) // p.tensor_parallel
    if m.fused_kernels == "off":
        logits = tokens * vocab * 4 * 2
    elif m.cross_entropy_loss_fusion:
        logits = min(LOGITS_BUDGET_BYTES, tokens * vocab * a) + vocab * m.hidden_size * a
    else:
        logits = min(CHUNK_ELEMENTS, tokens * vocab) * a
    return int(tokens * m.hidden_size * (2 * a + 4) + logits)


def estimate(cfg: Config, world_size: int = 1) -> MemoryEstimate:
    """The memory of one rank of a ``world_size``-process run of ``cfg``."""
    p, t = cfg.parallel, cfg.train
    shards = max(1, data_parallel_size(cfg, world_size) * p.context_parallel)
    params = stage_parameters(cfg, world_size)
    mixed = t.precision != "fp32"
    if p.fsdp:  # fp32 sharded params (the masters), gradients and moments
        param_bytes, grad_bytes, opt_bytes = 4 * params // shards, 4 * params // shards, 8 * params // shards
    else:
        opt = (4 if mixed else 0) + 8
        param_bytes, grad_bytes = _DTYPE_BYTES[t.precision] * params, 4 * params
        opt_bytes = opt * params // (shards if p.use_distributed_optimizer else 1)
    return MemoryEstimate(params, param_bytes, grad_bytes, opt_bytes, activation_bytes(cfg, world_size), loss_bytes(cfg))


def training_vocab_size(cfg: Config) -> int:
    """The padded vocabulary the run would train with: its tokenizer's when it names one (or the
    embedded corpus's when it names no data), else ``--vocab-size`` (32000 by default)."""
    if not (cfg.data.mock or cfg.data.data_path):
        return max(cfg.model.vocab_size, EMBEDDED_VOCAB_SIZE)
    return model_vocab_size(cfg, run_tokenizer(cfg))


def mesh_table(cfg: Config, world_size: int) -> str:
    """Every rank's coordinates, then the groups (``Mesh.describe``)."""
    mesh = Mesh.from_config(cfg.parallel, world_size=world_size, rank=0, local_rank=0)
    lines = [mesh.describe(), "  rank  " + " ".join(f"{d:>5}" for d in GROUP_DIMS)]
    for r in range(world_size):
        c = mesh.coords(r)
        lines.append(f"  {r:>4}  " + " ".join(f"{c[d]:>5}" for d in GROUP_DIMS))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshtron estimate", description="predict per-GPU memory of a run")
    parser.add_argument("--config", default=None)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--print-mesh", action="store_true", help="also print every rank's place in the layout")
    known, overrides = parser.parse_known_args(argv)
    cfg = build_config(known.config, overrides)
    validate(cfg, world_size=known.world_size)
    cfg.model.vocab_size = training_vocab_size(cfg)
    if known.print_mesh:
        print(mesh_table(cfg, known.world_size))
    p = cfg.parallel
    print(f"layout: world {known.world_size}, tp {p.tensor_parallel}, pp {p.pipeline_parallel}, cp {p.context_parallel}, "
          f"dp {data_parallel_size(cfg, known.world_size)}, sp {p.sequence_parallel}, distributed optimizer "
          f"{p.use_distributed_optimizer}, fsdp {p.fsdp}, recompute '{cfg.model.recompute_granularity or 'none'}'")  # fmt: skip
    print(f"vocabulary: {cfg.model.vocab_size} rows (padded)")
    print(estimate(cfg, known.world_size).table())
    return 0
