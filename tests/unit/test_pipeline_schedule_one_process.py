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
from meshtron.parallel.pipeline import build_stages, forward_backward, releasable
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
        losses.append(stage.model.loss(batches[mb], out).total / 40.0)  # the head may sum the masked loss itself
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


def test_released_after_send_only_what_nothing_else_reads():
    """``releasable``: a stage's fresh output is freed once sent; not an input passed through (the
    previous stage's buffer), a view, or a tensor the chunk also fed to another output's ops (T5's
    encoder stream read by decoder blocks of the same chunk), which saved it for their backward."""
    x = torch.randn(2, 4, requires_grad=True)
    weight = torch.randn(4, 4, requires_grad=True)
    encoder = x * 2.0
    decoder = encoder @ weight  # saves ``encoder`` for the weight's gradient
    assert releasable({"encoder": encoder, "decoder": decoder}, None) == {"decoder"}
    assert releasable({"encoder": x, "decoder": decoder}, None) == {"decoder"}
    assert releasable({"hidden": (x * 3.0).view(8)}, None) == set()
    hidden = x * 3.0
    aux = (hidden**2).sum()  # an auxiliary term of the same chunk read the output
    assert releasable({"hidden": hidden}, aux) == set()
    assert releasable({"hidden": hidden}, (x**2).sum()) == {"hidden"}
