"""Pipelines with fewer micro batches than stages (one, as a layout with micro batch = global batch
/ dp gives) equal one process, and every pair of pipeline ranks first connects in mirrored calls.

One spawn of 4 gloo processes runs, each on its own mesh and through the runner as training does:

  pp4 1F1B, tied embeddings (the copies on ranks 0 and 3 swap gradients): one micro batch; one
    with full activation recompute; two micro batches
  pp2 x dp2 zbv (two chunks per rank), one micro batch per dp rank
  pp2 x dp2 interleaved (two chunks per rank), two micro batches per dp rank (all forwards first)
  pp2 x dp2 1F1B with the distributed optimizer on a tiny DeepSeek (MLA, a dense first layer, then
    MoE layers with shared experts and both balancing losses): one and two micro batches per dp rank

Step loss, auxiliary terms and every gradient element (where the rank holds it reduced: its shard
under the distributed optimizer) match one process on the same micro batches within 1e-5 relative
(fp32 on the CPU; gradients as a norm over each tensor's elements held).

On NCCL the one-micro-batch cases failed where gloo ran them fine: 1F1B's first pipeline rank
sent its activation and received its gradient in one group call, its neighbour received and
later sent in two, and NCCL's lazy connection handshake needs the two sides' first calls to
mirror each other (ncclInternalError on a two-rank pipeline group, a hang on four ranks;
``nccl_links``). Every ``batch_isend_irecv`` of each case, the set-up's included, is recorded
and checked against that rule.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from launcher import run_distributed
from meshtron.config import ModelConfig, ParallelConfig, TrainConfig, build_config
from meshtron.models import build_model
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.setup import runner_for
from nccl_links import mismatched_first_contacts, recorded_p2p
from test_data_parallel import owned_grads
from test_model_contract import token_batches

SEED, VOCAB, SEQ, MICRO_BATCH = 1234, 128, 16, 2
RTOL = 1e-5
LLAMA = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, activation="swiglu",
                    position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False)  # fmt: skip
MODELS = {
    "llama": LLAMA,
    "llama_recompute": dataclasses.replace(LLAMA, recompute_granularity="full", recompute_num_layers=1),
    "deepseek": dataclasses.replace(build_config(overrides=["--model.preset", "tiny-deepseek"]).model, vocab_size=VOCAB,
                                    attention_backend="math", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
}  # fmt: skip
CASES = {
    # name: (model, mesh sizes, schedule, virtual stages, micro batches per dp rank, distributed optimizer)
    "pp4_1f1b_one_micro_batch": ("llama", dict(pp=4), "1f1b", 1, 1, False),
    "pp4_1f1b_one_micro_batch_full_recompute": ("llama_recompute", dict(pp=4), "1f1b", 1, 1, False),
    "pp4_1f1b_two_micro_batches": ("llama", dict(pp=4), "1f1b", 1, 2, False),
    "pp2_dp2_zbv_one_micro_batch": ("llama", dict(pp=2, dp=2), "zbv", 2, 1, False),
    "pp2_dp2_interleaved_two_micro_batches": ("llama", dict(pp=2, dp=2), "interleaved", 2, 2, False),
    "deepseek_pp2_dp2_one_micro_batch": ("deepseek", dict(pp=2, dp=2), "1f1b", 1, 1, True),
    "deepseek_pp2_dp2_two_micro_batches": ("deepseek", dict(pp=2, dp=2), "1f1b", 1, 2, True),
}


def _model(name: str):
    torch.manual_seed(SEED)
    return build_model(MODELS[name], VOCAB, SEQ)


def _batches(case: str) -> list[dict[str, torch.Tensor]]:
    """The global batch's micro batches; dp rank d takes d, d + dp, ..."""
    _, sizes, _, _, per_rank, _ = CASES[case]
    return token_batches(VOCAB, SEQ, MICRO_BATCH, per_rank * sizes.get("dp", 1))


@functools.lru_cache
def _reference(case: str) -> dict:
    """One process: loss sum / tokens of the whole batch, plus each auxiliary term / micro batches."""
    model, batches = _model(CASES[case][0]), _batches(case)
    count = sum(b["loss_mask"].sum() for b in batches)
    total, aux_sum = torch.zeros(()), {}
    for b in batches:
        out, aux = model.run_stage(None, b, list(model.layers), True, True)
        loss_sum = model.loss(b, out).total
        (loss_sum / count + sum(aux.values(), torch.zeros(())) / len(batches)).backward()
        total += loss_sum.detach()
        for name, value in aux.items():
            aux_sum[name] = aux_sum.get(name, 0.0) + value.item() / len(batches)
    return {"loss": (total / count).item(), "aux": aux_sum, "grads": {n: p.grad for n, p in model.named_parameters()}}


def _run_case(rank: int, case: str) -> dict:
    model_name, sizes, schedule, virtual, per_rank, distributed = CASES[case]
    mesh = Mesh(**sizes, rank=rank)
    mesh.init_process_groups()
    parallel = ParallelConfig(pipeline_parallel=mesh.pp, virtual_pipeline_parallel=virtual, pipeline_schedule=schedule,
                              use_distributed_optimizer=distributed)  # fmt: skip
    train = TrainConfig(micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH * per_rank * mesh.dp)
    mine = _batches(case)[mesh.dp_rank :: mesh.dp]
    with recorded_p2p() as calls:
        runner = runner_for(_model(model_name), mesh, parallel, train, torch.float32)
        runner.optimizer.zero_grad()
        loss = runner.forward_backward(mine)
        runner.finalize_grads()
    return {"loss": (loss.total / loss.count).item(), "aux": {k: v.item() for k, v in loss.aux.items()},
            "grads": owned_grads(runner.optimizer), "p2p_calls": calls, "micro_batches": len(mine)}  # fmt: skip


def _worker(rank: int, world_size: int) -> dict:
    return {case: _run_case(rank, case) for case in CASES}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_worker, 4, timeout=300)




@pytest.mark.parametrize("case", list(CASES))
def test_matches_one_process(runs, case):
    ref, results = _reference(case), [run[case] for run in runs]
    model, sizes, schedule, _, per_rank, distributed = CASES[case]
    covered: dict[str, int] = {}
    for rank, r in enumerate(results):
        assert r["micro_batches"] == per_rank
        assert abs(r["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), f"rank {rank} loss {r['loss']} vs {ref['loss']}"
        assert r["aux"].keys() == ref["aux"].keys()
        for name, value in r["aux"].items():
            assert abs(value - ref["aux"][name]) <= RTOL * abs(ref["aux"][name]), f"rank {rank} {name}"
        for name, (lo, hi, grad) in r["grads"].items():
            want = ref["grads"][name].reshape(-1)
            assert (grad - want[lo:hi]).norm() <= RTOL * want.norm(), f"rank {rank} grad of {name} [{lo}, {hi})"
            covered[name] = covered.get(name, 0) + hi - lo
    assert covered.keys() == ref["grads"].keys()
    # Every element reduced on each dp rank (on one, sharded) of each stage holding it: both ends
    # of a tied embedding hold it, unless one rank holds both (zbv's rank 0).
    replicas = 1 if distributed else sizes.get("dp", 1)
    tied = MODELS[model].tie_embeddings and schedule != "zbv"
    for name, elements in covered.items():
        assert elements == ref["grads"][name].numel() * replicas * (2 if tied and name == "embedding.weight" else 1), name
    assert bool(ref["aux"]) == (case.startswith("deepseek"))


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_ranks_first_connect_in_mirrored_calls(runs, case):
    calls = [run[case]["p2p_calls"] for run in runs]
    assert all(calls), "every rank of a pipeline sends or receives"
    assert mismatched_first_contacts(calls) == []
