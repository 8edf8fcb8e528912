"""Where ``--tp-comm-overlap`` wins or loses, one tensor-parallel pair at a time (2+ GPUs, bf16):

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tp_overlap_pairs.py [--seq-length 8192]

For the Llama-3-8B block's two pairs (attention: QKV column + output row; MLP: SwiGLU fc1 column +
fc2 row) on one sequence of ``--seq-length`` tokens sharded over tp, forward + backward of the pair
is timed (CUDA events, median of ``--iters``) four ways: the plain sequence-parallel path, the
overlapped p2p backend, the symm_mem backend (where ``symmetric_memory_usable``), and the same
GEMMs with no communication at all (the floor overlap aims at). ``comm`` is the plain path minus
that floor: what there is to hide; ``hidden`` is the share of it an overlapped path removes.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtron.parallel import tp_overlap
from meshtron.parallel.tensor_parallel import all_gather_sequence, reduce_scatter_sequence

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 4096, 32, 8, 128, 14336


def _pair(way: str, group, x, w_col, w_row):
    """Column then row linear of the sequence shard ``x``, ``way`` plain | p2p | symm_mem | nocomm;
    between them the column output's first ``w_row``-wide features stand in for attention / SwiGLU."""
    width = w_row.shape[1]
    if way == "nocomm":  # this rank's GEMMs on a full-length input made locally: no collective at all
        full = torch.cat([x] * dist.get_world_size(group), dim=1)
        return F.linear(F.linear(full, w_col)[..., :width].contiguous(), w_row)[:, : x.shape[1]]
    if way == "plain":
        return reduce_scatter_sequence(F.linear(F.linear(all_gather_sequence(x, group), w_col)[..., :width].contiguous(), w_row), group)
    return tp_overlap.linear_scatter(tp_overlap.gather_linear(x, w_col, None, group, way)[..., :width].contiguous(), w_row, group, way)


def _time_ms(fn, iters: int) -> float:
    samples = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    group, tp = dist.group.WORLD, dist.get_world_size()
    torch.manual_seed(dist.get_rank())
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    pairs = {
        "attention": ((HEADS + 2 * KV_HEADS) * HEAD_DIM // tp, HEADS * HEAD_DIM // tp),
        "mlp": (2 * FFN // tp, FFN // tp),
    }
    ways = ["plain", "p2p"] + (["symm_mem"] if tp_overlap.symmetric_memory_usable(group) else []) + ["nocomm"]
    rows = []
    for name, (col_out, row_in) in pairs.items():
        x = torch.randn(1, args.seq_length // tp, HIDDEN, **bf16, requires_grad=True)
        w_col = (torch.randn(col_out, HIDDEN, **bf16) * 0.02).requires_grad_()
        w_row = (torch.randn(HIDDEN, row_in, **bf16) * 0.02).requires_grad_()
        grad = torch.randn(1, args.seq_length // tp, HIDDEN, **bf16)
        times = {way: _time_ms(lambda way=way: _pair(way, group, x, w_col, w_row).backward(grad), args.iters) for way in ways}
        rows.append((name, times))
    if dist.get_rank() == 0:
        print(f"tp {tp}, seq {args.seq_length}, bf16, {torch.cuda.get_device_name()}: forward + backward of one pair, ms")
        print(f"{'pair':<10} " + " ".join(f"{w:>9}" for w in ways) + f" {'comm':>7}  hidden by overlap")
        for name, t in rows:
            comm = t["plain"] - t["nocomm"]
            hidden = ", ".join(f"{w} {100 * (t['plain'] - t[w]) / comm:.0f}%" for w in ways if w not in ("plain", "nocomm")) if comm > 0 else "-"
            print(f"{name:<10} " + " ".join(f"{t[w]:>9.3f}" for w in ways) + f" {comm:>7.3f}  {hidden}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
