"""``meshtron estimate``: parameter and optimizer bytes exact against a built model, activation
terms ordered as the layouts promise, and the command line (with ``--print-mesh``)."""

import dataclasses

import pytest
import torch

from meshtron.cli import main
from meshtron.config import build_config
from meshtron.estimate import (
    activation_bytes,
    activation_bytes_per_token_layer,
    estimate,
    first_rank_layers,
    stage_parameters,
)
from meshtron.models import build_model, num_parameters
from meshtron.optim.build import build_optimizer

B1 = ["--preset", "llama-1.24b-bench", "--micro-batch-size", "4", "--global-batch-size", "4", "--bf16"]


def _b1(*flags: str):
    """The B1 config with ``flags``, not validated against this process's world size."""
    return build_config(overrides=B1 + list(flags))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt"])
def test_parameters_and_optimizer_match_a_built_model(preset):
    cfg = build_config(overrides=["--preset", preset, "--vocab-size", "256", "--bf16"])
    model = build_model(cfg.model, 256, cfg.data.seq_length).to(torch.bfloat16)
    optimizer = build_optimizer(model, cfg.train, torch.bfloat16)
    est = estimate(cfg)
    assert est.params == stage_parameters(cfg) == num_parameters(model)
    assert est.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.optimizer_bytes == optimizer.memory_bytes()
    assert est.grad_bytes == 4 * est.params


def test_layouts_shrink_what_they_shard():
    base, tp = _b1(), _b1("--tp", "2")
    dist_opt = _b1("--use-distributed-optimizer", "--global-batch-size", "16")
    assert stage_parameters(tp) < 0.55 * stage_parameters(base)
    assert estimate(dist_opt, world_size=4).optimizer_bytes == estimate(base).optimizer_bytes // 4
    # Sequence parallelism shards the residual stream; the linears' gathered inputs stay whole.
    sp = dataclasses.replace(tp, parallel=dataclasses.replace(tp.parallel, sequence_parallel=True))
    assert activation_bytes_per_token_layer(sp) < activation_bytes_per_token_layer(tp) < activation_bytes_per_token_layer(base)
    # 1F1B on the first of pp stages: 1/pp of the layers (split evenly), pp micro batches in flight.
    pp = _b1("--pp", "4", "--global-batch-size", "16", "--pipeline-split", "uniform")
    assert activation_bytes(pp, world_size=4) == activation_bytes(base)
    # Split by cost, the first stage holds more layers (the last also holds the output layer).
    by_cost = _b1("--pp", "4", "--global-batch-size", "16")
    assert first_rank_layers(by_cost, 4) == 5 and first_rank_layers(pp, 4) == 4
    assert activation_bytes(by_cost, world_size=4) == activation_bytes(base) * 5 // 4


def test_recompute_meets_b7_on_paper():
    """Full recompute keeps one hidden state per layer plus one layer's worth: under 1/5 (B7)."""
    plain = activation_bytes(_b1())
    full, selective = activation_bytes(_b1("--recompute-granularity", "full")), activation_bytes(_b1("--recompute-granularity", "selective"))
    fp8 = activation_bytes(_b1("--fp8-format", "hybrid"))
    assert full < plain / 5 and full < selective < plain and fp8 < plain


def test_estimate_command(capsys):
    assert main(["estimate", *B1, "--global-batch-size", "8", "--world-size", "4", "--tp", "2", "--print-mesh"]) == 0
    out = capsys.readouterr().out
    assert "tp groups: [0, 1] [2, 3]" in out and "activations" in out and "total" in out
    assert out.count("\n     3      1") == 1  # rank 3: tp 1, cp 0, dp 1, ...
    assert main(["estimate", "--tp", "3", "--world-size", "4"]) == 2  # a layout that does not fit: one clear line
    assert "not a multiple" in capsys.readouterr().err
