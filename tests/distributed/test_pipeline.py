"""Pipeline parallelism equals the one-process model: the step's loss and every gradient.

One spawn of 4 gloo processes runs every case in turn, each on its own mesh:

  pp4 1F1B, tied embeddings (the copies live on ranks 0 and 3, not neighbours), 8 micro batches
  pp4 all-forward-all-backward, untied, 8 micro batches
  pp2 x dp2 interleaved, 2 virtual stages (4 layers -> 4 chunks of one), 4 micro batches per dp rank
  pp2 x dp2 interleaved split by modeled cost (an output layer worth two layers -> chunks of 1, 1, 2
    and 0 layers: the last holds the output layer alone), 4 micro batches per dp rank
  pp2 x dp2 1F1B, first stage 1 layer and last 3, 4 micro batches per dp rank, then forward-only
  pp2 x tp2 1F1B with sequence parallelism and tied embeddings, 8 micro batches

Each case runs through the runner (``runner_for``: plan, stage split, optimizer with its
gradient buffer over dp), as training does. The reference is the plain tiny Llama in pytest's
process on the same 8 micro batches (loss = masked sum / tokens of the whole global batch, one
backward per micro batch). Data-parallel cases split the micro batches over dp. Every
parameter's gradient is compared by name on every rank that holds it (a tied embedding on both
of its stages; tensor-parallel shards gathered whole first), and every reference name must be
covered. Tolerance: fp32 on the CPU, 1e-5 relative (as a norm over the whole tensor).

Every case frees each activation once sent (its values are never read again, only its graph);
the balanced case also counts the bytes the sent activations still hold after the step.
"""

from __future__ import annotations

import functools

import pytest
import torch

from launcher import run_distributed
from meshtron.config import ModelConfig, ParallelConfig, TrainConfig
from meshtron.models import build_model
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.pipeline_balance import PipelineCosts
from meshtron.parallel.plan import gather_full
from meshtron.parallel.setup import runner_for

SEED, VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES = 1234, 128, 16, 2, 8
RTOL = 1e-5
LLAMA = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, activation="swiglu",
             position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False)  # fmt: skip
CASES = {
    # name: (mesh sizes, tied, schedule, virtual, first/last stage layers, output layer's cost in layers)
    "pp4_1f1b_tied": (dict(pp=4), True, "1f1b", 1, (0, 0), None),
    "pp4_afab": (dict(pp=4), False, "afab", 1, (0, 0), None),
    "pp2_dp2_interleaved": (dict(pp=2, dp=2), False, "interleaved", 2, (0, 0), None),
    "pp2_dp2_interleaved_balanced": (dict(pp=2, dp=2), False, "interleaved", 2, (0, 0), 2.0),
    "pp2_dp2_1f1b_uneven": (dict(pp=2, dp=2), False, "1f1b", 1, (1, 3), None),
    "pp2_tp2_sp_1f1b_tied": (dict(pp=2, tp=2), True, "1f1b", 1, (0, 0), None),
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


@functools.lru_cache
def _reference(tied: bool) -> dict:
    model, batches = _model(tied), _micro_batches()
    num_tokens = sum(b["loss_mask"].sum() for b in batches)
    losses = []
    for b in batches:
        loss = (model(b["tokens"], position_ids=b["position_ids"], labels=b["labels"]) * b["loss_mask"]).sum() / num_tokens
        loss.backward()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "grads": {n: p.grad for n, p in model.named_parameters()}}


def _run_case(rank: int, name: str) -> dict:
    sizes, tied, schedule, virtual, (first, last), head_cost = CASES[name]
    mesh = Mesh(**sizes, rank=rank)
    mesh.init_process_groups()
    parallel = ParallelConfig(tensor_parallel=mesh.tp, pipeline_parallel=mesh.pp, sequence_parallel=mesh.tp > 1,
                              virtual_pipeline_parallel=virtual, pipeline_schedule=schedule,
                              first_pipeline_stage_layers=first, last_pipeline_stage_layers=last)  # fmt: skip
    costs = None if head_cost is None else PipelineCosts(0.0, [1.0] * LLAMA["num_layers"], head_cost)
    train = TrainConfig(micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH * MICRO_BATCHES)
    runner = runner_for(_model(tied), mesh, parallel, train, torch.float32, costs=costs)
    model, batches = runner.model, _micro_batches()
    mine = [batches[i] for i in range(MICRO_BATCHES)[mesh.dp_rank :: mesh.dp]]
    sent = _record_sent_activations(runner.stages)
    runner.optimizer.zero_grad()
    loss = runner.forward_backward(mine)
    runner.finalize_grads()
    out = {"total": (loss.total / loss.count).item(), "count": loss.count.item(), "split": [len(r) for r in runner.split]}
    out["sent_bytes"] = [(t.untyped_storage().nbytes(), full, t.grad_fn is not None) for t, full in sent]
    out["grads"] = {n: gather_full(p.main_grad.clone(), runner.metas[n], mesh) for n, p in model.named_parameters()}
    if name == "pp2_dp2_1f1b_uneven":
        evaluated = runner.forward_backward(mine, forward_only=True)
        out["eval_total"] = (evaluated.total / evaluated.count).item()
        try:
            model(batches[0]["tokens"])
        except RuntimeError as exc:
            out["direct_call_error"] = str(exc)
    return out


def _record_sent_activations(stages) -> list[tuple[torch.Tensor, int]]:
    """Every activation a stage hands on in the coming step, with its bytes when produced."""
    sent = []
    for stage in stages:
        if not stage.is_last:
            def forward(carry, batch, _run=stage.forward):
                out, aux = _run(carry, batch)
                sent.extend((t, t.untyped_storage().nbytes()) for t in out.values())
                return out, aux

            stage.forward = forward
    return sent


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
    sizes, tied, _, virtual, _, _ = CASES[name]
    ref = _reference(tied)
    results = [run[name] for run in runs]
    want_count = sum(b["loss_mask"].sum() for b in _micro_batches()).item()
    for rank, r in enumerate(results):
        _assert_rel_close(torch.tensor(r["total"]), ref["losses"].sum(), f"{name} rank {rank} step loss")
        assert r["count"] == want_count, "the loss is normalized by the tokens of the whole global batch"
    holders: dict[str, int] = {}
    for rank, r in enumerate(results):
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
    for r in results:
        _assert_rel_close(torch.tensor(r["eval_total"]), ref["losses"].sum(), "forward-only loss")
    assert all("meshtron.parallel.runner" in r["direct_call_error"] for r in results)


def test_balanced_split_and_released_activations(runs):
    """The modeled split gives the last chunk no layer (its output layer weighs two), and after
    the step every activation a stage sent holds one element, not [b, s, h], with its graph kept
    (the gradients above went through it)."""
    for run in runs:
        assert run["pp2_dp2_interleaved_balanced"]["split"] == [1, 1, 2, 0]
        assert run["pp2_dp2_interleaved"]["split"] == [1, 1, 1, 1]
    for name in ("pp2_dp2_interleaved_balanced", "pp4_1f1b_tied", "pp2_tp2_sp_1f1b_tied"):
        sent = [s for run in runs for s in run[name]["sent_bytes"]]  # the last stage sends nothing
        assert len(sent) >= MICRO_BATCHES and all(full >= MICRO_BATCH * 8 * 64 * 4 for _, full, _ in sent), name
        assert all(held == 4 and has_graph for held, _, has_graph in sent), f"{name}: {sent}"
