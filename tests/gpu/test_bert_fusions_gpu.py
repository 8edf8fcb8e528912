"""BERT's eager fusions on the GPU, whole model: fc1's bias + GELU (fc1 swapped as training swaps
it, then switched), and the LM head's masked-sum loss with its bias, against the unfused model
(``--no-bias-gelu-fusion --no-cross-entropy-loss-fusion``): loss and every gradient, norm-relative,
in fp32 and bf16. No dropout, so nothing random differs; the dropout + add kernel has its own GPU
test (``test_kernels_gpu.py``)."""

import pytest
import torch

from meshtron.config import build_config
from meshtron.kernels.grad_accum_fusion import apply_gradient_accumulation_fusion
from meshtron.layers.mlp import enable_bias_gelu_fusion
from meshtron.models import build_model

VOCAB, SEQ, BATCH = 1024, 64, 8  # tiny-bert has 64 positions
POST_LN_BERT = ["--model-type", "bert", "--preset", "tiny-bert", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
                "--apply-residual-connection-post-layernorm", "--bert-no-binary-head", "--hidden-dropout", "0", "--attention-dropout", "0"]  # fmt: skip


def _loss_and_grads(fused: bool, dtype: torch.dtype, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    flags = ["--bias-gelu-fusion"] if fused else ["--no-bias-gelu-fusion", "--no-cross-entropy-loss-fusion"]
    cfg = build_config(overrides=[*POST_LN_BERT, *flags]).model
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB, SEQ).cuda().to(dtype)
    if fused:
        apply_gradient_accumulation_fusion(model.layers)
        assert enable_bias_gelu_fusion(model.layers) == cfg.num_layers
    out, _ = model.run_stage(None, batch, list(model.layers), True, True)
    loss = model.loss(batch, out)
    (loss.total / loss.count).backward()
    return (loss.total / loss.count).item(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])  # bf16: as tests/gpu/test_t5_gpu.py
def test_fused_bert_equals_unfused_on_the_gpu(dtype, tol):
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    labels = torch.where(torch.rand(BATCH, SEQ, device="cuda", generator=g) < 0.15, tokens, -100)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": (labels >= 0).float()}
    want_loss, want = _loss_and_grads(False, dtype, batch)
    got_loss, got = _loss_and_grads(True, dtype, batch)
    assert abs(got_loss - want_loss) < tol * want_loss
    for name, grad in want.items():
        err = ((got[name] - grad).norm() / grad.norm()).item()
        assert err < tol, f"{dtype}: grad of {name} relative error {err:.2e}"
