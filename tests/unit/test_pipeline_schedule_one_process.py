"""A pipeline of one stage is the plain model: the stage's embedding (learned positions too),
blocks, final norm and tied output give the decoder's losses and gradients, whichever schedule
walks them, and the runner at one process gives the plain model's mean loss and gradients.
Proves ``Stage.forward`` and the runner against ``Decoder.forward`` without processes; the
multi-stage runs are in ``tests/distributed/test_pipeline.py``.
"""

from __future__ import annotations

import pytest
import torch

from meshtron.config import ModelConfig, ParallelConfig, TrainConfig
from meshtron.models import build_model
from meshtron.models.contract import SummedTokenLoss
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.pipeline import build_stages, forward_backward
from meshtron.parallel.plan import parallelize
from meshtron.parallel.setup import runner_for

GPT = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, normalization="LayerNorm", activation="gelu",
                  position_embedding_type="learned_absolute", add_bias_linear=True, tie_embeddings=True)  # fmt: skip
VOCAB, SEQ = 64, 8


def _model():
    torch.manual_seed(3)
    return build_model(GPT, VOCAB, SEQ)


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [{"tokens": torch.randint(0, VOCAB, (2, SEQ), generator=g),
             "labels": torch.randint(0, VOCAB, (2, SEQ), generator=g),
             "loss_mask": (torch.rand(2, SEQ, generator=g) < 0.8).float()} for _ in range(3)]  # fmt: skip


def _loss_fn(out, batch):
    """The stage's head sums the masked loss itself when the batch has a mask (the loss fusion)."""
    total = out.total if isinstance(out, SummedTokenLoss) else (out * batch["loss_mask"]).sum()
    return total / 40.0


@pytest.mark.parametrize("kind", ["afab", "1f1b", "interleaved"])
def test_one_stage_pipeline_is_the_model(kind):
    ref, batches = _model(), _batches()
    ref_losses = []
    for b in batches:
        loss = _loss_fn(ref(b["tokens"], labels=b["labels"]), b)
        (loss * 2.0).backward()
        ref_losses.append(loss.detach())
    model = _model()
    mesh = Mesh()
    stages = build_stages(model, parallelize(model, mesh), mesh)
    losses = []

    def step(stage, carry, mb):
        out, aux = stage.forward(carry, batches[mb])
        assert stage.is_last and not aux
        losses.append(_loss_fn(out, batches[mb]))
        return None, losses[-1] * 2.0

    forward_backward(kind, stages, batches, mesh, step, torch.float32)
    torch.testing.assert_close(torch.stack(losses).detach(), torch.stack(ref_losses), rtol=1e-6, atol=0)
    grads = {n: p.grad for n, p in ref.named_parameters()}
    assert sorted(n for n, _ in model.named_parameters()) == sorted(grads)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_runner_at_one_process_is_the_model():
    """The objective is each micro batch's masked loss sum over the tokens of the whole batch."""
    ref, batches = _model(), _batches()
    count = sum(b["loss_mask"].sum() for b in batches)
    for b in batches:
        ((ref(b["tokens"], labels=b["labels"]) * b["loss_mask"]).sum() / count).backward()
    want = sum((ref(b["tokens"], labels=b["labels"]) * b["loss_mask"]).sum() for b in batches).detach() / count
    runner = runner_for(_model(), Mesh(), ParallelConfig(), TrainConfig(), torch.float32)
    runner.optimizer.zero_grad()
    loss = runner.forward_backward(batches)
    runner.finalize_grads()
    torch.testing.assert_close(loss.total / loss.count, want, rtol=1e-6, atol=0)
    assert loss.count == count and loss.aux == {}
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, param in runner.model.named_parameters():
        torch.testing.assert_close(param.main_grad, grads[name], rtol=1e-5, atol=1e-7, msg=name)
