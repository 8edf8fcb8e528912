"""Activation recompute changes memory, never numbers: losses and gradients equal a plain run."""

import dataclasses

import pytest
import torch

from meshtron.config import build_config
from meshtron.models import build_model

SETTINGS = [
    ("selective", "uniform", 1),
    ("full", "uniform", 1),
    ("full", "uniform", 3),  # groups that do not divide the layers: the last group is shorter
    ("full", "block", 1),
    ("full", "block", 9),  # more than the layers: all of them
]


def _run(preset: str, dropout: float, document_ids: bool, **fields):
    cfg = build_config(overrides=["--model.preset", preset, "--num-layers", "4"]).model
    cfg = dataclasses.replace(cfg, hidden_dropout=dropout, attention_dropout=dropout, **fields)
    torch.manual_seed(0)
    model = build_model(cfg, 96, 32)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 96, (2, 32), generator=gen)
    docs = torch.cumsum(torch.rand(2, 32, generator=gen) < 0.1, dim=1) if document_ids else None
    torch.manual_seed(2)  # the dropout masks
    loss = model(tokens, document_ids=docs, labels=torch.roll(tokens, -1, 1))
    loss.sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("granularity,method,num_layers", SETTINGS)
@pytest.mark.parametrize("preset,dropout,document_ids", [("tiny-llama", 0.0, True), ("tiny-gpt", 0.1, False)])
def test_recompute_gradients_identical(preset, dropout, document_ids, granularity, method, num_layers):
    ref_loss, ref_grads = _run(preset, dropout, document_ids)
    loss, grads = _run(preset, dropout, document_ids, recompute_granularity=granularity,
                       recompute_method=method, recompute_num_layers=num_layers)  # fmt: skip
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name


def test_recompute_off_without_gradients():
    """Evaluation and generation (no autograd) run the plain path: nothing to recompute."""
    cfg = dataclasses.replace(build_config(overrides=["--model.preset", "tiny-llama"]).model, recompute_granularity="full")
    model = build_model(cfg, 96, 16)
    tokens = torch.randint(0, 96, (1, 16))
    with torch.no_grad():
        assert model(tokens).shape == (1, 16, 96)
