"""Blockwise FP8 linears under tensor parallelism (tp2, with and without sequence parallelism, two
gloo processes) against the one-process blockwise model: per-token losses and full gradients.

The model's widths put every shard boundary on the 128 grid (head dim 128, one kv group per rank,
the SwiGLU halves and the row-parallel inputs split at multiples of 128), so each rank's 1 x 128
blocks and 128 x 128 tiles are blocks and tiles of the full tensors and every scale is the one the
unsharded model uses. What differs is only fp32's summation order (the row-parallel partial sums),
so they agree to fp32's 1e-5 as the bf16 path does (8e-7 measured; a value moved across an FP8
rounding boundary would show as ~1e-4); the model without FP8 is 3e-3 away, so FP8 ran on both sides.
"""

from __future__ import annotations

import pytest
import torch

from launcher import run_distributed
from meshtron.config import ModelConfig, ParallelConfig, TrainConfig
from meshtron.kernels.fp8 import Fp8Linear, apply_fp8
from meshtron.kernels.fp8_scaling import Fp8Recipe
from meshtron.models import build_model
from meshtron.optim.build import build_optimizer
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import finalize_tensor_parallel_grads, gather_full, parallelize

SEED, VOCAB, SEQ, BATCH = 1234, 256, 64, 2  # 128 tokens: one block along the tokens
CONFIG = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=256,
                     normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                     add_bias_linear=False, tie_embeddings=False)  # fmt: skip
RECIPE = Fp8Recipe("e4m3", "blockwise")
TOL = 1e-5


def _model(fp8: bool):
    torch.manual_seed(SEED)
    model = build_model(CONFIG, VOCAB, SEQ)
    if fp8:
        apply_fp8(model.layers, RECIPE, "meshtron")
    return model


def _run(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    tokens, labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    weights = torch.rand(BATCH, SEQ, generator=g)
    losses = model(tokens, labels=labels)
    (losses * weights).sum().backward()
    return losses.detach()


def _worker(rank: int, world_size: int) -> dict[str, dict]:
    mesh = Mesh.from_config(ParallelConfig(tensor_parallel=world_size))
    mesh.init_process_groups()
    out = {}
    for sp in (False, True):
        model = _model(fp8=False)
        metas = parallelize(model, mesh, sequence_parallel=sp)
        build_optimizer(model, TrainConfig(clip_grad=0.0), torch.float32, metas=metas, tp_group=mesh.tp_group)
        apply_fp8(model.layers, RECIPE, "meshtron")
        parallel = [m for m in model.modules() if hasattr(m, "comm_overlap")]
        assert parallel and all(m.fp8 is not None for m in parallel), "a parallel linear stayed bf16"
        losses = _run(model)
        grads = {n: p.main_grad for n, p in model.named_parameters()}
        finalize_tensor_parallel_grads(grads, metas, mesh)
        out["sp" if sp else "tp"] = {"losses": losses, "grads": {n: gather_full(g.clone(), metas[n], mesh) for n, g in grads.items()}}
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2)


@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_blockwise_tp2_matches_one_process_blockwise(results, layout):
    model = _model(fp8=True)
    assert sum(type(m) is Fp8Linear for m in model.modules()) == 8  # every block linear took the recipe
    want_losses = _run(model)
    want = {n: p.grad for n, p in model.named_parameters()}
    plain_model = _model(fp8=False)
    plain_losses = _run(plain_model)
    assert _rel(plain_losses, want_losses) > 10 * _rel(results[0][layout]["losses"], want_losses)
    for rank, result in enumerate(results):
        got = result[layout]
        assert _rel(got["losses"], want_losses) < TOL, f"rank {rank}: per-token losses differ"
        for n, g in want.items():
            assert g.norm() > 0, f"{n}: reference gradient is zero, the comparison would prove nothing"
            err = _rel(got["grads"][n], g)
            assert err < TOL, f"rank {rank}: gradient of {n} differs by {err:.2e} (relative)"
