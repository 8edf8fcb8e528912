"""``meshtron plan --calibrate``: this machine's rates, measured in well under a minute, into the
JSON file ``--calibration`` reads.

Measured: bf16 GEMMs of the model's own block shapes at tp 1, 2, 4 and 8 (and a few square ones
to span the curve), attention forward + backward at the model's heads over query lengths up to its
sequence, the routed experts' grouped GEMMs against the GEMM curve by rows per expert (MoE models), HBM bandwidth
(a 1 GiB copy), the host's time to launch a block of each kind (a tiny micro batch, plain and under full recompute),
and, with two or more GPUs, all-gather, reduce-scatter,
all-reduce, all-to-all and send/recv over all of them by size (one process per GPU, NCCL). What one
GPU cannot measure (collectives on one GPU, the network, FP8, overlaps, the host factors of layouts) keeps the
shipped machine's value, and ``sources`` says which numbers were measured and which were kept.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from meshtron.config import Config
from meshtron.layers.attention import head_dim
from meshtron.planning.hardware import (
    COLLECTIVES,
    Machine,
    interpolate,
    load,
    shipped_for,
)
from meshtron.planning.layouts import Layout, apply
from meshtron.planning.step_time import StepModel
from meshtron.training.peak_flops import datasheet_peak_tflops

COLLECTIVE_BYTES = (2**20, 2**24, 2**26, 2**28, 2**30)
ONE_PROCESS = Layout(1, 1, 1, 1, 1, 1, 1, "none", 1)
HOST_TOKENS = 128  # a micro batch this small leaves a step as long as its launches (host_ms_per_block)
SLOPE_BLOCKS = 4  # blocks of a kind added to the one-block model to time the kind's host work (host_ms_per_block)


def cuda_seconds(fn, repeat: int = 10) -> float:
    """Mean seconds of ``repeat`` runs of ``fn`` after three warm-up runs, by CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def gemm_points(cfg: Config, machine: Machine) -> list[list[float]]:
    """[FLOPs, TFLOP/s] of forward GEMMs: each tp's block matrix (the step model's representative
    shape) at one sequence of tokens, and square GEMMs from 1024 to 8192."""
    model, h = StepModel(cfg, machine, 8), cfg.model.hidden_size
    shapes = {(n, n, n) for n in (1024, 2048, 4096, 8192)}
    for tp in (1, 2, 4, 8):
        try:
            block = model.shapes(tp, 1, 1).blocks[0]
        except ValueError:  # a tp the model's shapes do not split over
            continue
        for tokens in (cfg.data.seq_length // 2, cfg.data.seq_length, 2 * cfg.data.seq_length):
            shapes.add((tokens, max(1, block.local_dense // block.matrices // h), h))
    points = []
    for m, n, k in sorted(shapes):
        a, b = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        seconds = cuda_seconds(lambda: a @ b)
        points.append([2.0 * m * n * k, 2.0 * m * n * k / seconds / 1e12])
    return monotone(sorted(points))


def attention_points(cfg: Config) -> list[list[float]]:
    """[query tokens, TFLOP/s by 6 S h per token] of causal SDPA forward + backward at the model's
    heads, one sequence of about the model's tokens per length."""
    m = cfg.model
    heads, dim = m.num_attention_heads, head_dim(m) if not m.multi_latent_attention else m.qk_head_dim + m.qk_pos_emb_head_dim
    points = []
    for seq in sorted({s for s in (1024, 2048, 4096, 8192, 16384, cfg.data.seq_length) if s <= max(1024, cfg.data.seq_length)}):
        batch = max(1, cfg.data.seq_length // seq)
        q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16)

        def step() -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        seconds = cuda_seconds(step, repeat=5)
        points.append([float(seq), 6.0 * seq * m.hidden_size * batch * seq / seconds / 1e12])
    return points


GROUPED_SEQUENCES = (1, 2, 4, 8)  # micro batches whose rows per expert grouped_gemm_curve measures


def rows_per_expert(cfg: Config, sequences: int) -> int:
    """The rows ``sequences`` sequences send each routed expert under even routing (at least 16)."""
    m = cfg.model
    return max(16, sequences * cfg.data.seq_length * m.moe_router_topk // m.num_experts)


def grouped_gemm_factor(cfg: Config, gemm_tflops: list[list[float]], sequences: int = 1) -> float:
    """Routed experts' fc1 and fc2, forward and backward, through the layer's own grouped GEMM
    (``--model.moe_grouped_gemm``) at the rows ``sequences`` sequences send each expert under even
    routing: their speed as a share of ``gemm_tflops``' rate at one grouped GEMM's FLOPs (the step
    model's ``grouped_gemm_factor``: a grouped GEMM against one dense GEMM of the same FLOPs)."""
    from meshtron.layers.moe.grouped_gemm import grouped_mm

    m = cfg.model
    h, f = m.hidden_size, m.moe_ffn_hidden_size or m.ffn_hidden_size
    experts, rows = m.num_experts, rows_per_expert(cfg, sequences)
    fc1 = 2 * f if m.activation == "swiglu" else f
    seconds = 0.0
    for n, k in ((fc1, h), (h, f)):
        x = torch.randn(experts * rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        sizes = torch.full((experts,), rows, device="cuda", dtype=torch.int64)
        grad = torch.randn(experts * rows, n, device="cuda", dtype=torch.bfloat16)
        # autograd.grad, not .backward: accumulating into w.grad would add a pass over all the
        # experts' weights to every call (a third of the time at DeepSeek-V2-Lite's shapes)
        seconds += cuda_seconds(lambda: torch.autograd.grad(grouped_mm(x, w, sizes, m.moe_grouped_gemm), (x, w), grad), repeat=5)
    flops = 2.0 * experts * rows * (fc1 * h + h * f)  # one forward of both
    return 3 * flops / seconds / 1e12 / interpolate(gemm_tflops, flops / 2)


def cut_model(cfg: Config, pattern: list[int], tokens: int, layout: Layout = ONE_PROCESS) -> Config:
    """``cfg`` cut to the blocks of ``pattern`` (1: a MoE block, where the model has experts) on
    ``layout`` (one process, no recompute, unless given), one micro batch of ``tokens`` random
    tokens a step on each data-parallel rank, nothing logged: the run whose steps time the host
    (``host_ms_per_block``, ``benchmarks/host_profile.py``, ``benchmarks/host_factors.py``).
    ``cfg`` keeps its values (``apply`` copies each section)."""
    c = apply(cfg, layout)
    c.model.num_layers, c.train.global_batch_size, c.train.train_iters = len(pattern), layout.dp * layout.micro_batch, 1000
    if c.model.num_experts:
        c.model.moe_layer_freq = "[" + ",".join(map(str, pattern)) + "]"
    c.data.mock, c.data.seq_length, c.data.decoder_seq_length = True, tokens, min(c.data.decoder_seq_length, tokens)
    c.logging.log_interval, c.logging.eval_interval = 10**9, 0
    return c


def host_ms_per_block(cfg: Config, recompute: str = "") -> dict[str, float]:
    """Milliseconds the host takes to launch one block's forward + backward, per block kind
    ("dense", "moe"), under ``recompute`` (a layout's: "" or "full"): on one GPU at one micro batch
    of ``HOST_TOKENS`` tokens, where the GPU's kernels take microseconds and a forward + backward
    lasts as long as its launches, the median forward + backward (``Trainer.accumulate_gradients``:
    no optimizer step, whose HBM traffic is the GPU's and comes once a step, not once a micro
    batch) of the model cut to one block plus ``SLOPE_BLOCKS`` of the kind, less that of the model
    cut to that one block, over ``SLOPE_BLOCKS``: the two medians' noise is spread over that many
    blocks (with one block added, two measurements on one 4 x H200 host gave a dense block 5.5 and
    3.0 ms). Where the added blocks do not fit the GPU with their optimizer state
    (DeepSeek-V2-Lite's four MoE blocks take ~50 GB), one block is added instead; where that does
    not fit either, ``torch.OutOfMemoryError`` says so."""
    from meshtron.models import spec_for
    from meshtron.training.trainer import Trainer

    kinds = [1 if shape.moe else 0 for shape in spec_for(cfg.model).block_shapes(cfg)]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None  # the CPU: tests of the code path

    def step_ms(pattern: list[int]) -> float:
        layout = dataclasses.replace(ONE_PROCESS, recompute=recompute)
        trainer, times = Trainer(cut_model(cfg, pattern, HOST_TOKENS, layout), log=lambda _: None), []
        for i in range(13):
            sync()
            began = time.perf_counter()
            trainer.accumulate_gradients()
            sync()
            times.append(time.perf_counter() - began) if i >= 3 else None
        del trainer
        _release_memory()
        return 1e3 * statistics.median(times)

    first = [max(kinds)]  # a MoE model cut to one dense block is refused (no MoE layer): it keeps a MoE one
    base = step_ms(first)

    def per_block(kind: int) -> float:
        for added in (SLOPE_BLOCKS, 1):
            try:
                return max(0.0, step_ms(first + [kind] * added) - base) / added
            except torch.OutOfMemoryError:
                pass
            _release_memory()  # after the except block, whose traceback held the half-built model
        raise torch.OutOfMemoryError(f"meshtron plan --calibrate: the model cut to {len(first) + 1} blocks does not fit this GPU "
                                     "with its optimizer state, so the host's time per block is not measured")  # fmt: skip

    return {("moe" if kind else "dense"): per_block(kind) for kind in sorted(set(kinds))}


def _release_memory() -> None:
    """Free a dropped trainer's GPU memory now (its modules and hooks hold reference cycles)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def monotone(points: list[list[float]]) -> list[list[float]]:
    """``points`` ([FLOPs, TFLOP/s]) made non-decreasing by pooling adjacent violators: shapes of
    equal FLOPs differ (a narrow projection runs slower than a square GEMM), and the step model
    reads one rate per size, so each size gets the mean of the shapes around it, not an outlier."""
    blocks: list[list[float]] = []  # [sum of rates, count, first index]
    for i, (_, rate) in enumerate(points):
        blocks.append([rate, 1, i])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count, _ = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    rates = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return [[size, rate] for (size, _), rate in zip(points, rates)]


def hbm_gbps() -> float:
    x = torch.empty(2**29, device="cuda", dtype=torch.float16)  # 1 GiB
    y = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / cuda_seconds(lambda: y.copy_(x)) / 1e9


def _collective_worker(rank: int, world: int, port: int, out: str) -> None:
    """One process per GPU: every collective of ``COLLECTIVES`` at each size; rank 0 writes
    [bytes, bus GB/s] per op (NCCL's bus bandwidth convention)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    result: dict[str, list[list[float]]] = {op: [] for op in COLLECTIVES}
    for nbytes in COLLECTIVE_BYTES:
        whole = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        other = torch.empty_like(whole)
        part = torch.empty(nbytes // 2 // world, device="cuda", dtype=torch.bfloat16)

        def exchange() -> None:  # ranks 0 and 1 swap a tensor, as neighbouring pipeline stages do
            if rank < 2:
                peer = 1 - rank
                for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, whole, peer), dist.P2POp(dist.irecv, other, peer)]):
                    work.wait()

        ops = {
            "all_gather": lambda: dist.all_gather_into_tensor(whole, part),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole),
            "all_reduce": lambda: dist.all_reduce(whole),
            "all_to_all": lambda: dist.all_to_all_single(other, whole),
            "p2p": exchange,
        }
        for op, fn in ops.items():
            dist.barrier()
            seconds = cuda_seconds(fn, repeat=5)
            factor = {"all_reduce": 2 * (world - 1) / world, "p2p": 1.0}.get(op, (world - 1) / world)
            result[op].append([float(nbytes), nbytes * factor / seconds / 1e9])
    if rank == 0:
        Path(out).write_text(repr(result))
    dist.destroy_process_group()


def collective_curves(world: int) -> dict[str, list[list[float]]]:
    import ast

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(f"/tmp/meshtron_calibrate_{os.getpid()}.txt")
    mp.spawn(_collective_worker, args=(world, port, str(out)), nprocs=world)
    curves = ast.literal_eval(out.read_text())
    out.unlink()
    return {op: points for op, points in curves.items() if points}


def calibrate(cfg: Config, path: str) -> Machine:
    """Measure this machine for ``cfg``'s shapes and write ``path``; prints what it measured."""
    if not torch.cuda.is_available():
        raise ValueError("meshtron plan --calibrate times this machine's GPUs, and it has none")
    began = time.time()
    name = torch.cuda.get_device_name(0)
    base = load(shipped_for(name))
    peak, _ = datasheet_peak_tflops(name)
    when = time.strftime("%Y-%m-%d")
    measured = f"measured by meshtron plan --calibrate on {name}, {when}"
    sources = {key: f"kept from the shipped {base.device} file: {value}" for key, value in base.sources.items()}
    fields = {
        "device": name,
        "peak_tflops": peak or base.peak_tflops,
        "memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
        "gemm_tflops": gemm_points(cfg, base),
        "attention_tflops": attention_points(cfg),
        "hbm_gbps": hbm_gbps(),
        "on_paper": False,
    }
    if cfg.model.num_experts:
        fields["grouped_gemm_curve"] = [[rows_per_expert(cfg, n), grouped_gemm_factor(cfg, fields["gemm_tflops"], n)] for n in GROUPED_SEQUENCES]
        fields["grouped_gemm_factor"] = fields["grouped_gemm_curve"][0][1]
        sources["grouped_gemm_factor"] = f"{measured}: the model's expert fc1 and fc2, forward and backward, against the GEMM curve"
        sources["grouped_gemm_curve"] = f"{measured}: the same at the rows per expert of {', '.join(map(str, GROUPED_SEQUENCES))} sequences"
    try:
        fields["host_ms_per_block"] = host_ms_per_block(cfg)
        fields["host_ms_per_block_recompute"] = host_ms_per_block(cfg, "full")
        for field_name, under in (("host_ms_per_block", ""), ("host_ms_per_block_recompute", " under full recompute")):
            sources[field_name] = f"{measured}: one block's forward + backward{under} at {HOST_TOKENS} tokens on one GPU (host-bound), no optimizer step"
    except torch.OutOfMemoryError as exc:
        print(f"  {exc}: the shipped {base.device} file's host times are kept")
    world = torch.cuda.device_count()
    if world >= 2:
        fields["nvlink"] = {**base.nvlink, **collective_curves(world)}
        sources["nvlink"] = f"{measured} over {world} GPUs (ops not measured kept from the shipped file)"
    sources.update({key: measured for key in ("peak_tflops", "memory_gib", "gemm_tflops", "attention_tflops", "hbm_gbps")})
    sources["peak_tflops"] = "datasheet dense bf16 peak (training/peak_flops.py)"
    machine = dataclasses.replace(base, **fields, sources=sources)
    Path(path).write_text(machine.to_json() + "\n")
    print(f"calibration of {name} ({world} GPU{'s' if world > 1 else ''}) in {time.time() - began:.0f} s -> {path}")
    print(f"  GEMM TFLOP/s by FLOPs: {', '.join(f'{f:.1e}: {t:.0f}' for f, t in machine.gemm_tflops)}")
    print(f"  attention TFLOP/s by query tokens: {', '.join(f'{s:.0f}: {t:.0f}' for s, t in machine.attention_tflops)}")
    print("  host per block (forward + backward): " + ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in machine.host_ms_per_block.items())
          + "; under full recompute: " + ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in machine.host_ms_per_block_recompute.items()))
    print("  grouped expert GEMMs by rows per expert: " + ", ".join(f"{rows:.0f}: {factor:.2f} of dense" for rows, factor in machine.grouped_gemm_curve)
          if cfg.model.num_experts else "  no experts")  # fmt: skip
    print(f"  HBM {machine.hbm_gbps:.0f} GB/s" + (f"; collectives over {world}: " + "; ".join(
        f"{op} {points[-1][1]:.0f} GB/s at {points[-1][0] / 2**20:.0f} MiB" for op, points in machine.nvlink.items()) if world >= 2 else
        "; collectives: one GPU, the shipped curves kept"))  # fmt: skip
    return machine
