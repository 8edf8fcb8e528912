"""The zero-bubble schedules (``--pipeline-schedule zb-h1 | zbv``) equal the one-process model: the
step's loss, its auxiliary terms and every gradient.

One spawn of 4 gloo processes runs every case in turn, each on its own mesh:

  pp4 zb-h1, tied embeddings (copies on ranks 0 and 3), full recompute, 8 micro batches
  pp4 zbv, 8 layers in 8 chunks of one in a V, tied embeddings (both ends on rank 0: one
    parameter), 8 micro batches, then forward-only (evaluation walks the V too)
  pp4 zbv, MoE (auxiliary and z losses on every stage), untied, 8 layers, 8 micro batches
  pp2 x dp2 zb-h1, MoE, tied, 4 micro batches per dp rank (gradients reduced over dp from the W
    passes)
  pp2 x dp2 zbv, tied, full recompute, 4 micro batches per dp rank
  pp2 x tp2 zbv with sequence parallelism and tied embeddings (tensor-parallel linears' weight
    gradients deferred), 8 micro batches
  pp2 x tp2 zb-h1 with sequence parallelism and --tp-comm-overlap (the overlapped linears' weight
    gradients deferred, with the gathered input they keep), untied, 8 micro batches

Each case runs through the runner (``runner_for``: plan, V placement, optimizer with its gradient
buffer over dp), as training does. The reference is the plain model in pytest's process on the
same 8 micro batches: loss sum / tokens of the whole global batch plus each auxiliary term /
number of micro batches, one backward per micro batch. Tolerance: fp32 on the CPU, 1e-5 relative
(a norm over the whole tensor): the split computes the same products, only the order in which
micro batches' weight gradients are summed differs. Each rank also counts the weight-gradient
GEMMs its W passes ran, which must not be zero: the backward was split, not just renamed.
"""

from __future__ import annotations

import functools

import pytest
import torch

from launcher import run_distributed
from meshtron.config import ModelConfig, ParallelConfig, TrainConfig
from meshtron.kernels import deferred_wgrad
from meshtron.models import build_model
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import gather_full
from meshtron.parallel.setup import runner_for
from test_pipeline import _micro_batches  # the same packed batches, as the constants below are test_pipeline's

SEED, VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES = 1234, 128, 16, 2, 8
RTOL = 1e-5
LLAMA = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, activation="swiglu",
             position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False)  # fmt: skip
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
MODELS = {
    "tied_recompute": dict(LLAMA, tie_embeddings=True, recompute_granularity="full", recompute_num_layers=1),
    "tied8": dict(LLAMA, num_layers=8, tie_embeddings=True),
    "moe8": dict(LLAMA, num_layers=8, **MOE, moe_layer_freq="([0]+[1]*7)", tie_embeddings=False),
    "moe": dict(LLAMA, **MOE, moe_layer_freq="([0]+[1]*3)"),
    "tied": dict(LLAMA, tie_embeddings=True),
    "untied": dict(LLAMA, tie_embeddings=False),
}
CASES = {
    # name: (mesh sizes, model, schedule, virtual stages)
    "pp4_zbh1_tied_recompute": (dict(pp=4), "tied_recompute", "zb-h1", 1),
    "pp4_zbv_tied": (dict(pp=4), "tied8", "zbv", 2),
    "pp4_zbv_moe": (dict(pp=4), "moe8", "zbv", 2),
    "pp2_dp2_zbh1_moe": (dict(pp=2, dp=2), "moe", "zb-h1", 1),
    "pp2_dp2_zbv_tied_recompute": (dict(pp=2, dp=2), "tied_recompute", "zbv", 2),
    "pp2_tp2_sp_zbv_tied": (dict(pp=2, tp=2), "tied", "zbv", 2),
    "pp2_tp2_sp_overlap_zbh1": (dict(pp=2, tp=2), "untied", "zb-h1", 1),
}


def _model(name: str):
    torch.manual_seed(SEED)
    return build_model(ModelConfig(**MODELS[name]), VOCAB, SEQ)


@functools.lru_cache
def _reference(model_name: str) -> dict:
    """One process, the model's own stage on every micro batch (its one-process forward)."""
    model, batches = _model(model_name), _micro_batches()
    count = sum(b["loss_mask"].sum() for b in batches)
    total, aux_sum = torch.zeros(()), {}
    for b in batches:
        out, aux = model.run_stage(None, b, list(model.blocks()), True, True)
        loss_sum = model.loss(b, out).total
        (loss_sum / count + sum(aux.values(), torch.zeros(())) / MICRO_BATCHES).backward()
        total += loss_sum.detach()
        for name, value in aux.items():
            aux_sum[name] = aux_sum.get(name, 0.0) + value.detach() / MICRO_BATCHES
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"loss": (total / count).item(), "aux": {k: v.item() for k, v in aux_sum.items()}, "grads": grads}


def _run_case(rank: int, name: str) -> dict:
    sizes, model_name, schedule, virtual = CASES[name]
    mesh = Mesh(**sizes, rank=rank)
    mesh.init_process_groups()
    parallel = ParallelConfig(tensor_parallel=mesh.tp, pipeline_parallel=mesh.pp, sequence_parallel=mesh.tp > 1,
                              virtual_pipeline_parallel=virtual, pipeline_schedule=schedule,
                              tp_comm_overlap="overlap" in name)  # fmt: skip
    train = TrainConfig(micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH * MICRO_BATCHES)
    runner = runner_for(_model(model_name), mesh, parallel, train, torch.float32)
    assert runner.schedule == schedule
    batches = _micro_batches()
    mine = [batches[i] for i in range(MICRO_BATCHES)[mesh.dp_rank :: mesh.dp]]
    deferred = _count_deferred()
    runner.optimizer.zero_grad()
    loss = runner.forward_backward(mine)
    runner.finalize_grads()
    out = {"loss": (loss.total / loss.count).item(), "aux": {k: v.item() for k, v in loss.aux.items()},
           "deferred": deferred.pop(), "chunks": [len(s.blocks) for s in runner.stages],
           "overlapped": any(getattr(m, "comm_overlap", "") for m in runner.model.modules())}  # fmt: skip
    out["grads"] = {n: gather_full(p.main_grad.clone(), runner.metas[n], mesh) for n, p in runner.model.named_parameters()}
    if name == "pp4_zbv_tied":
        evaluated = runner.forward_backward(mine, forward_only=True)
        out["eval_loss"] = (evaluated.total / evaluated.count).item()
    return out


_RUN = deferred_wgrad.WeightGradStore.run


def _count_deferred() -> list[int]:
    """How many weight-gradient GEMMs the W passes of the coming step run (patched in for it)."""
    counted = [0]

    def counting(self, key):
        counted[0] += len(self.pending.get(key, []))
        return _RUN(self, key)

    deferred_wgrad.WeightGradStore.run = counting
    return counted


def _worker(rank: int, world_size: int) -> dict:
    return {name: _run_case(rank, name) for name in CASES}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_worker, 4, timeout=600.0)


def _assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-30)
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL:.0e}"


@pytest.mark.parametrize("name", list(CASES))
def test_zero_bubble_matches_one_process(runs, name):
    sizes, model_name, _, virtual = CASES[name]
    ref = _reference(model_name)
    results = [run[name] for run in runs]
    holders: dict[str, int] = {}
    for rank, r in enumerate(results):
        assert abs(r["loss"] - ref["loss"]) <= RTOL * ref["loss"], f"{name} rank {rank}: loss {r['loss']} != {ref['loss']}"
        assert r["aux"].keys() == ref["aux"].keys(), f"{name} rank {rank}: auxiliary terms {sorted(r['aux'])}"
        for term, value in ref["aux"].items():
            assert abs(r["aux"][term] - value) <= RTOL * abs(value), f"{name} rank {rank}: {term} {r['aux'][term]} != {value}"
        for pname, grad in r["grads"].items():
            _assert_rel_close(grad, ref["grads"][pname], f"{name} rank {rank} grad of {pname}")
            holders[pname] = holders.get(pname, 0) + 1
        assert len(r["chunks"]) == virtual and all(r["chunks"])
        assert r["overlapped"] == ("overlap" in name)
        # every linear of every block defers: q/k/v (fused or not), the output projection, the MLP's
        assert r["deferred"] >= sum(r["chunks"]) * (MICRO_BATCHES // sizes.get("dp", 1)) * 2, f"{name} rank {rank}: {r['deferred']}"
    assert holders.keys() == ref["grads"].keys()
    replicas = len(runs) // sizes["pp"]
    for pname, count in holders.items():
        # a tied embedding lives on the first and the last stage: two ranks, or one (zbv's rank 0)
        copies = 2 if ModelConfig(**MODELS[model_name]).tie_embeddings and pname == "embedding.weight" and virtual == 1 else 1
        assert count == copies * replicas, f"{name}: {pname} held by {count} ranks"


def test_zbv_places_the_model_in_a_v_and_evaluates_through_it(runs):
    """pp4 zbv: rank r holds model chunks r and 7 - r (one layer each); forward-only gives the loss."""
    for r in (run["pp4_zbv_tied"] for run in runs):
        assert r["chunks"] == [1, 1]
        assert abs(r["eval_loss"] - _reference("tied8")["loss"]) <= RTOL * r["eval_loss"]
    holding = [sorted(n for n in run["pp4_zbv_tied"]["grads"] if n.startswith("layers.")) for run in runs]
    assert [sorted({int(n.split(".")[1]) for n in names}) for names in holding] == [[0, 7], [1, 6], [2, 5], [3, 4]]
