"""The model contract, proven by families meshtron has never heard of.

``tests/families/parallel_block`` (a decoder with parallel attention/MLP blocks and a per-layer
auxiliary loss) and ``tests/families/token_shift`` (attention-free blocks mixing each token with the
one before it, the embedding tied to the output layer) are each a folder and one registration,
built here from ``--model-type package.module:name`` like any family. Through the same runner as
training, under tp2, pp2, dp2 (world 2) and tp2 x pp2 (world 4), their step loss, auxiliary terms
and every gradient equal one process's (fp32 on the CPU, 1e-5 relative as a norm over each
tensor). The parallel block's auxiliary terms arise on both pipeline stages and enter the
objective there; the token shift's tied table lives on both and its two gradients meet.

The stock decoder with mixture-of-experts MLPs (4 experts, top-2, load-balancing and z-loss)
passes the same layouts: its balancing losses are auxiliary terms of the contract, equal to one
process's whatever the pipeline split (a per-layer term arises on the stage holding the layer).

The same spawn checks that full activation recompute holds under pp2: each block of the stock
decoder runs twice per micro batch (forward, then again in backward), with the gradients of a
plain one-process run; and that the token-shift family, named by ``--model-type`` alone, trains
through the Trainer under tp2 x pp2, saves, reshards into one process with the weights it trained,
and that ``meshtron estimate`` gives each first-stage rank the parameters it built.
"""

from __future__ import annotations

import functools

import pytest
import torch

from full_weights import full_weights
from launcher import by_name, run_distributed
from meshtron.checkpoint.checkpoint import load_checkpoint, read_meta
from meshtron.checkpoint.reshard import reshard
from meshtron.config import ModelConfig, ParallelConfig, TrainConfig, build_config
from meshtron.estimate import stage_parameters
from meshtron.models import build_model
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import gather_full
from meshtron.parallel.setup import runner_for
from meshtron.training.trainer import Trainer

SEED, VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES = 1234, 128, 16, 2, 4
RTOL = 1e-5
CFG = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, activation="swiglu",
                  position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False)  # fmt: skip
RECOMPUTE = ModelConfig(**{**CFG.__dict__, "recompute_granularity": "full", "recompute_num_layers": 1})
PARALLEL_BLOCK = ModelConfig(**{**CFG.__dict__, "model_type": "tests.families.parallel_block:parallel_block"})
TOKEN_SHIFT = ModelConfig(**{**CFG.__dict__, "model_type": "tests.families.token_shift:token_shift"})
MOE = ModelConfig(**{**CFG.__dict__, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48,
                     "moe_aux_loss_coeff": 1e-2, "moe_z_loss_coeff": 1e-3, "moe_layer_freq": "([0]+[1]*3)"})
LAYOUTS = {2: {"tp2": dict(tp=2), "pp2": dict(pp=2), "dp2": dict(dp=2)}, 4: {"tp2_pp2": dict(tp=2, pp=2)}}
TRAIN_TOKEN_SHIFT = ["--model-type", TOKEN_SHIFT.model_type, "--mock-data", "--vocab-size", "100", "--num-layers", "4", "--hidden-size", "64",
                     "--num-attention-heads", "4", "--swiglu", "--seq-length", str(SEQ), "--micro-batch-size", "2",
                     "--global-batch-size", "8", "--train-iters", "3", "--fp32", "--device", "cpu", "--eval-interval", "0",
                     "--log-interval", "100", "--tp", "2", "--pp", "2", "--use-distributed-optimizer"]  # fmt: skip


def _build(cfg: ModelConfig):
    torch.manual_seed(SEED)
    return build_model(cfg, VOCAB, SEQ)


FAMILIES = {"parallel_block": PARALLEL_BLOCK, "token_shift": TOKEN_SHIFT, "moe_decoder": MOE, "decoder": CFG}
EQUIVALENT = ("parallel_block", "token_shift", "moe_decoder")  # run under every layout


def token_batches(vocab: int, seq: int, micro_batch: int, micro_batches: int) -> list[dict[str, torch.Tensor]]:
    """Random language-model micro batches (tokens, labels, ~80 % loss mask), the same in every process."""
    g = torch.Generator().manual_seed(7)
    return [{"tokens": torch.randint(0, vocab, (micro_batch, seq), generator=g),
             "labels": torch.randint(0, vocab, (micro_batch, seq), generator=g),
             "loss_mask": (torch.rand(micro_batch, seq, generator=g) < 0.8).float()}
            for _ in range(micro_batches)]  # fmt: skip


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    return token_batches(VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES)


@functools.lru_cache
def _reference(family: str) -> dict:
    return one_process_reference(_build(FAMILIES[family]))


def one_process_reference(model) -> dict:
    """One process, the model's own ``run_stage`` on every micro batch: loss sum / tokens of the
    whole batch, plus each auxiliary term / number of micro batches."""
    batches = _micro_batches()
    count = sum(b["loss_mask"].sum() for b in batches)
    total, aux_sum = torch.zeros(()), {}
    for b in batches:
        out, aux = model.run_stage(None, b, list(model.layers), True, True)
        loss_sum = model.loss(b, out).total
        objective = loss_sum / count + sum(aux.values(), torch.zeros(())) / MICRO_BATCHES
        objective.backward()
        total += loss_sum.detach()
        for name, value in aux.items():
            aux_sum[name] = aux_sum.get(name, 0.0) + value.item() / MICRO_BATCHES
    return {"loss": (total / count).item(), "aux": aux_sum, "grads": {n: p.grad for n, p in model.named_parameters()}}


def _train_step(model, mesh: Mesh, parallel: ParallelConfig) -> tuple[object, dict]:
    runner = runner_for(model, mesh, parallel, TrainConfig(), torch.float32)
    batches = _micro_batches()
    mine = [batches[i] for i in range(MICRO_BATCHES)[mesh.dp_rank :: mesh.dp]]
    runner.optimizer.zero_grad()
    loss = runner.forward_backward(mine)
    runner.finalize_grads()
    grads = {n: gather_full(p.main_grad.clone(), runner.metas[n], mesh) for n, p in runner.model.named_parameters()}
    out = {"loss": (loss.total / loss.count).item(), "aux": {k: v.item() for k, v in loss.aux.items()}, "grads": grads}
    return runner, out


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    out = {}
    for name, sizes in LAYOUTS[world_size].items():
        mesh = Mesh(**sizes, rank=rank)
        mesh.init_process_groups()
        parallel = ParallelConfig(tensor_parallel=mesh.tp, pipeline_parallel=mesh.pp)
        for family in EQUIVALENT:
            out[f"{family}/{name}"] = _train_step(_build(FAMILIES[family]), mesh, parallel)[1]
    if world_size == 4:  # the stock decoder with full recompute, pp2 x dp2: count block calls
        mesh = Mesh(pp=2, dp=2, rank=rank)
        mesh.init_process_groups()
        model, calls = _build(RECOMPUTE), [0]
        for block in model.layers:  # counted in forward itself: hooks do not fire when a checkpoint reruns
            block.forward = _counting(block.forward, calls)
        runner, result = _train_step(model, mesh, ParallelConfig(pipeline_parallel=2))
        local_blocks = sum(len(stage.blocks) for stage in runner.stages)
        result["calls"], result["expected_calls"] = calls[0], 2 * local_blocks * MICRO_BATCHES // mesh.dp
        out["decoder_pp2_dp2_recompute"] = result
        trainer = Trainer(build_config(None, [*TRAIN_TOKEN_SHIFT, "--save", f"{tmp}/token_shift"]), log=lambda _: None)
        trainer.run()
        out["token_shift_trainer"] = {"weights": full_weights(trainer.model, trainer.runner.metas, trainer.mesh),
                                      "params": sum(p.numel() for p in trainer.model.parameters()), "first_stage": trainer.mesh.pp_rank == 0}
    return out


def _counting(forward, calls: list[int]):
    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    return counted


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("model_contract")


@pytest.fixture(scope="module")
def runs(checkpoints) -> dict[str, list[dict]]:
    return by_name([rank_result for world in LAYOUTS for rank_result in run_distributed(_worker, world, str(checkpoints))])


def _assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert expected.norm() > 0, f"{what}: the reference is zero, the comparison would prove nothing"
    err = (actual - expected).norm() / expected.norm()
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL:.0e}"


def _check(results: list[dict], ref: dict, name: str) -> None:
    holders: set[str] = set()
    for rank, r in enumerate(results):
        assert abs(r["loss"] - ref["loss"]) <= RTOL * ref["loss"], f"{name} rank {rank}: loss {r['loss']} != {ref['loss']}"
        assert r["aux"].keys() == ref["aux"].keys(), f"{name} rank {rank}: auxiliary terms {sorted(r['aux'])}"
        for term, value in ref["aux"].items():
            assert abs(r["aux"][term] - value) <= RTOL * value, f"{name} rank {rank}: {term} {r['aux'][term]} != {value}"
        for pname, grad in r["grads"].items():
            _assert_rel_close(grad, ref["grads"][pname], f"{name} rank {rank} grad of {pname}")
            holders.add(pname)
    assert holders == ref["grads"].keys(), f"{name}: parameters no rank holds: {sorted(ref['grads'].keys() - holders)}"


@pytest.mark.parametrize("name", [n for layouts in LAYOUTS.values() for n in layouts])
def test_new_family_matches_one_process(runs, name):
    ref = _reference("parallel_block")
    assert len(ref["aux"]) == CFG.num_layers
    _check(runs[f"parallel_block/{name}"], ref, name)


@pytest.mark.parametrize("name", [n for layouts in LAYOUTS.values() for n in layouts])
def test_token_shift_family_matches_one_process(runs, name):
    ref = _reference("token_shift")
    assert ref["aux"] == {}
    _check(runs[f"token_shift/{name}"], ref, f"token_shift {name}")


@pytest.mark.parametrize("name", [n for layouts in LAYOUTS.values() for n in layouts])
def test_mixture_of_experts_matches_one_process(runs, name):
    ref = _reference("moe_decoder")
    assert sorted(ref["aux"]) == [f"{kind}/{layer}" for kind in ("load_balancing", "z_loss") for layer in (1, 2, 3)]
    _check(runs[f"moe_decoder/{name}"], ref, f"moe {name}")


def test_full_recompute_runs_under_pipeline_parallelism(runs):
    results = runs["decoder_pp2_dp2_recompute"]
    for rank, r in enumerate(results):
        assert r["calls"] == r["expected_calls"] > 0, f"rank {rank}: {r['calls']} block calls, {r['expected_calls']} with recompute"
    _check(results, _reference("decoder"), "decoder pp2 recompute")


def test_token_shift_trains_saves_reshards_and_is_estimated_under_tp2_pp2(runs, checkpoints):
    results = runs["token_shift_trainer"]
    trained = results[0]["weights"]  # whole on every rank, the padded table's rows included
    saved = checkpoints / "token_shift"
    reshard(str(saved), str(checkpoints / "one_process"))
    model = build_model(build_config(None, TRAIN_TOKEN_SHIFT).model, read_meta(saved)["vocab_size"], SEQ)
    load_checkpoint(checkpoints / "one_process", model, load_rng=False)
    assert model.state_dict().keys() == trained.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name][: tensor.shape[0]]), name
    expected = stage_parameters(build_config(None, TRAIN_TOKEN_SHIFT), world_size=4).total
    assert [r["params"] for r in results if r["first_stage"]] == [expected, expected]
