"""FP8 weight copies kept for a step (``kernels/step_cache.py``) under tensor parallelism: a tiny
Llama through ``build_runner`` at tp2 + sp (two gloo processes), two Adam steps of three micro
batches each, against the one-process model casting its weights anew for every micro batch.

Each tp rank must cast each of its sharded FP8 weights once a step (the cache keys on the shard's
own parameter), where the reference casts once per micro batch. Delayed scaling with histories
seeded above every amax the run meets (kept for the whole run: ``max`` of 8 entries) scales every
shard as its full tensor and every micro batch alike, so a copy cast once a step equals one cast
per micro batch and only fp32's summation order differs: per-step losses, full gradients and full
weights after each step agree to 2e-5 relative (measured on the CPU: the FP8 linears' gradients
within 4e-7, the embedding's 5e-6, the output weight after Adam 4e-6). A copy kept past its step
(made from the weights before the update) moves the second step's loss by 4e-4 and gradients by up
to 0.35; with the cache off each shard is cast once per micro batch: both fail here.
"""

from __future__ import annotations

import pytest
import torch

from launcher import run_distributed
from meshtron.config import build_config
from meshtron.kernels import step_cache
from meshtron.parallel import setup
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import gather_full
from tests.unit.test_fp8_weight_cache import _count_weight_casts

VOCAB, SEQ, MICRO, STEPS, LR, TOL = 128, 32, 3, 2, 1e-3, 2e-5
SEEDED_HISTORY = torch.tensor([16.0, 1.0, 0.05])  # input, weight, grad: above every amax of the run (asserted)
FLAGS = ["--model.preset", "tiny-llama", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
         "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "1", "--seq-length", str(SEQ),
         "--micro-batch-size", "2", "--global-batch-size", str(2 * MICRO), "--fp8-format", "hybrid",
         "--fp8-backend", "meshtron", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "8",
         "--fp8-amax-compute-algo", "max"]  # fmt: skip


def _batches(step: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [{"tokens": torch.randint(0, VOCAB, (2, SEQ), generator=g), "labels": torch.randint(0, VOCAB, (2, SEQ), generator=g),
             "loss_mask": torch.rand(2, SEQ, generator=g)} for _ in range(MICRO)]  # fmt: skip


def _train(tp: int) -> dict:
    """Two steps on this rank's part of the model: per step the mean loss, the full gradients and
    the full weights after the update; each FP8 linear's weight casts and its largest history entries."""
    cfg = build_config(overrides=[*FLAGS, "--tp", str(tp), *(["--sequence-parallel"] if tp > 1 else [])])
    mesh = Mesh.from_config(cfg.parallel) if tp > 1 else Mesh.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0)
    if tp > 1:
        mesh.init_process_groups()
    runner = setup.build_runner(cfg, mesh, VOCAB, torch.device("cpu"), torch.float32)
    linears = {n: m for n, m in runner.model.named_modules() if getattr(m, "fp8", None) is not None}  # the blocks' FP8 linears
    for m in linears.values():
        m.fp8.amax_history[:, 0] = SEEDED_HISTORY
        m.fp8.seeded = True
    casts = {n: _count_weight_casts(m.fp8) for n, m in linears.items()}
    out = {"loss": [], "grads": [], "weights": []}
    full = lambda t, n: gather_full(t.detach().clone(), runner.metas[n], mesh)  # noqa: E731
    for step in range(STEPS):
        runner.optimizer.zero_grad()
        loss = runner.forward_backward(_batches(step))
        runner.finalize_grads()
        out["loss"].append(loss.total / loss.count)
        out["grads"].append({n: full(runner.optimizer.grads.grad_of(p), n) for n, p in runner.model.named_parameters()})
        runner.optimizer.step(LR)
        out["weights"].append({n: full(p, n) for n, p in runner.model.named_parameters()})
    out["casts"] = {n: [transposed for transposed, _ in c] for n, c in casts.items()}
    out["history_max"] = {n: m.fp8.amax_history.max(dim=1).values for n, m in linears.items()}
    return out


def _worker(rank: int, world_size: int) -> dict:
    setup.check_fp8_device = lambda device: None  # the CPU's _scaled_mm stands in for the GPU's
    return _train(world_size)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(_worker, 2)


def test_tp2_casts_each_weight_shard_once_a_step_and_matches_one_process_casting_per_micro_batch(tp_results, monkeypatch):
    monkeypatch.setattr(setup, "check_fp8_device", lambda device: None)
    monkeypatch.setattr(step_cache, "keeps", lambda param: False)  # the reference casts every micro batch
    want = _train(1)
    assert len(want["casts"]) == 2 * 4 and all(len(c) == STEPS * MICRO for c in want["casts"].values()), want["casts"]
    for rank, got in enumerate(tp_results):
        assert got["casts"].keys() == want["casts"].keys()
        for n, casts in got["casts"].items():
            assert casts == [True] * STEPS, f"rank {rank}: {n}'s weight shard cast {len(casts)} times in {STEPS} steps"
        for n, history_max in (*got["history_max"].items(), *want["history_max"].items()):
            assert torch.equal(history_max, SEEDED_HISTORY), f"{n}: an amax above its seed ({history_max}) scales shards apart"
        for step in range(STEPS):
            assert _rel(got["loss"][step], want["loss"][step]) < TOL, f"rank {rank} step {step}: loss differs"
            for key in ("grads", "weights"):
                for n, w in want[key][step].items():
                    assert w.norm() > 0, f"{n}: a zero reference {key} proves nothing"
                    err = _rel(got[key][step][n], w)
                    assert err < TOL, f"rank {rank} step {step}: {key} of {n} differ by {err:.2e} (relative)"
