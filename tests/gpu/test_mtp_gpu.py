"""Multi-token prediction on one GPU with the defaults a user gets (fused kernels: the masked-sum
loss's Triton kernels, the grouped GEMMs; gradient-accumulation fusion into the fp32 buffer): a
tiny DeepSeek-V3 with two prediction depths trains to the same losses, depth terms and weights as
the PyTorch reference path (``--fused-kernels off --no-gradient-accumulation-fusion``), fp32. The
output layer, called once per depth too, keeps its weight gradient on autograd's path
(``weight_reused``): had each call written it into the buffer itself, the depths' share would be
lost or the buffer's bucket counting refused the step."""

import math

import pytest
import torch

from meshtron.config import build_config
from meshtron.training.trainer import Trainer

BASE = [
    "--preset", "tiny-deepseek-v3", "--mtp-num-layers", "2", "--mock-data", "--vocab-size", "512", "--seq-length", "64",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-2", "--lr-warmup-iters", "1",
    "--fp32", "--eval-interval", "0", "--log-interval", "100", "--device", "cuda",
]


def _run(flags: list[str]) -> dict:
    trainer = Trainer(build_config(None, BASE + flags), log=lambda _: None)
    result = trainer.run()
    return {"losses": result.losses, "aux": dict(trainer.last_aux),
            "weights": {n: p.detach().float().cpu() for n, p in trainer.model.named_parameters()}}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_paths_equal_the_reference_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    fused = _run([])
    reference = _run(["--fused-kernels", "off", "--no-gradient-accumulation-fusion"])
    assert all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(fused["losses"], reference["losses"], strict=True)), (fused, reference)
    assert {"mtp_loss/1", "mtp_loss/2"} <= fused["aux"].keys()
    for name, value in reference["aux"].items():
        assert math.isclose(fused["aux"][name], value, rel_tol=1e-3, abs_tol=1e-6), (name, fused["aux"][name], value)
    # Adam's normalized step (lr 1e-2) turns summation-order differences of a near-zero gradient
    # element into up to a few percent of lr: weights agree to a tenth of one step's size.
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(fused["weights"][name], weight, rtol=1e-3, atol=1e-3, msg=lambda m, name=name: f"{name}: {m}")
