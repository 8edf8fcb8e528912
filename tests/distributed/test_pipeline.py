"""Pipeline parallelism equals the one-process model: per-micro-batch losses and every gradient.

One spawn of 4 gloo processes runs every case in turn, each on its own mesh:

  pp4 1F1B, tied embeddings (the copies live on ranks 0 and 3, not neighbours), 8 micro batches
  pp4 all-forward-all-backward, untied, 8 micro batches
  pp2 x dp2 interleaved, 2 virtual stages (4 layers -> 4 chunks of one), 4 micro batches per dp rank
  pp2 x dp2 1F1B, first stage 1 layer and last 3, 4 micro batches per dp rank, then forward-only
  pp2 x tp2 1F1B with sequence parallelism and tied embeddings, 8 micro batches

The reference is the plain tiny Llama in pytest's process on the same 8 micro batches (loss =
masked sum / tokens of the whole global batch, one backward per micro batch). Data-parallel cases
split the micro batches over dp and sum gradients over dp, as the trainer's buffer does. Every
parameter's gradient is compared by name on every rank that holds it (a tied embedding on both
of its stages; tensor-parallel shards gathered whole first), and every reference name must be
covered. Tolerance: fp32 on the CPU, 1e-5 relative (as a norm over the whole tensor).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist

from launcher import run_distributed
from meshtron.config import ModelConfig
from meshtron.models import build_model
from meshtron.parallel.apply import apply_tensor_parallel, finalize_tensor_parallel_grads, gather_full
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.pipeline import (
    allreduce_tied_embedding_grads,
    build_stage_modules,
    forward_backward,
    forward_backward_1f1b,
    forward_backward_afab,
    forward_backward_interleaved,
    pipeline_loss,
)

SEED, VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES = 1234, 128, 16, 2, 8
RTOL = 1e-5
LLAMA = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, activation="swiglu",
             position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False)  # fmt: skip
CASES = {
    # name: (mesh sizes, tied, schedule, virtual, first/last stage layers)
    "pp4_1f1b_tied": (dict(pp=4), True, forward_backward_1f1b, 1, (None, None)),
    "pp4_afab": (dict(pp=4), False, forward_backward_afab, 1, (None, None)),
    "pp2_dp2_interleaved": (dict(pp=2, dp=2), False, forward_backward_interleaved, 2, (None, None)),
    "pp2_dp2_1f1b_uneven": (dict(pp=2, dp=2), False, forward_backward_1f1b, 1, (1, 3)),
    "pp2_tp2_sp_1f1b_tied": (dict(pp=2, tp=2), True, forward_backward_1f1b, 1, (None, None)),
}


def _model(tied: bool):
    torch.manual_seed(SEED)
    return build_model(ModelConfig(**LLAMA, tie_embeddings=tied), VOCAB, SEQ)


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    """Random tokens, labels and loss masks (~80% ones); two documents packed in each sequence,
    whose positions restart (every stage's RoPE must see them)."""
    g = torch.Generator().manual_seed(7)
    positions = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ - SEQ // 2)]).expand(MICRO_BATCH, SEQ)
    return [{"tokens": torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g),
             "labels": torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g),
             "loss_mask": (torch.rand(MICRO_BATCH, SEQ, generator=g) < 0.8).float(),
             "position_ids": positions}
            for _ in range(MICRO_BATCHES)]  # fmt: skip


def _loss_fn(num_tokens: torch.Tensor):
    return lambda per_token, batch: (per_token * batch["loss_mask"]).sum() / num_tokens


@functools.lru_cache
def _reference(tied: bool) -> dict:
    model, batches = _model(tied), _micro_batches()
    loss_fn = _loss_fn(sum(b["loss_mask"].sum() for b in batches))
    losses = []
    for b in batches:
        loss = loss_fn(model(b["tokens"], position_ids=b["position_ids"], labels=b["labels"]), b)
        loss.backward()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "grads": {n: p.grad for n, p in model.named_parameters()}}


@contextlib.contextmanager
def _counting(counter: list[int]):
    counter[0] += 1
    yield


def _run_case(rank: int, name: str) -> dict:
    sizes, tied, schedule, virtual, (first, last) = CASES[name]
    mesh = Mesh(**sizes, rank=rank)
    mesh.init_process_groups()
    model = _model(tied)
    model = apply_tensor_parallel(model, mesh, sequence_parallel=mesh.tp_size > 1)
    stages = build_stage_modules(model, mesh, virtual, first, last)
    batches = _micro_batches()
    loss_fn = _loss_fn(sum(b["loss_mask"].sum() for b in batches))
    mine = list(range(MICRO_BATCHES))[mesh.dp_rank :: mesh.dp_size]
    unsynced = [0]
    losses = schedule(stages, [batches[i] for i in mine], mesh, loss_fn, torch.float32,
                      no_sync=lambda: _counting(unsynced))  # fmt: skip
    out = {"unsynced": unsynced[0], "backwards": len(mine) * virtual, "chunks": virtual}
    total = pipeline_loss(losses, mesh, torch.device("cpu"))
    if mesh.dp_size > 1:
        dist.all_reduce(total, group=mesh.dp_group)
    out["total"] = total.item()
    if losses is not None:
        out["losses"] = dict(zip(mine, [loss.item() for loss in losses]))
    finalize_tensor_parallel_grads(model, mesh)
    allreduce_tied_embedding_grads(stages, mesh)
    grads = {}
    for pname, param in model.named_parameters():
        grad = param.grad
        if mesh.dp_size > 1:
            dist.all_reduce(grad, group=mesh.dp_group)
        shard = getattr(param, "tp_shard", None)
        grads[pname] = grad.clone() if shard is None else gather_full(grad, shard, mesh)
    out["grads"] = grads
    out["stage_params"] = sorted(n for s in stages for n, _ in s.named_parameters())
    if name == "pp2_dp2_1f1b_uneven":
        evaluated = forward_backward("1f1b", stages, [batches[i] for i in mine], mesh, loss_fn, torch.float32,
                                     forward_only=True)  # fmt: skip
        if evaluated is not None:
            out["eval_losses"] = dict(zip(mine, [loss.item() for loss in evaluated]))
        try:
            model(batches[0]["tokens"])
        except RuntimeError as exc:
            out["direct_call_error"] = str(exc)
    return out


def _worker(rank: int, world_size: int) -> dict:
    return {name: _run_case(rank, name) for name in CASES}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_worker, 4)


def _assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-30)
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL:.0e}"


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_one_process(runs, name):
    sizes, tied, _, virtual, _ = CASES[name]
    ref = _reference(tied)
    results = [run[name] for run in runs]
    losses = {mb: value for r in results for mb, value in r.get("losses", {}).items()}
    assert sorted(losses) == list(range(MICRO_BATCHES))
    _assert_rel_close(torch.tensor([losses[i] for i in range(MICRO_BATCHES)]), ref["losses"], f"{name} losses")
    for rank, r in enumerate(results):
        _assert_rel_close(torch.tensor(r["total"]), ref["losses"].sum(), f"{name} rank {rank} step loss")
        assert r["unsynced"] == r["backwards"] - r["chunks"], "all backwards but each chunk's last under no_sync"
    holders: dict[str, int] = {}
    for rank, r in enumerate(results):
        assert r["stage_params"] == sorted(r["grads"]), "the stages hold exactly the model's parameters"
        for pname, grad in r["grads"].items():
            _assert_rel_close(grad, ref["grads"][pname], f"{name} rank {rank} grad of {pname}")
            holders[pname] = holders.get(pname, 0) + 1
    assert holders.keys() == ref["grads"].keys()
    replicas = len(runs) // sizes["pp"]  # ranks holding the same stage (tp shards gathered, dp copies)
    for pname, count in holders.items():
        copies = 2 if tied and pname == "embedding.weight" else 1
        assert count == copies * replicas, f"{name}: {pname} held by {count} ranks"


def test_forward_only_and_direct_call(runs):
    ref = _reference(False)
    results = [run["pp2_dp2_1f1b_uneven"] for run in runs]
    losses = {mb: value for r in results for mb, value in r.get("eval_losses", {}).items()}
    _assert_rel_close(torch.tensor([losses[i] for i in range(MICRO_BATCHES)]), ref["losses"], "forward-only losses")
    assert all("forward_backward" in r["direct_call_error"] for r in results)
