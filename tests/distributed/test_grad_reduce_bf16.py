"""``--grad-reduce-in-bf16``: the gradient buffer reduces a bf16 copy of each bucket and writes
the result back into its fp32 gradients. Against the fp32 reduction of the same gradients on 2 gloo
ranks, all-reduce (plain data parallel) and reduce-scatter (distributed optimizer), with several
buckets and two accumulated micro batches: every reduced element within bf16's rounding of the sum
(relative 2^-8 of each bucket's largest value, plus the rounding of each rank's share), and not all equal to the
fp32 result (the bf16 path ran)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from launcher import run_distributed
from meshtron.optim.grad_buffer import GradBuffer

BUCKET = 300  # elements: the model below spreads over several buckets


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8))


def _reduced_grads(rank: int, shard: bool, reduce_dtype: torch.dtype) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    model = _model()
    buffer = GradBuffer(list(model.named_parameters()), group=dist.group.WORLD, bucket_size=BUCKET, shard=shard,
                        reduce_dtype=reduce_dtype)  # fmt: skip
    torch.manual_seed(100 + rank)  # each rank its own data
    inputs = [torch.randn(4, 16) * (1 + 10 * rank) for _ in range(2)]
    with buffer.no_sync():
        model(inputs[0]).square().sum().backward()
    model(inputs[1]).square().sum().backward()
    buffer.finish_grad_sync()
    owned = [buffer.shard_range(b) if shard else (b.start, b.end) for b in buffer.buckets]
    return buffer.data.clone(), owned


def _compare(rank: int, world_size: int) -> dict[str, tuple[float, float, bool]]:
    out = {}
    for shard in (False, True):
        exact, owned = _reduced_grads(rank, shard, torch.float32)
        low, _ = _reduced_grads(rank, shard, torch.bfloat16)
        worst, differs = 0.0, False
        for lo, hi in owned:
            ref, got = exact[lo:hi], low[lo:hi]
            scale = ref.abs().max().clamp(min=1e-30)
            worst = max(worst, ((got - ref).abs().max() / scale).item())
            differs |= not torch.equal(got, ref)
        out["reduce-scatter" if shard else "all-reduce"] = (worst, len(owned), differs)
    return out


def test_bf16_reduction_matches_fp32_within_bf16_rounding():
    for per_rank in run_distributed(_compare, 2):
        for kind, (worst, buckets, differs) in per_rank.items():
            assert buckets > 1, f"{kind}: the test needs several buckets"
            # Each rank's share and the sum are each rounded once to bf16 (8 significant bits).
            assert worst <= 3 * 2.0**-8, f"{kind}: relative error {worst:.2e} beyond bf16 rounding"
            assert differs, f"{kind}: the bf16 path gave the fp32 result exactly; it did not reduce in bf16"
