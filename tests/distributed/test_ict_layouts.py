"""The ICT retriever on the model contract: under dp2 its in-batch negatives span both ranks'
micro batches, so the loss, the top-k accuracies and every gradient equal one process's on the
concatenated micro batches (fp32 on the CPU, 1e-5 relative as a norm over each tensor), through
the same runner as training; with FSDP2 too. Under tp2 (the towers' BERT plan) they equal one
process's too, and under tp2 with sequence parallelism (each tower's final norm on the sequence
shard, [CLS] fetched from the tp rank holding token 0).

Two variants: separate towers with a projection and scaled scores, and one shared tower without
a projection. And ``--bert-load`` under tp2: each rank's shards of both towers are a BERT
checkpoint's tensors. Each step has two micro batches per rank, so the negatives are those of one micro
batch across dp (Megatron's), not of the whole step. Batches have padding on both sides.
"""

from __future__ import annotations

import functools

import pytest
import torch

from launcher import by_name, run_distributed
from meshtron.checkpoint.checkpoint import save_checkpoint
from meshtron.checkpoint.pretrained import load_pretrained_encoders
from meshtron.config import ModelConfig, ParallelConfig, TrainConfig
from meshtron.models import build_model
from meshtron.models.ict import retrieval_scores
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import gather_full
from meshtron.parallel.setup import runner_for
from test_model_contract import RTOL, _check

SEED, VOCAB, SEQ, DP, MICRO_BATCH, MICRO_BATCHES = 1234, 128, 12, 2, 3, 2
ICT = ModelConfig(model_type="ict", num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2,
                  biencoder_projection_dim=16, retriever_score_scaling=True, retriever_report_topk_accuracies=[1, 2])  # fmt: skip
VARIANTS = {
    "separate": ICT,
    "shared": ModelConfig(**{**ICT.__dict__, "biencoder_shared_query_context_model": True, "biencoder_projection_dim": 0,
                             "retriever_score_scaling": False}),  # fmt: skip
}
LAYOUTS = {"dp2": dict(dp=2), "tp2": dict(tp=2), "tp2_sp": dict(tp=2, sp=True), "dp2_fsdp": dict(dp=2, fsdp=True)}
# A vector added to every context adds the same score to a query's every candidate, which the
# softmax ignores: the context tower's last bias terms have a zero gradient, so their computed
# values are rounding noise to be checked as ~0, not compared. (A wide init keeps the scores far
# from uniform: near it, every bias gradient nearly cancels and the comparison measures rounding.)
SHIFT_INVARIANT = {"towers.context.final_norm.bias", "projections.context.bias"}


def _model(variant: str):
    torch.manual_seed(SEED)
    return build_model(VARIANTS[variant], VOCAB, SEQ)


def _global_micro_batches() -> list[dict[str, torch.Tensor]]:
    """The step's micro batches as one process sees them: ``DP * MICRO_BATCH`` samples each, as
    ``data/ict_dataset.py`` yields them (padded from a random length on)."""
    g = torch.Generator().manual_seed(7)
    rows = DP * MICRO_BATCH
    out = []
    for _ in range(MICRO_BATCHES):
        batch = {}
        for side in ("query", "context"):
            lengths = torch.randint(3, SEQ + 1, (rows, 1), generator=g)
            batch[f"{side}_tokens"] = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
            batch[f"{side}_padding_mask"] = torch.arange(SEQ)[None, :] < lengths
        out.append(batch)
    return out


def _rank_micro_batches(dp_rank: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's slice of every micro batch (the sampler's consecutive slices)."""
    rows = DP * MICRO_BATCH // dp
    return [{k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in b.items()} for b in _global_micro_batches()]


@functools.lru_cache
def _reference(variant: str) -> dict:
    """One process on the concatenated micro batches: the loss summed over queries / queries of
    the step, each metric's mean over micro batches. Also the loss with each rank's negatives only,
    which a gather that did not span the ranks would give (it must differ, or the test is moot)."""
    model, batches = _model(variant), _global_micro_batches()
    count = sum(len(b["query_tokens"]) for b in batches)
    total, metrics, local_only = torch.zeros(()), {}, 0.0
    for b in batches:
        out, _ = model.run_stage(None, b, list(model.blocks()), True, True)
        loss = model.loss(b, out)
        (loss.total / count).backward()
        total += loss.total.detach()
        for name, value in loss.metrics.items():
            metrics[name] = metrics.get(name, 0.0) + value.item() / MICRO_BATCHES
        for r in range(DP):
            rows = slice(r * MICRO_BATCH, (r + 1) * MICRO_BATCH)
            scores = retrieval_scores(out["query"][rows], out["context"][rows], model.cfg)
            local_only += torch.nn.functional.cross_entropy(scores, torch.arange(MICRO_BATCH), reduction="sum").item() / count
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"loss": (total / count).item(), "aux": {}, "metrics": metrics, "grads": grads, "local_only": local_only}


def _bert():
    torch.manual_seed(SEED + 1)
    return build_model(ModelConfig(**{**ICT.__dict__, "model_type": "bert"}), VOCAB, SEQ)


def _worker(rank: int, world_size: int, bert_dir: str) -> dict:
    out = {}
    for name, layout in LAYOUTS.items():
        sizes = {k: v for k, v in layout.items() if k in ("dp", "tp")}
        mesh = Mesh(**sizes, rank=rank)
        mesh.init_process_groups()
        for variant in VARIANTS:
            parallel = ParallelConfig(tensor_parallel=mesh.tp, sequence_parallel=layout.get("sp", False), fsdp=layout.get("fsdp", False))
            runner = runner_for(_model(variant), mesh, parallel, TrainConfig(), torch.float32)
            runner.optimizer.zero_grad()
            loss = runner.forward_backward(_rank_micro_batches(mesh.dp_rank, mesh.dp))
            runner.finalize_grads()
            if parallel.fsdp:  # the sharded parameters' gradients, gathered
                grads = {n: p.grad.full_tensor() for n, p in runner.model.named_parameters()}
            else:
                grads = {n: gather_full(p.main_grad.clone(), runner.metas[n], mesh) for n, p in runner.model.named_parameters()}
            out[f"{variant}/{name}"] = {"loss": (loss.total / loss.count).item(), "aux": {k: v.item() for k, v in loss.aux.items()},
                                        "metrics": {k: v.item() for k, v in loss.metrics.items()}, "grads": grads}  # fmt: skip
    # --bert-load under tp2: each rank reads its shards of BERT's tensors into both towers.
    mesh = Mesh(tp=2, rank=rank)
    mesh.init_process_groups()
    runner = runner_for(_model("separate"), mesh, ParallelConfig(tensor_parallel=2), TrainConfig(), torch.float32)
    load_pretrained_encoders(bert_dir, runner.model, runner.optimizer, mesh, runner.metas, lambda _: None)
    out["bert_load_tp2"] = {n: gather_full(p.detach().clone(), runner.metas[n], mesh) for n, p in runner.model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    bert_dir = tmp_path_factory.mktemp("bert")
    save_checkpoint(bert_dir, 1, _bert(), None, {"config": {}, "vocab_size": VOCAB, "tokenizer": {}}, save_optim=False)
    return by_name(run_distributed(_worker, 2, str(bert_dir)))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ict_matches_one_process_on_the_global_batch(runs, variant, layout):
    ref = _reference(variant)
    assert abs(ref["local_only"] - ref["loss"]) > 100 * RTOL * ref["loss"], "negatives from the other rank do not change the loss"
    towers = {n.split(".")[1] for n in ref["grads"]}
    assert towers == ({"shared"} if variant == "shared" else {"query", "context"})
    results = runs[f"{variant}/{layout}"]
    scale = max(g.norm() for g in ref["grads"].values())
    for name in SHIFT_INVARIANT & ref["grads"].keys():
        assert all(grads[name].norm() <= 1e-5 * scale for grads in [ref["grads"], *(r["grads"] for r in results)]), name
    ref = {**ref, "grads": {n: g for n, g in ref["grads"].items() if n not in SHIFT_INVARIANT}}
    results = [{**r, "grads": {n: g for n, g in r["grads"].items() if n not in SHIFT_INVARIANT}} for r in results]
    _check(results, ref, f"ict {variant} {layout}")
    for rank, result in enumerate(results):
        assert result["metrics"].keys() == {"top1_acc", "top2_acc"}
        for metric, value in ref["metrics"].items():
            assert abs(result["metrics"][metric] - value) <= 1e-6, f"{layout} rank {rank}: {metric} {result['metrics'][metric]} != {value}"


def test_bert_load_fills_both_towers_under_tp2(runs):
    bert, initial = _bert().state_dict(), dict(_model("separate").named_parameters())
    for rank, params in enumerate(runs["bert_load_tp2"]):
        for name, tensor in params.items():
            expected = bert[name.split(".", 2)[2]] if name.startswith("towers.") else initial[name]  # projections keep their init
            torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=f"rank {rank}: {name}")
