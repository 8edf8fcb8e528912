"""The model of one training step's time for a config on a layout (``predict``).

Per micro batch, each block costs on one rank (tokens t = micro batch x the block's tokens / cp):

- GEMMs: ``6 P t / tp`` FLOPs (P its parameters a token passes: the family's sizes, routed experts
  by their top-k share) at the machine's rate for a GEMM of that block's shape (one rank's
  matrices, ``rank_parameters``); routed experts as one grouped GEMM per matrix over all local
  experts, at ``grouped_gemm_factor`` of a dense GEMM of its FLOPs (by rows per expert where the
  calibration measured ``grouped_gemm_curve``); FP8 block linears at ``fp8_gemm_speedup`` plus the casts;
- attention: the family's attention FLOPs (``pipeline_costs`` minus 6 P) at the attention rate of
  one rank's query length;
- elementwise work (norms, activations, RoPE): the bytes autograd keeps per token
  (``estimate.activation_bytes_per_token_layer``) times ``elementwise_passes`` over HBM;
- tensor parallelism (always with sp): four all-gathers and four reduce-scatters of the block's
  [t, h] activations, on the compute stream (unoverlapped, as measured in ``benchmarks/RESULTS.md``);
  expert parallelism: four all-to-alls of the routed rows; expert tensor parallelism: a gather and
  a reduce-scatter of them each way; context parallelism: the ring's keys and values (forward
  once, backward twice), hidden behind the block's attention where that is longer, and the
  ring's own fp32 merges, accumulations and key/value repeats over HBM at every step;
- recompute: ``full`` runs every block's forward again (a third of its compute, half its tp and ep
  traffic), ``selective`` the core attention's forward;
- the host: a block takes at least the host's time to launch its forward and backward
  (``host_ms_per_block`` of its kind, measured by ``--calibrate`` on one GPU at a tiny micro batch,
  under full recompute its own measured time, plus ``host_factors`` less one of it for each of the
  layout's collectives, and FSDP2's less one of the plain time (recompute does not gather
  again); cp's grows by its
  value at cp 2 for each ring step beyond the first: an exchange, a block kernel call and a merge
  forward, two exchanges backward, each step alike). Host and GPU overlap, but not perfectly where
  their times are close (the host falls behind some kernels, the GPU idles): the block takes
  (host^p + GPU^p)^(1/p) with p = ``host_overlap_power``, and the excess over
  the GPU's parts is ``host wait`` (MoE blocks on 4 GPUs at a micro batch of 4096 tokens spend
  about half the step there, ``benchmarks/RESULTS.md``); a chunk that waits for the host has its
  launches in that wait, so it pays only what of ``microbatch_overhead_ms`` the wait does not cover;
- the host's sync under ep or etp (``host sync``): their dispatch reads split sizes back once per MoE
  block, emptying the GPU's queue, so FSDP2's and etp's host work after it adds to the GPU's time
  (``synced_host_shares`` of the MoE block's host time), where elsewhere it hides under queued work;

the output layer and loss add their GEMM and logits traffic on the last stage. The pipeline sends
each chunk's activation and gradient once per micro batch. The chunks' times go through the
schedule simulator (``pipeline_schedules.modeled_bubble``) on the split the run will use, which
gives the bubble, imbalance included; past a few rounds of micro batches the steady state adds
the busiest rank's load per micro batch. Where chunks wait for the host and no dispatch sync holds
the host back (no ep, no etp), a rank idle for its peer keeps launching, so the bubble and the host
waits overlap (``_host_ahead``). After the last backward: the gradient reduce-scatter
(partly hidden behind the last micro batch's backward) and parameter all-gather of the
distributed optimizer, or FSDP2's per-micro-batch gathers (on their own stream: what
``fsdp_overlap`` does not hide behind the GPU's work hides in its host waits); the optimizer step's
HBM traffic; host overhead per step and per micro batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from meshtron.config import Config, ModelConfig, virtual_stages
from meshtron.estimate import activation_bytes_per_token_layer
from meshtron.layers.attention import head_dim, num_kv_heads
from meshtron.models import model_flops_per_token, num_blocks, padded_vocab_size, pipeline_costs, sample_tokens, spec_for
from meshtron.models.sizes import BLOCK, model_sizes
from meshtron.models.registry import BlockShape
from meshtron.parallel.pipeline_balance import PipelineCosts, pipeline_split
from meshtron.parallel.pipeline_schedules import chunk_place, modeled_bubble
from meshtron.parallel.setup import schedule_kind
from meshtron.parallel.sizes import RankParameters, rank_parameters
from meshtron.planning.hardware import Machine
from meshtron.planning.layouts import Layout, apply

BF16 = 2
PARTS = ("gemm", "attention", "elementwise", "recompute", "tp comm", "cp comm", "ep comm", "host sync", "host wait", "pp comm", "bubble",
         "dp comm", "optimizer", "overhead")  # fmt: skip
COMMUNICATION = ("tp comm", "cp comm", "ep comm", "pp comm", "dp comm")
HOST_WAITS = ("host wait", "host sync")  # the GPU idle for the host's launches
# Past this share of the step in HOST_WAITS a layout is host-bound: its speed follows the host's,
# and runs of one such layout measured up to 38 % apart on three hosts of one kind (benchmarks/RESULTS.md,
# ninth session).
HOST_BOUND_SHARE = 1 / 3


@dataclass
class Prediction:
    step_s: float
    tokens_per_s_gpu: float
    mfu: float
    bubble: float  # idle over busy time of the pipeline
    parts: dict[str, float] = field(default_factory=dict)  # seconds of one step on the average rank

    def share(self, names: tuple[str, ...]) -> float:
        return sum(self.parts.get(n, 0.0) for n in names) / self.step_s

    @property
    def host_bound(self) -> bool:
        """Whether the GPU waits for the host's launches a third of the step or more (``HOST_BOUND_SHARE``)."""
        return self.share(HOST_WAITS) >= HOST_BOUND_SHARE


@dataclass
class _Block:
    """One micro batch of one block on one rank, in seconds, by part."""

    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass(frozen=True)
class _Shape:
    """What the model needs of one block at one (tp, ep, etp): parameters a token passes (dense,
    routed experts), all routed-expert parameters, the dense matrices, this rank's shares, and the
    attention FLOPs per token (the family's count beyond 6 P)."""

    dense_active: int
    expert_active: int
    expert_all: int
    matrices: int
    local_dense: int
    local_expert: int
    attention_per_token: float


@dataclass
class _Model:
    blocks: list[_Shape]
    rank: RankParameters  # this rank's parameters (all stages)
    costs: PipelineCosts | None  # the family's pipeline cost model
    flops_per_token: float  # the trainer's count (MFU)


@functools.lru_cache(maxsize=4096)
def _clocked_bubble(kind: str, pp: int, micro: int, relative_chunks: tuple[float, ...]) -> float:
    """``modeled_bubble`` on chunk costs relative to their mean, to the percent: layouts that differ
    only in what scales every chunk alike (sharding, moments, often recompute) share one run of the clock."""
    return modeled_bubble(kind, pp, micro, list(relative_chunks))


def _rank_loads(kind: str, pp: int, chunks: list[float]) -> list[float]:
    """Each pipeline rank's cost per micro batch: the chunks it holds."""
    load = [0.0] * pp
    for c, cost in enumerate(chunks):
        load[chunk_place(kind, pp, c)[0]] += cost
    return load


def _overlapped(host: float, gpu: float, power: float) -> float:
    """A block's time when the host launches (``host``) while the GPU runs (``gpu``):
    (host^p + gpu^p)^(1/p), scaled by the larger so a large p cannot underflow."""
    if host <= 0:
        return gpu
    larger = max(host, gpu)
    return larger * ((host / larger) ** power + (gpu / larger) ** power) ** (1 / power)


def _spans(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart (ranks numbered node by node) crosses a node."""
    return size > 1 and stride * size > gpus_per_node


class StepModel:
    """``predict``: step times of ``cfg`` (its model, sequence and batch; the vocabulary set as the
    run's) on one machine kind with ``gpus_per_node`` GPUs per node, for any layout."""

    def __init__(self, cfg: Config, machine: Machine, gpus_per_node: int) -> None:
        self.cfg, self.machine, self.gpus_per_node = cfg, machine, gpus_per_node
        self._shapes: dict[tuple[int, int, int], _Model] = {}
        self._splits: dict[tuple[int, int, int, int], list[range]] = {}  # (tp, pp, vp, micro batches), 0s when ranking

    def vocab(self, tp: int) -> int:
        m = self.cfg.model
        return padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)

    def shapes(self, tp: int, ep: int, etp: int) -> _Model:
        """The model as one rank of (tp, ep, etp) sees it (cached: each builds the model on the meta device)."""
        key = (tp, ep, etp)
        if key not in self._shapes:
            m, seq, vocab = self.cfg.model, self.cfg.data.seq_length, self.vocab(tp)
            sizes, local = model_sizes(m, vocab, seq), rank_parameters(m, vocab, seq, tp, ep, etp)
            costs = pipeline_costs(m, vocab, seq)
            flat, total = 0.0, model_flops_per_token(m, vocab, seq, self.cfg.data.decoder_seq_length)
            if costs is None:  # no per-block count: the model's attention FLOPs spread evenly
                flat = max(0.0, total - 6 * sizes.total(active=True)) / num_blocks(m)
            out = []
            for i, mine in enumerate(local.blocks):
                params = [p for p in sizes.params if p.place == BLOCK and p.block == i]
                dense = sum(p.active for p in params if not p.expert)
                expert = sum(p.active for p in params if p.expert)
                attention = max(0.0, costs.blocks[i] - 6 * (dense + expert)) if costs is not None else flat
                out.append(_Shape(dense, expert, sum(p.numel for p in params if p.expert),
                                  max(1, sum(1 for p in params if not p.expert and len(p.shape) >= 2)), mine.dense, mine.expert,
                                  attention))  # fmt: skip
            self._shapes[key] = _Model(out, local, costs, total)
        return self._shapes[key]

    def predict(self, layout: Layout, exact_split: bool = False) -> Prediction:
        """The step of ``layout``; ``exact_split`` uses the pipeline split the run refines on the
        clock (slow at deep pipelines), else its min-max start."""
        lay = layout
        cfg = apply(self.cfg, lay)
        m, t = cfg.model, cfg.train
        vocab = self.vocab(lay.tp)
        micro = t.global_batch_size // (t.micro_batch_size * lay.dp)
        model = self.shapes(lay.tp, lay.ep, lay.etp)
        costs = model.costs
        alike: dict[tuple[BlockShape, _Shape], _Block] = {}  # a dense model's blocks are all one
        blocks = []
        for key in zip(spec_for(m).block_shapes(cfg), model.blocks):
            if key not in alike:
                alike[key] = self._block(cfg, lay, *key)
            blocks.append(alike[key])
        head = self._head(cfg, lay, vocab, costs)
        kind = schedule_kind(cfg.parallel, virtual_stages(cfg.parallel, num_blocks(m)))
        # ranking shares one split per (pp, vp): tp only pads the vocabulary, which barely moves it
        split_key = (lay.tp if exact_split else 0, lay.pp, lay.vp, micro if exact_split else 0)
        if split_key not in self._splits:
            self._splits[split_key] = pipeline_split(cfg.parallel, len(blocks), lay.vp, costs, kind, split_key[-1])
        ranges = self._splits[split_key]
        send, launch = self._p2p_seconds(cfg, lay), self.machine.microbatch_overhead_ms / 1e3
        # a chunk whose blocks wait for the host has its launches in that wait already, up to its length
        launches = [max(0.0, launch - sum(blocks[i].parts["host wait"] for i in r)) for r in ranges]
        chunks = [sum(blocks[i].total for i in r) + send + extra for r, extra in zip(ranges, launches)]
        chunks[-1] += head.total
        makespan, bubble = self._pipeline(kind, lay.pp, micro, chunks)
        waits = [sum(blocks[i].parts["host wait"] for i in r) for r in ranges]
        if lay.pp > 1 and any(waits) and lay.ep * lay.etp == 1:  # no dispatch sync holds the host back
            makespan = min(makespan, self._host_ahead(kind, lay.pp, micro, chunks, waits))
            bubble = makespan / (micro * sum(chunks) / lay.pp) - 1
        parts = {name: 0.0 for name in PARTS}
        for piece in [*blocks, head]:
            for name, value in piece.parts.items():
                parts[name] += micro * value / lay.pp
        parts["pp comm"] += micro * send * len(ranges) / lay.pp
        parts["overhead"] = micro * sum(launches) / lay.pp + self.machine.step_overhead_ms / 1e3
        parts["bubble"] = makespan - micro * sum(chunks) / lay.pp
        backward_window = 2 / 3 * max(chunks) * lay.vp
        parts["dp comm"] = self._data_parallel_seconds(cfg, lay, micro, backward_window, makespan, parts["host wait"])
        parts["optimizer"] = self._optimizer_seconds(lay)
        step = makespan + parts["dp comm"] + parts["optimizer"] + self.machine.step_overhead_ms / 1e3
        tokens = t.global_batch_size * sample_tokens(cfg) / lay.world / step
        return Prediction(step, tokens, tokens * model.flops_per_token / (self.machine.peak_tflops * 1e12), bubble, parts)

    # ------------------------------------------------------------------ per micro batch

    def _block(self, cfg: Config, lay: Layout, shape: BlockShape, s: _Shape) -> _Block:
        m, mc = cfg.model, self.machine
        tokens = cfg.train.micro_batch_size * shape.tokens / lay.cp
        gemm = 6 * s.dense_active * tokens / lay.tp / mc.gemm_rate(2 * tokens * s.local_dense / s.matrices)
        if lay.fp8:
            gemm *= 1 / mc.fp8_gemm_speedup + mc.fp8_cast_fraction
        ep_comm = 0.0
        if s.expert_all:  # routed experts (bf16 under --fp8-format): grouped GEMMs, rows exchanged over ep and etp
            rows = tokens / lay.tp * lay.etp * lay.ep * s.expert_active / s.expert_all  # per local expert
            rate = mc.gemm_rate(2 * rows * s.local_expert / 2) * mc.grouped_factor(rows)  # one grouped GEMM: all local experts
            gemm += 6 * s.expert_active * tokens / lay.tp / rate
            routed = tokens / lay.tp * m.moe_router_topk * m.hidden_size * BF16
            ep_comm = 4 * mc.collective_seconds("all_to_all", routed, lay.ep, _spans(lay.etp, lay.ep, self.gpus_per_node))
            ep_comm += 4 * mc.collective_seconds("all_gather", routed * lay.etp, lay.etp, _spans(1, lay.etp, self.gpus_per_node))
        attention = s.attention_per_token * tokens / lay.tp / mc.attention_rate(shape.tokens / lay.cp)
        kept = activation_bytes_per_token_layer(cfg, granularity="", is_moe=shape.moe)
        elementwise = kept * tokens * mc.elementwise_passes / (mc.hbm_gbps * 1e9)
        activation = tokens * m.hidden_size * BF16
        tp_comm = 4 * (mc.collective_seconds("all_gather", activation, lay.tp, _spans(1, lay.tp, self.gpus_per_node))
                       + mc.collective_seconds("reduce_scatter", activation, lay.tp, _spans(1, lay.tp, self.gpus_per_node)))  # fmt: skip
        cp_comm = 0.0
        if lay.cp > 1:
            elementwise += self._ring_elementwise_seconds(m, lay, tokens)
            width = m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim) if m.multi_latent_attention \
                else 2 * num_kv_heads(m) * head_dim(m)  # fmt: skip
            ring = 3 * (lay.cp - 1) * mc.collective_seconds("p2p", tokens * width / lay.tp * BF16, 2,
                                                             _spans(lay.tp, lay.cp, self.gpus_per_node))  # fmt: skip
            cp_comm = max(0.0, ring - attention)
        recompute = 0.0
        if lay.recompute == "full":
            recompute = (gemm + attention + elementwise) / 3 + (tp_comm + ep_comm) / 2
        elif lay.recompute == "selective":
            recompute = attention / 3
        parts = {"gemm": gemm, "attention": attention, "elementwise": elementwise, "recompute": recompute, "tp comm": tp_comm,
                 "cp comm": cp_comm, "ep comm": ep_comm}  # fmt: skip
        parts["host sync"] = self._synced_host_seconds(lay) if s.expert_all else 0.0
        host, gpu = self._host_seconds(lay, "moe" if s.expert_all else "dense"), sum(parts.values())
        parts["host wait"] = _overlapped(host, gpu, self.machine.host_overlap_power) - gpu
        return _Block(parts)

    def _ring_elementwise_seconds(self, m: ModelConfig, lay: Layout, tokens: float) -> float:
        """HBM traffic of ring attention's own tensor work in one block (``context_parallel``, the
        fused path with CUDA's cuDNN kernel), beside the block kernels the attention rate prices.
        Per element of the rows (queries) or columns (keys and values) a ring step touches, in
        bytes: forward, the block's output cast to fp32 (6) and, from the second step, merged into
        the running output (28 more); backward, the output and its gradient made contiguous (8
        per value element) and the block's dq added into the fp32 sum (10 per query element); for
        each step's key and value columns, cuDNN's repeat to the query heads, forward and
        backward, and its per-head gradients read back (6), and the travelling fp32 key/value
        gradient summed (10); once, the fp32 dq zeroed (4), and it and the output cast back and
        made contiguous (10). The first step covers every row and column, each later one three
        quarters of them on average (half the ranks take half the rows, the other half half the
        columns)."""
        heads = m.num_attention_heads / lay.tp
        if m.multi_latent_attention:  # keys and values per query head
            kv_heads, dk, dv = heads, m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
        else:
            kv_heads, dk, dv = num_kv_heads(m) / lay.tp, head_dim(m), head_dim(m)
        later = 0.75 * (lay.cp - 1)  # the later steps' share of a whole step's rows or columns
        rows = heads * (dv * (6 + 34 * later) + (8 * dv + 10 * dk) * (1 + later) + 4 * dk + 10 * (dk + dv))
        columns = (heads * 6 + kv_heads * 10) * (dk + dv) * (1 + later)
        return tokens * (rows + columns) / (self.machine.hbm_gbps * 1e9)

    def _synced_host_seconds(self, lay: Layout) -> float:
        """The host work the GPU waits for in a MoE block under ep or etp. Their dropless dispatch
        reads the all-to-all's split sizes back to the host once per forward, so the GPU's queue is
        empty after it; host work that follows and launches no kernel (FSDP2's hooks, etp's extra
        exchanges) is then idle time on the GPU, not hidden under queued work. Each feature adds its
        ``synced_host_shares`` of the machine's MoE block host time."""
        if lay.ep == 1 and lay.etp == 1:
            return 0.0
        mc = self.machine
        share = mc.synced_host_shares.get("fsdp", 0.0) * (lay.sharding == "fsdp") + mc.synced_host_shares.get("etp", 0.0) * (lay.etp > 1)
        return mc.host_ms_per_block.get("moe", 0.0) / 1e3 * share

    def _host_seconds(self, lay: Layout, kind: str) -> float:
        """The host's time to launch one block's forward + backward: the machine's for the block's
        kind (under full recompute its measured time, ``Machine.host_ms``), plus what each layout
        feature adds (collectives and their bookkeeping, FSDP2's hooks): its factor less one,
        times that time. The features' Python calls are separate, so their costs add rather than
        compound (a product overstated layouts with three of them by ~40 %, RESULTS.md, twelfth
        session); a recomputed forward reruns the collectives' forward calls too, but not FSDP2's
        gathers (its backward has unsharded the block already; the hooks that do rerun only find
        that out): FSDP2 adds the same milliseconds with or without recompute (4.7 ms a DeepSeek
        MoE block both ways on 2 x H200, thirteenth session). Context parallelism's host work is per
        ring step (its exchanges, block kernel calls and merges, the same at each step), so its
        factor grows by the one at cp 2 for each step beyond the first."""
        mc = self.machine
        features = {"tp": lay.tp > 1, "ep": lay.ep > 1 and kind == "moe", "etp": lay.etp > 1 and kind == "moe"}
        added = (mc.host_factors.get("cp", 1.0) - 1) * (lay.cp - 1)
        added += sum(mc.host_factors.get(feature, 1.0) - 1 for feature, on in features.items() if on)
        fsdp = (mc.host_factors.get("fsdp", 1.0) - 1) * mc.host_ms(kind, False) if lay.sharding == "fsdp" else 0.0
        return (mc.host_ms(kind, lay.recompute == "full") * (1 + added) + fsdp) / 1e3

    def _head(self, cfg: Config, lay: Layout, vocab: int, costs: PipelineCosts | None) -> _Block:
        """The output layer and its loss: one GEMM over the rank's vocabulary shard, the logits' traffic."""
        m, mc = cfg.model, self.machine
        seq = spec_for(m).output_tokens(cfg.data)
        tokens = cfg.train.micro_batch_size * seq / lay.cp
        if not tokens:
            return _Block({})
        flops = (costs.head if costs is not None else 6 * vocab * m.hidden_size) * tokens / lay.tp
        gemm = flops / mc.gemm_rate(2 * tokens * vocab / lay.tp * m.hidden_size)
        logits = tokens * vocab / lay.tp * (BF16 + BF16 + 4) / (mc.hbm_gbps * 1e9)
        activation = tokens * m.hidden_size * BF16
        tp_comm = mc.collective_seconds("all_gather", activation, lay.tp, _spans(1, lay.tp, self.gpus_per_node))
        tp_comm += mc.collective_seconds("reduce_scatter", activation, lay.tp, _spans(1, lay.tp, self.gpus_per_node))
        return _Block({"gemm": gemm, "elementwise": logits, "tp comm": tp_comm})

    def _p2p_seconds(self, cfg: Config, lay: Layout) -> float:
        """A chunk's activation out and its gradient back, once per micro batch."""
        if lay.pp == 1:
            return 0.0
        tokens = cfg.train.micro_batch_size * cfg.data.seq_length / lay.cp / lay.tp
        stride = lay.tp * lay.cp * lay.dp
        return 2 * self.machine.collective_seconds("p2p", tokens * cfg.model.hidden_size * BF16, 2, _spans(stride, lay.pp, self.gpus_per_node))

    # ------------------------------------------------------------------ per step

    def _pipeline(self, kind: str, pp: int, micro: int, chunks: list[float]) -> tuple[float, float]:
        """(makespan, bubble) of ``micro`` micro batches: the schedule's clock for up to 2 pp of them
        (as the split's refinement runs it), then the busiest rank's load per further micro batch."""
        if pp == 1:
            return micro * chunks[0], 0.0
        clocked = min(micro, 2 * pp)
        mean = sum(chunks) / len(chunks)
        bubble = _clocked_bubble(kind, pp, clocked, tuple(round(c / mean, 2) for c in chunks))
        makespan = (1 + bubble) * clocked * sum(chunks) / pp + (micro - clocked) * max(_rank_loads(kind, pp, chunks))
        return makespan, makespan / (micro * sum(chunks) / pp) - 1

    def _host_ahead(self, kind: str, pp: int, micro: int, chunks: list[float], waits: list[float]) -> float:
        """The makespan of a pipeline whose chunks wait for the host (``waits``: each chunk's host
        wait) where nothing makes the host wait for the GPU. A rank idle for its peer's activation
        (the bubble) does not stop its host: the receive is a stream wait (``pipeline.py``), so
        the host launches the next units behind it, and once the data is there the GPU runs them
        at its own speed. The host's launches and the bubble overlap: the step is the larger of
        the schedule's clock on the GPU's parts alone (its bubble included) and the busiest rank's
        load with its host waits (no bubble)."""
        gpu, _ = self._pipeline(kind, pp, micro, [c - w for c, w in zip(chunks, waits)])
        return max(gpu, micro * max(_rank_loads(kind, pp, chunks)))

    def _stage_parameters(self, lay: Layout) -> tuple[float, float]:
        """(dense, routed-expert) parameters of the rank with the most: the blocks' share over pp,
        plus the embedding's or the output layer's."""
        parts = self.shapes(lay.tp, lay.ep, lay.etp).rank
        ends = parts.head + parts.tail if lay.pp == 1 else max(parts.head, parts.tail)
        return sum(b.dense for b in parts.blocks) / lay.pp + ends, sum(b.expert for b in parts.blocks) / lay.pp

    def _data_parallel_seconds(self, cfg: Config, lay: Layout, micro: int, window: float, compute: float, idle: float) -> float:
        """Exposed gradient and parameter traffic over dp x cp (experts: the expert-data-parallel group).
        FSDP2's per-micro-batch gathers and reduce-scatters run on their own stream while the
        blocks run: ``fsdp_overlap`` of them hides behind the GPU's work, and the rest in the
        GPU's ``idle`` time (its host waits), where no kernel of the block competes with them."""
        mc, p = self.machine, cfg.parallel
        dense, expert = self._stage_parameters(lay)
        groups = [(dense, lay.dp * lay.cp, _spans(lay.tp, lay.dp * lay.cp, self.gpus_per_node))]
        edp = lay.tp * lay.cp * lay.dp // (lay.ep * lay.etp)
        if expert:
            groups.append((expert, edp, _spans(lay.ep * lay.etp, edp, self.gpus_per_node)))
        grad_bytes = 2 if p.grad_reduce_in_bf16 else 4
        bucket = p.ddp_bucket_size
        total = 0.0
        for params, group, spans in groups:
            if group <= 1:
                continue
            scatter = params * grad_bytes / mc.bus_bandwidth("reduce_scatter", min(params, bucket) * grad_bytes, spans) * (group - 1) / group
            gather = params * BF16 / mc.bus_bandwidth("all_gather", min(params, bucket) * BF16, spans) * (group - 1) / group
            if lay.sharding == "fsdp":  # per micro batch: gathered for forward and backward, fp32 gradients scattered
                traffic = micro * (2 * gather + scatter * 4 / grad_bytes)
                total += max(traffic * (1 - mc.fsdp_overlap) - idle, traffic - compute, 0.0)
            else:
                total += gather + scatter - min(mc.dp_overlap * scatter, window)
        return total

    def _optimizer_seconds(self, lay: Layout) -> float:
        """HBM traffic of the fused AdamW over this rank's shard: read gradient, master and moments,
        write master, moments and the bf16 parameter; zeroing and the norm read the whole buffer.
        Under ``--decoupled-lr`` the reference step runs instead: the clip's pass over the gradient
        (read and write) and the master's copy into the bf16 parameter come on top."""
        dense, expert = self._stage_parameters(lay)
        edp = lay.tp * lay.cp * lay.dp // (lay.ep * lay.etp)
        shard = dense / (lay.dp * lay.cp) + expert / edp if lay.sharding != "none" else dense + expert
        moments = 2 * (2 if lay.bf16_moments else 4)
        per_param = 4 + 4 + moments + 4 + moments + BF16
        if self.cfg.train.decoupled_lr:
            per_param += 4 + 4 + 4 + BF16
        buffer = shard if lay.sharding == "fsdp" else dense + expert
        return (shard * per_param + buffer * 8) / (self.machine.hbm_gbps * 1e9)

