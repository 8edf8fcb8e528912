"""The decoder: outputs, loss, gradients, initialization, packed documents, precision."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import build_config
from meshtron.models import build_model, num_parameters, padded_vocab_size
from meshtron.models.decoder import Decoder

VOCAB, SEQ = 96, 64


def preset(name: str, **fields):
    return dataclasses.replace(build_config(overrides=["--model.preset", name]).model, **fields)


def make(name: str, seed: int = 0, **fields) -> Decoder:
    torch.manual_seed(seed)
    return build_model(preset(name, **fields), VOCAB, SEQ)


def randomize_norms(model):
    """Init leaves norm weights at 1 and biases at 0; perturb them so tests see every term."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)


PRESETS = ["tiny-gpt", "tiny-llama"]


@pytest.mark.parametrize("name", PRESETS)
def test_logits_and_per_token_loss(name):
    model = make(name)
    tokens = torch.randint(0, VOCAB, (2, 16))
    labels = torch.randint(0, VOCAB, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, VOCAB)
    loss = model(tokens, labels=labels)
    assert loss.shape == (2, 16) and loss.dtype == torch.float32 and torch.isfinite(loss).all()
    expected = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), reduction="none").view(2, 16)
    torch.testing.assert_close(loss, expected)
    # A freshly initialized model is close to uniform over the vocabulary.
    assert abs(loss.mean().item() - torch.log(torch.tensor(float(VOCAB))).item()) < 0.5


@pytest.mark.parametrize("name", PRESETS)
def test_backward_fills_every_gradient(name):
    model = make(name)
    tokens = torch.randint(0, VOCAB, (2, 16))
    model(tokens, labels=torch.roll(tokens, -1, 1)).mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


def test_tied_and_untied_output():
    tied, untied = make("tiny-gpt"), make("tiny-llama")
    assert tied.output.weight is None and untied.output.weight is not None
    hidden = torch.randn(1, 3, 64)
    for model, weight in ((tied, tied.embedding.weight), (untied, untied.output.weight)):
        torch.testing.assert_close(model.head({"hidden": hidden}, {}), model.final_norm(hidden) @ weight.T)


def test_init_is_a_function_of_the_seed_only():
    a = make("tiny-llama", seed=3)
    torch.manual_seed(3)
    torch.randn(1000)  # draws between seeding and construction change nothing
    b = build_model(preset("tiny-llama"), VOCAB, SEQ)
    c = make("tiny-llama", seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.std() > 0:
            assert not torch.equal(pa, pc), name
    # Each tensor depends only on its name: a deeper model draws the same first layers (up to the
    # depth-dependent std of residual outputs), so a pipeline stage can init only its own layers.
    deep = make("tiny-llama", seed=3, num_layers=4)
    deep_params = dict(deep.named_parameters())
    for name, p in a.named_parameters():
        ratio = 2**-0.5 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 1.0
        torch.testing.assert_close(p * ratio, deep_params[name], rtol=1e-6, atol=0, msg=name)


@pytest.mark.parametrize("name", PRESETS)
def test_megatron_init_statistics(name):
    model = make(name, num_layers=8, hidden_size=256, init_method_std=0.02)
    scaled = 0.02 / (2 * 8) ** 0.5
    for pname, p in model.named_parameters():
        if "norm" in pname:
            assert torch.all(p == (1.0 if pname.endswith("weight") else 0.0)), pname
        elif pname.endswith("bias"):
            assert torch.all(p == 0), pname
        else:
            expected = scaled if pname.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0.02
            assert abs(p.float().std().item() - expected) < 0.1 * expected, pname
            assert abs(p.float().mean().item()) < 0.1 * expected, pname


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_packed_documents_equal_separate_runs(name, backend):
    """reset_attention_mask + reset_position_ids: a packed row computes each document alone."""
    model = make(name, attention_backend=backend).eval()
    randomize_norms(model)
    lengths = [5, 11, 1, 7]
    docs = [torch.randint(0, VOCAB, (1, n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    document_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    position_ids = torch.cat([torch.arange(n)[None] for n in lengths], dim=1)
    out = model(packed, position_ids=position_ids, document_ids=document_ids)
    torch.testing.assert_close(out, torch.cat([model(d) for d in docs], dim=1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, model(packed), rtol=1e-3, atol=1e-3)  # the mask matters


@pytest.mark.parametrize("name", PRESETS)
def test_math_backend_matches_sdpa_model(name):
    sdpa, math_model = make(name), make(name, attention_backend="math")
    randomize_norms(sdpa)
    math_model.load_state_dict(sdpa.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 32))
    torch.testing.assert_close(math_model(tokens), sdpa(tokens), rtol=1e-5, atol=1e-5)


def test_dropout_only_in_training():
    model = make("tiny-llama", hidden_dropout=0.5, attention_dropout=0.5)
    tokens = torch.randint(0, VOCAB, (1, 16))
    assert not torch.equal(model(tokens), model(tokens))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))


def test_bf16_model_keeps_fp32_rope_and_loss():
    model = make("tiny-llama").to(torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (2, 16))
    assert model(tokens).dtype == torch.bfloat16
    assert model(tokens, labels=tokens).dtype == torch.float32
    cos, sin = model.rope_tables(tokens.device)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (SEQ, 16)
    assert not any("rope" in k for k in model.state_dict())


def test_num_parameters():
    model = make("tiny-gpt")
    total = sum(p.numel() for p in model.parameters())
    assert num_parameters(model) == total
    assert num_parameters(model, exclude_embeddings=True) == total - VOCAB * 64 - SEQ * 64
    untied = make("tiny-llama")
    assert num_parameters(untied, exclude_embeddings=True) == num_parameters(untied) - 2 * VOCAB * 64


def test_padded_vocab_size():
    assert padded_vocab_size(50257, 128) == 50304
    assert padded_vocab_size(50257, 128, tensor_parallel=8) == 51200
    assert padded_vocab_size(128256, 128) == 128256
    assert padded_vocab_size(1000, 1) == 1000
