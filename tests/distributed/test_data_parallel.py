"""Data parallelism equals the one-process run: losses, grad norms, gradients and parameters.

The reference is one process training on the whole global batch as one micro batch. The data
parallel run splits the same global batch over dp=2 gloo processes, each taking 2 micro batches
(gradient accumulation under ``no_sync``), with a bucket size small enough to give several
buckets. Loss masks are random, so ranks hold different token counts and only the trainer's
normalization (masked loss sum / tokens of the whole global batch, grads summed over dp) agrees.
Clipping is active on every step, so the global grad norm matters.
Tolerance: fp32 on the CPU, 1e-5 relative (as a norm over the whole tensor).

This module also holds the harness the distributed-optimizer and FSDP tests share.
"""

from __future__ import annotations

import dataclasses

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist

from launcher import run_distributed
from meshtron.config import ModelConfig, TrainConfig
from meshtron.kernels.grad_accum_fusion import apply_gradient_accumulation_fusion
from meshtron.models import build_model
from meshtron.optim.lr_schedule import LRSchedule
from meshtron.optim.loss_scaler import ConstantLossScaler
from meshtron.models.contract import default_meta
from meshtron.optim.build import build_optimizer
from meshtron.optim.optimizer import MixedPrecisionOptimizer, build_param_groups
from meshtron.parallel.mesh import Mesh

SEED, VOCAB, SEQ = 1234, 128, 16
GLOBAL_BATCH, DP, MICRO_BATCHES, STEPS = 8, 2, 2, 5
BUCKET = 20_000  # elements: the ~100k-parameter model spreads over several buckets
RTOL = 1e-5
MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, activation="swiglu",
                    normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False)  # fmt: skip
TRAIN = TrainConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2, train_iters=STEPS, weight_decay=0.1, clip_grad=0.3)


def make_model(dtype: torch.dtype = torch.float32, seed: int = SEED):
    torch.manual_seed(seed)
    return build_model(MODEL, VOCAB, SEQ).to(dtype)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """The step's global batch: random tokens and labels, and a random loss mask (~80% ones)."""
    g = torch.Generator().manual_seed(100 + step)
    return {
        "tokens": torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
        "labels": torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
        "loss_mask": (torch.rand(GLOBAL_BATCH, SEQ, generator=g) < 0.8).float(),
    }


def local_micro_batches(step: int, rank: int, dp: int, micro_batches: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s contiguous share of the global batch, cut into ``micro_batches``."""
    batch = {k: v.chunk(dp)[rank] for k, v in global_batch(step).items()}
    return [{k: v.chunk(micro_batches)[i] for k, v in batch.items()} for i in range(micro_batches)]


def owned_grads(opt) -> dict[str, tuple[int, int, torch.Tensor]]:
    """{name: (lo, hi, grad elements [lo, hi) of the flattened param)} for the gradient elements
    this rank holds reduced: everything after an all-reduce, its slices after a reduce-scatter."""
    buf, out = opt.grads, {}
    for bucket in buf.buckets:
        lo, hi = buf.shard_range(bucket) if buf.shard else (bucket.start, bucket.end)
        for param in bucket.params:
            a, b = buf.ranges[param]
            start, end = max(a, lo), min(b, hi)
            if start < end:
                out[buf.names[param]] = (start - a, end - a, buf.data[start:end].clone())
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered if it is an FSDP shard (DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(model, opt, steps: range, rank: int = 0, dp: int = 1, micro_batches: int = 1, group=None,
          grads_of=owned_grads) -> dict:  # fmt: skip
    """The trainer's step, ``steps`` times: tokens of the global batch counted over dp, every micro
    batch but the last under ``no_sync``, then ``step``. Returns global losses, grad norms, the
    first step's reduced gradients (before clipping, as ``grads_of(opt)`` reads them) and the
    final full state dict."""
    schedule = LRSchedule.from_config(TRAIN)
    out = {"losses": [], "norms": [], "grads": None}
    for step in steps:
        batches = local_micro_batches(step, rank, dp, micro_batches)
        tokens = sum(b["loss_mask"].sum() for b in batches)
        loss_sum = torch.zeros(())
        if group is not None:
            dist.all_reduce(tokens, group=group)
        opt.zero_grad()
        for i, b in enumerate(batches):
            with opt.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                loss = (model(b["tokens"], labels=b["labels"]) * b["loss_mask"]).sum() / tokens
                opt.scale_loss(loss).backward()
            loss_sum += loss.detach().float()
        opt.finish_grad_sync()
        if out["grads"] is None:
            out["grads"] = grads_of(opt)
        result = opt.step(schedule.lr_at(step))
        if group is not None:
            dist.all_reduce(loss_sum, group=group)
        out["losses"].append(loss_sum.item())
        out["norms"].append(result.grad_norm)
    opt.finish_param_sync()  # --overlap-param-gather: the last step's gathers are still owed
    out["params"] = {k: full(v).detach().float().clone() for k, v in model.state_dict().items()}
    return out


@functools.lru_cache
def reference(dtype: torch.dtype = torch.float32, steps: int = STEPS, micro_batches: int = 1) -> dict:
    """One process, the whole global batch per step."""
    model = make_model(dtype)
    return train(model, build_optimizer(model, TRAIN, dtype), range(steps), micro_batches=micro_batches)


def dp_mesh(rank: int) -> Mesh:
    mesh = Mesh(dp=DP, rank=rank)
    mesh.init_process_groups()
    return mesh


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    err = (actual.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-30)
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e}"


def assert_matches_reference(runs: list[dict], ref: dict, rtol: float = RTOL) -> None:
    """Every rank's losses, norms and final params equal the reference's; the ranks' reduced
    gradient elements together cover every parameter and equal the reference's."""
    assert min(ref["norms"]) > TRAIN.clip_grad  # clipping was active on every step
    covered = {name: torch.zeros(g.numel(), dtype=torch.bool) for name, (_, _, g) in ref["grads"].items()}
    for rank, run in enumerate(runs):
        assert_rel_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol, f"rank {rank} losses")
        assert_rel_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), rtol, f"rank {rank} grad norms")
        for name, (lo, hi, grad) in run["grads"].items():
            assert_rel_close(grad, ref["grads"][name][2][lo:hi], rtol, f"rank {rank} grad of {name}[{lo}:{hi}]")
            covered[name][lo:hi] = True
        assert run["params"].keys() == ref["params"].keys()
        for name, value in run["params"].items():
            assert_rel_close(value, ref["params"][name], rtol, f"rank {rank} param {name} after {STEPS} steps")
    assert all(c.all() for c in covered.values()), "some gradient elements are reduced on no rank"


# ---------------------------------------------------------------------- all-reduce (no sharding)


def _ddp_worker(rank: int, world_size: int, fuse_wgrad: bool = False) -> dict:
    mesh = dp_mesh(rank)
    model = make_model()
    if fuse_wgrad:
        apply_gradient_accumulation_fusion(model.blocks())
    opt = build_optimizer(model, TRAIN, torch.float32, dp_group=mesh.dp_cp_group, bucket_size=BUCKET)
    out = train(model, opt, range(STEPS), rank, DP, MICRO_BATCHES, mesh.dp_group)
    out["stats"] = opt.grads.stats
    # A second synced backward in one step would reduce its buckets twice: it must be refused.
    opt.zero_grad()
    b = local_micro_batches(0, rank, DP, MICRO_BATCHES)[0]
    (model(b["tokens"], labels=b["labels"]).sum()).backward()
    opt.finish_grad_sync()
    try:
        (model(b["tokens"], labels=b["labels"]).sum()).backward()
        out["double_sync_error"] = ""
    except RuntimeError as exc:
        out["double_sync_error"] = str(exc)
    out["tp_norm"] = _norm_with_tp_group()
    return out


def _full_batch_loss(model) -> torch.Tensor:
    b = global_batch(0)
    return (model(b["tokens"], labels=b["labels"]) * b["loss_mask"]).sum() / b["loss_mask"].sum()


def _norm_with_tp_group() -> float:
    """The grad norm when the world is passed as the tensor-parallel group and the embedding's
    record says it is split over it; every rank computes the same gradients."""
    model = make_model()
    tp = dict(tp_size=DP, tp_rank=dist.get_rank())
    metas = {n: dataclasses.replace(default_meta(n, p), **tp) for n, p in model.named_parameters()}
    metas["embedding.weight"] = dataclasses.replace(metas["embedding.weight"], tp_dim=0)
    opt = MixedPrecisionOptimizer(build_param_groups(model, 0.0), lr=0.0, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.0,
                                  loss_scaler=ConstantLossScaler(1.0), metas=metas, tp_group=dist.group.WORLD)  # fmt: skip
    opt.zero_grad()
    _full_batch_loss(model).backward()
    return opt.step(0.0).grad_norm


@pytest.mark.parametrize("fuse_wgrad", [False, True], ids=["plain", "grad_accum_fusion"])
def test_data_parallel_all_reduce_matches_one_process(fuse_wgrad):
    """With gradient-accumulation fusion the blocks' linears write into the buffer and report
    their buckets ready from backward: the same gradients, and still every bucket launched there."""
    runs = run_distributed(_ddp_worker, DP, fuse_wgrad)
    assert_matches_reference(runs, reference())
    for run in runs:
        stats = run["stats"]
        assert stats.buckets > 2  # the test covers several buckets
        assert stats.overlapped_fraction == 1.0  # every bucket launched from backward's hooks
        assert stats.wait_s >= 0.0
        assert "no_sync" in run["double_sync_error"]

    # tp norm: a param split over tp counts on every rank, a replicated one once.
    model = make_model()
    _full_batch_loss(model).backward()
    split = model.embedding.weight.grad.norm() ** 2
    replicated = sum(p.grad.norm() ** 2 for n, p in model.named_parameters() if n != "embedding.weight")
    expected = (DP * split + replicated).sqrt().item()
    for run in runs:
        assert abs(run["tp_norm"] - expected) <= RTOL * expected


def test_gradient_accumulation_matches_one_big_micro_batch():
    """One process: 4 micro batches accumulated in the fp32 buffer equal one of 4x the size."""
    assert_matches_reference([reference(micro_batches=4)], reference())


@pytest.mark.parametrize("bad", [0, -1])
def test_bucket_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="bucket_size"):
        build_optimizer(make_model(), TRAIN, torch.float32, bucket_size=bad)
