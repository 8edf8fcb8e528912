"""BERT-large's eager fusions one op at a time, fused against unfused, at B8's shapes (GPU):

    python benchmarks/bert_fusions.py

Each op is timed forward + backward (CUDA events, ``planning.calibrate.cuda_seconds``) on one
micro batch (32 x 512 tokens, bf16), and multiplied by how often a training step runs it:

* ``dropout+add`` [16384, 1024], p 0.1, 48 a step (two per block): ``kernels/dropout_add``
  against ``residual + F.dropout(x)``;
* ``bias+gelu`` [16384, 4096], 24 a step: ``kernels/bias_gelu`` against what the unfused MLP
  runs (the bias added in fc1's GEMM, so ``F.gelu`` alone, then the bias gradient's sum over the
  tokens in fc1's backward);
* ``lm head loss``: 15 % of the tokens labelled (2,458 rows), vocabulary 30,522, once a step:
  the masked-sum loss with the bias in its GEMM (``kernels/cross_entropy_sum``) against full
  logits of those rows and ``F.cross_entropy``, GEMMs included on both sides.

The last column is the time a step saves. What the whole step gains is B8's
``--sides meshtron,meshtron-unfused,hf``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtron.kernels.bias_gelu import bias_gelu
from meshtron.kernels.cross_entropy_sum import linear_cross_entropy_sum
from meshtron.kernels.dropout_add import dropout_add
from meshtron.planning.calibrate import cuda_seconds

TOKENS, HIDDEN, FFN, VOCAB, LAYERS, MASKED = 32 * 512, 1024, 4096, 30522, 24, 2458


def _forward_backward(op, *inputs: torch.Tensor):
    """A function running ``op`` on leaf copies of ``inputs`` and its backward under a fixed upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = op(*leaves)
    upstream = torch.randn_like(out)

    def run():
        torch.autograd.grad(op(*leaves), leaves, upstream)

    return run


def _unfused_gelu_and_bias_grad(h: torch.Tensor):
    """The unfused MLP's share: F.gelu forward and backward, then fc1's bias gradient summed from its input gradient."""
    leaf = h.detach().clone().requires_grad_()
    upstream = torch.randn_like(h)

    def run():
        (grad,) = torch.autograd.grad(F.gelu(leaf), leaf, upstream)
        grad.sum(0)

    return run


def _head_loss(rows, weight, bias, labels, fused: bool) -> torch.Tensor:
    if fused:
        return linear_cross_entropy_sum(rows, weight, labels, torch.ones_like(labels, dtype=torch.float32), "on", bias=bias)
    return F.cross_entropy(F.linear(rows, weight, bias).float(), labels, reduction="sum")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bert_fusions times GPU kernels; run it on a GPU")
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, residual = torch.randn(TOKENS, HIDDEN, **bf16), torch.randn(TOKENS, HIDDEN, **bf16)
    h, fc1_bias = torch.randn(TOKENS, FFN, **bf16), torch.randn(FFN, **bf16)
    rows, weight, vocab_bias = torch.randn(MASKED, HIDDEN, **bf16), torch.randn(VOCAB, HIDDEN, **bf16) * 0.02, torch.randn(VOCAB, **bf16)
    labels = torch.randint(0, VOCAB, (MASKED,), device="cuda")
    ops = [  # name, calls a step, fused, unfused
        ("dropout+add", 2 * LAYERS, _forward_backward(lambda a, r: dropout_add(a, r, 0.1, True, "on"), x, residual),
         _forward_backward(lambda a, r: r + F.dropout(a, 0.1), x, residual)),
        ("bias+gelu", LAYERS, _forward_backward(lambda a, b: bias_gelu(a, b, "none", "on"), h, fc1_bias), _unfused_gelu_and_bias_grad(h)),
        ("lm head loss", 1, _forward_backward(lambda r, w, b: _head_loss(r, w, b, labels, True), rows, weight, vocab_bias),
         _forward_backward(lambda r, w, b: _head_loss(r, w, b, labels, False), rows, weight, vocab_bias)),
    ]  # fmt: skip
    print(f"BERT-large's fusions on {torch.cuda.get_device_name()}, one micro batch of {TOKENS} tokens, forward + backward")
    print(f"{'op':<14} {'a step':>6} {'fused ms':>9} {'unfused ms':>11} {'saved ms a step':>16}")
    total = 0.0
    for name, calls, fused, unfused in ops:
        fast, slow = cuda_seconds(fused) * 1e3, cuda_seconds(unfused) * 1e3
        total += (slow - fast) * calls
        print(f"{name:<14} {calls:>6} {fast:>9.3f} {slow:>11.3f} {(slow - fast) * calls:>16.2f}")
    print(f"{'all':<14} {'':>6} {'':>9} {'':>11} {total:>16.2f}")


if __name__ == "__main__":
    main()
