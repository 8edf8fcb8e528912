"""FSDP2 (``apply_fsdp`` + ``FSDPOptimizer``) over dp=2 gloo processes equals the one-process run.

Same harness as ``test_data_parallel``: the global batch split over the ranks, 2 micro batches
each (the first under ``no_sync``), clipping active. fp32: losses, grad norms, every gradient
(gathered from the shards) after the first step and the params after 5 steps, to 1e-5 relative.
bf16 compute (``MixedPrecisionPolicy``, fp32 shards as masters) against the one-process bf16
run, to a bf16 tolerance. FSDP with tensor parallelism is refused.
"""

from __future__ import annotations

import pytest
import torch

from launcher import run_distributed
from meshtron.config import ConfigError
from meshtron.parallel.fsdp import apply_fsdp, build_fsdp_optimizer
from meshtron.parallel.mesh import Mesh
from test_data_parallel import DP, MICRO_BATCHES, STEPS, TRAIN, assert_matches_reference, dp_mesh, full, make_model, reference, train

BF16_RTOL = 3e-2  # two bf16 runs that round differently (each ~1.8e-2 from fp32 in the params)


def _gathered_grads(opt) -> dict[str, tuple[int, int, torch.Tensor]]:
    return {name: (0, p.numel(), full(p.grad).flatten().clone()) for group in opt.param_groups
            for name, p in zip(group["param_names"], group["params"])}  # fmt: skip


def _worker(rank: int, world_size: int) -> dict:
    mesh = dp_mesh(rank)
    out = {}
    for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = apply_fsdp(make_model(), mesh, param_dtype=dtype)
        opt = build_fsdp_optimizer(model, TRAIN, dtype)
        out[key] = train(model, opt, range(STEPS), rank, DP, MICRO_BATCHES, mesh.dp_group, grads_of=_gathered_grads)
    # FSDP's params are the fp32 masters; the one-process bf16 model holds their bf16 rounding.
    out["bf16"]["params"] = {k: v.bfloat16().float() for k, v in out["bf16"]["params"].items()}
    return out


def test_fsdp_matches_one_process():
    runs = run_distributed(_worker, DP)
    assert_matches_reference([r["fp32"] for r in runs], reference())
    assert_matches_reference([r["bf16"] for r in runs], reference(torch.bfloat16), rtol=BF16_RTOL)


def test_fsdp_refuses_tensor_parallel():
    with pytest.raises(ConfigError, match="tensor parallel"):
        apply_fsdp(make_model(), Mesh(tp=2, dp=1))
