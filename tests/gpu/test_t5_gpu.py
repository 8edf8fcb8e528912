"""T5 on a GPU in bf16 with the fast attention backends: the loss and every gradient of a padded
batch (the encoder's key mask in its self-attention and in the decoder's cross-attention, the
decoder's causal self-attention without a mask) equal the same model's in fp32 with the math
reference attention, to bf16 precision (norm-relative); the fused output loss included. Also with
relative position buckets, whose bias reaches the fast backends as a float mask (with its gradient)."""

import pytest
import torch

from meshtron.config import build_config
from meshtron.models import build_model

TOL = 5e-2  # a bf16 model (weights too) against fp32, relative as a norm over each tensor
VOCAB, ENC, DEC, BATCH = 1024, 256, 64, 4


def _loss_and_grads(backend: str, dtype: torch.dtype, batch: dict, positions: str) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = build_config(overrides=["--model-type", "t5", "--preset", "tiny-t5", "--hidden-size", "256", "--num-attention-heads", "4",
                                  "--max-position-embeddings", str(ENC), "--attention-backend", backend,
                                  "--position-embedding-type", positions]).model  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB, ENC).cuda().to(dtype)
    out, _ = model.run_stage(None, batch, list(model.layers), True, True)
    loss = model.loss(batch, out)
    (loss.total / loss.count).backward()
    return (loss.total / loss.count).item(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.gpu
@pytest.mark.parametrize("positions", ["learned_absolute", "relative"])
@pytest.mark.parametrize("backend", ["auto", "efficient"])
def test_t5_bf16_matches_fp32_math_reference(backend, positions):
    g = torch.Generator(device="cuda").manual_seed(0)
    encoder_real = torch.arange(ENC, device="cuda")[None, :] < torch.tensor([[ENC], [200], [131], [17]], device="cuda")
    decoder_real = torch.arange(DEC, device="cuda")[None, :] < torch.tensor([[DEC], [40], [9], [33]], device="cuda")
    labels = torch.randint(0, VOCAB, (BATCH, DEC), device="cuda", generator=g)
    batch = {
        "encoder_tokens": torch.randint(0, VOCAB, (BATCH, ENC), device="cuda", generator=g),
        "decoder_tokens": torch.randint(0, VOCAB, (BATCH, DEC), device="cuda", generator=g),
        "labels": labels.masked_fill(~decoder_real, -100),
        "loss_mask": decoder_real.float(),
        "encoder_padding_mask": encoder_real,
    }
    want_loss, want = _loss_and_grads("math", torch.float32, batch, positions)
    got_loss, got = _loss_and_grads(backend, torch.bfloat16, batch, positions)
    assert abs(got_loss - want_loss) < TOL * want_loss
    for name, grad in want.items():
        err = ((got[name] - grad).norm() / grad.norm()).item()
        assert err < TOL, f"{backend}: grad of {name} relative error {err:.2e}"
