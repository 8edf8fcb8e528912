"""Padded vocabulary rows never change a result: a model of 300 tokens in 384 rows (tp1's
padding) or 512 (tp2's) has exactly the loss and the real rows' gradients of the same model in 300
rows, in every loss path (the chunked per-token kernel, the masked-sum kernel in one token block
or several, the unfused reference, the biased heads of BERT and T5); padded rows get no gradient
and no logit, so generation never samples them. The layouts themselves: ``tests/distributed/test_vocab_padding_layouts.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtron.config import ModelConfig, build_config
from meshtron.kernels.cross_entropy import linear_cross_entropy
from meshtron.kernels.cross_entropy_sum import linear_cross_entropy_sum
from meshtron.layers.output import OutputLayer
from meshtron.models import build_model
from meshtron.parallel.plan import vocabulary_rows

TOKENS, SEQ = 300, 16
GPT = dataclasses.replace(build_config(overrides=["--model.preset", "tiny-llama"]).model, num_layers=2)
FAMILIES = {
    "gpt_tied": dataclasses.replace(GPT, tie_embeddings=True),
    "llama_untied": GPT,
    "bert": ModelConfig(model_type="bert", num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0),
    "t5": ModelConfig(model_type="t5", num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0),
}


def _batch(family: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = lambda: torch.randint(0, TOKENS, (2, SEQ), generator=g)  # noqa: E731
    labels, mask = ids(), (torch.rand(2, SEQ, generator=g) < 0.6).float()
    labels[:, 0] = TOKENS - 1  # the last real row is a label
    if family == "t5":
        return {"encoder_tokens": ids(), "decoder_tokens": ids(), "labels": labels, "loss_mask": mask,
                "encoder_padding_mask": torch.ones(2, SEQ, dtype=torch.bool), "decoder_padding_mask": torch.ones(2, SEQ, dtype=torch.bool)}  # fmt: skip
    batch = {"tokens": ids(), "labels": labels.masked_fill(mask == 0, -100) if family == "bert" else labels, "loss_mask": mask}
    if family == "bert":
        batch.update(types=torch.zeros(2, SEQ, dtype=torch.long), padding_mask=torch.ones(2, SEQ, dtype=torch.bool),
                     is_random=torch.tensor([0, 1]))  # fmt: skip
    return batch


def _loss_and_grads(cfg: ModelConfig, family: str, rows: int):
    torch.manual_seed(5)
    model = build_model(cfg, TOKENS, SEQ, rows)
    batch = _batch(family)
    out, _ = model.run_stage(None, batch, list(model.blocks()), True, True)
    loss = model.loss(batch, out)
    (loss.total + sum(loss.aux.values())).backward()
    return loss.total.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kernels", ["auto", "off"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_padding_changes_no_loss_and_no_gradient(family, kernels):
    cfg = dataclasses.replace(FAMILIES[family], fused_kernels=kernels)
    want, want_grads = _loss_and_grads(cfg, family, 0)
    for rows in (384, 512):
        got, grads = _loss_and_grads(cfg, family, rows)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        for name, grad in grads.items():
            ref = want_grads[name]
            if grad.shape[0] == rows and ref.shape[0] == TOKENS:  # a vocabulary tensor: real rows equal, padding untouched
                assert grad[TOKENS:].abs().max() == 0, f"{family} {rows}: padded rows of {name} got a gradient"
                grad = grad[:TOKENS]
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{family} {rows} {name}: {m}")


def test_padded_logits_get_no_probability_mass():
    torch.manual_seed(0)
    layer = OutputLayer(8, 384, tied=False, bias=True, vocab_size=TOKENS)
    with torch.no_grad():
        layer.weight.normal_()
        layer.weight[TOKENS:] = 50.0  # padded rows that would take all the mass if they were in the softmax
        layer.bias.normal_()
    hidden = torch.randn(4, 8).abs()
    logits = layer(hidden)
    assert logits.shape == (4, TOKENS)  # generation samples among real ids only
    unpadded = OutputLayer(8, TOKENS, tied=False, bias=True)
    unpadded.load_state_dict({"weight": layer.weight[:TOKENS], "bias": layer.bias[:TOKENS]})
    labels = torch.randint(0, TOKENS, (4,))
    torch.testing.assert_close(layer(hidden, labels=labels), unpadded(hidden, labels=labels))


@pytest.mark.parametrize("kernels", ["auto", "off"])
def test_kernels_stop_at_the_real_rows(kernels):
    """The kernels themselves, with chunks that end inside, at and past the real rows, and the
    masked sum in several token blocks (its fp32 weight-gradient path)."""
    torch.manual_seed(0)
    hidden = torch.randn(12, 16, requires_grad=True)
    weight = torch.randn(384, 16)
    weight[TOKENS:] = 30.0
    weight.requires_grad_(True)
    labels = torch.randint(0, TOKENS, (12,))
    labels[3] = -100
    mask = torch.rand(12)
    ref_w = weight.detach()[:TOKENS].clone().requires_grad_(True)
    ref_h = hidden.detach().clone().requires_grad_(True)
    want = linear_cross_entropy(ref_h, ref_w, labels, "off")
    (want * mask).sum().backward()
    for chunk in (0, 7, 100, 300):
        got = linear_cross_entropy(hidden, weight, labels, kernels, chunk_size=chunk, real_rows=TOKENS)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        for budget in (2**30, 16 * TOKENS * 4):  # one token block; blocks of 4 tokens
            hidden.grad = weight.grad = None
            total = linear_cross_entropy_sum(hidden, weight, labels, mask, kernels, chunk_size=chunk, budget_bytes=budget, real_rows=TOKENS)
            total.backward()
            torch.testing.assert_close(total, (want * mask).sum().detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(hidden.grad, ref_h.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(weight.grad[:TOKENS], ref_w.grad, rtol=1e-5, atol=1e-6)
            assert weight.grad[TOKENS:].abs().max() == 0


def test_real_rows_outside_the_weight_is_an_early_error():
    with pytest.raises(ValueError, match="outside the weight's 384 rows"):
        linear_cross_entropy(torch.randn(2, 4), torch.randn(384, 4), torch.zeros(2, dtype=torch.long), real_rows=385)
    with pytest.raises(ValueError, match="does not fit 300 rows"):
        OutputLayer(4, 300, tied=False, vocab_size=384)


def test_checkpoints_cut_the_padded_rows_of_every_vocabulary_tensor():
    """What a checkpoint stores of a padded vocabulary: the real rows of the embedding, the
    untied output weight and a head's bias; nothing for an unpadded model."""
    torch.manual_seed(0)
    assert vocabulary_rows(build_model(GPT, TOKENS, SEQ, 384)) == {"embedding.weight": TOKENS, "output.weight": TOKENS}
    assert vocabulary_rows(build_model(FAMILIES["t5"], TOKENS, SEQ, 512)) == {"embedding.weight": TOKENS, "output.bias": TOKENS}
    assert vocabulary_rows(build_model(GPT, TOKENS, SEQ)) == {}
