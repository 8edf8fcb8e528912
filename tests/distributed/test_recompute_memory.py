"""Memory under activation recompute as ``meshtron estimate`` counts it, in live tensor bytes on the
CPU (``live_bytes.LiveBytes``), DeepSeek's shape (MLA, a dense block, then MoE blocks) in bf16:

- one process: after a recomputed step (full, and ``--moe-layer-recompute``) nothing the step made
  is left but the layers' expert counts; under full recompute two more MoE blocks raise the peak
  by their kept inputs, what the estimate adds. A MoE layer that kept its checkpoint rerun's
  auxiliary losses kept the rerun's graph back to the block's input, with the router's, norms' and
  attention's activations (``models/recompute.py``): both fail then;
- two gloo ranks through the training runner (ep2, and etp2; distributed optimizer, full
  recompute): after ``forward_backward`` nothing the step made is left on either rank.
"""

from __future__ import annotations

import pytest
import torch

from launcher import run_distributed
from live_bytes import LiveBytes
from meshtron.config import build_config
from meshtron.estimate import activation_bytes
from meshtron.layers.moe import MoELayer
from meshtron.models import build_model
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.setup import build_runner

VOCAB, SEQ = 96, 64


def _config(layers: int, *flags: str):
    return build_config(overrides=["--preset", "tiny-deepseek", "--bf16", "--num-layers", str(layers), "--micro-batch-size", "2",
                                   "--vocab-size", str(VOCAB), "--device", "cpu", *flags])  # fmt: skip


def _left_bound(cfg) -> int:
    """What a step may leave: each MoE layer's expert counts [E] int64 and its loss scalars."""
    return cfg.model.num_layers * (8 * cfg.model.num_experts + 64)


def _step_bytes(layers: int, *flags: str):
    """(peak, left after backward, config) of one forward and backward on one process. Each
    weight's gradient is dropped once made, as the gradient buffer takes it in training, so the
    bytes are the activations'."""
    cfg = _config(layers, *flags)
    torch.manual_seed(0)
    model = build_model(cfg.model, VOCAB, SEQ).to(torch.bfloat16)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    tokens, labels = torch.randint(0, VOCAB, (2, SEQ)), torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        model(tokens)  # the model's cached RoPE tables are made here, not in the step
    with LiveBytes() as live:
        loss = model(tokens, labels=labels).sum() + sum(sum(m.last_aux_losses.values()) for m in model.modules() if isinstance(m, MoELayer))
        loss.backward()
        del loss
    return live.peak, live.live, cfg


@pytest.mark.parametrize("flags", [["--recompute-granularity", "full"], ["--moe-layer-recompute"]])
def test_nothing_outlives_a_recomputed_step(flags):
    _, left, cfg = _step_bytes(5, *flags)
    assert left <= _left_bound(cfg), left


def test_full_recompute_costs_each_more_block_its_input():
    peak3, _, cfg3 = _step_bytes(3, "--recompute-granularity", "full")
    peak5, _, cfg5 = _step_bytes(5, "--recompute-granularity", "full")
    estimated = activation_bytes(cfg5) - activation_bytes(cfg3)
    assert estimated == 2 * 2 * SEQ * cfg3.model.hidden_size * 2  # two blocks' bf16 inputs
    assert peak5 - peak3 == pytest.approx(estimated, rel=0.1), (peak5 - peak3, estimated)


LAYOUTS = {"ep2": ["--ep", "2"], "etp2": ["--expert-tensor-parallel-size", "2"]}


def _runner_worker(rank: int, world_size: int) -> dict:
    out = {}
    for name, flags in LAYOUTS.items():
        cfg = _config(4, *flags, "--use-distributed-optimizer", "--recompute-granularity", "full", "--global-batch-size", "4")
        mesh = Mesh.from_config(cfg.parallel, world_size=world_size, rank=rank, local_rank=0)
        mesh.init_process_groups()
        runner = build_runner(cfg, mesh, VOCAB, torch.device("cpu"), torch.bfloat16)
        g = torch.Generator().manual_seed(7)
        batches = [{"tokens": torch.randint(0, VOCAB, (2, SEQ), generator=g), "labels": torch.randint(0, VOCAB, (2, SEQ), generator=g),
                    "loss_mask": torch.ones(2, SEQ)} for _ in range(2)]  # fmt: skip
        mine = batches[mesh.dp_rank :: mesh.dp]
        runner.forward_backward(mine)  # the first step makes the buffers and caches a run keeps
        runner.optimizer.zero_grad()
        with LiveBytes() as live:
            runner.forward_backward(mine)
        out[name] = {"peak": live.peak, "left": live.live, "bound": _left_bound(cfg)}
    return out


def test_nothing_outlives_a_recomputed_step_of_the_runner_under_ep_and_etp():
    for rank, result in enumerate(run_distributed(_runner_worker, 2)):
        for name, got in result.items():
            assert got["left"] <= got["bound"], (name, rank, got)
