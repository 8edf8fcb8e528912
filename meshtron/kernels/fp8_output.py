"""The fused masked-sum loss's three logits-sized GEMMs in FP8 (``--fp8-output-layer``, opt-in).

Why: with FP8 blocks the output layer's GEMMs (logits, weight gradient, hidden gradient) are a
fifth of a Llama-3-8B step at a 128 K vocabulary (B3: 34.9 of 186 ms) and FP8 runs them at ~1.8x.
Opt-in because Megatron / Transformer Engine keep the output layer in bf16 (torchtitan lets a user
convert it): the logits feed the softmax directly.

One ``Fp8OutputGemms`` per call of ``cross_entropy_sum._LinearCrossEntropySum``, with the output
layer's ``Fp8Scaling`` (0-d scales: the delayed or tensorwise recipe):

- the hidden states [n, h] are cast once, row-major (logits GEMM) and transposed (weight
  gradient), at the state's ``input`` scale (delayed: its amax history; tensorwise: the amax now);
- the weight's token rows [V, h] once, row-major (logits) and transposed (hidden gradient), at its
  ``weight`` scale. Once per call, not once per step (``step_cache``): kept for the step, the two
  copies (1 GiB at 128 K x 4096) would stay through every block's backward;
- each chunk's ``dlogits = (softmax - onehot) * w / n`` in the gradient format (e5m2 under hybrid),
  both layouts, made from the logits in the cast kernel's one pass (the bf16 gradient is never
  written: 4 bytes an element of memory traffic instead of 8), at a static scale: ``|softmax - onehot| <= 1``, so ``|dlogits| <=
  max|w| / n``, known before any chunk exists (no amax pass; the history's gradient row stays
  unused). The bound is the gradient of a target given probability ~0, so it is near the actual
  amax; a value rounded above it by the compute dtype is clamped to the format's maximum, as in
  every cast. Below the bound e5m2 keeps 2**-31.8 of it (its smallest subnormal over its maximum):
  probabilities down to ~3e-10 survive; e4m3 (``--fp8-format e4m3``) only 2**-17.8 (~4e-6, half
  a 128 K vocabulary's uniform probability), so hybrid is the format for this layer.

The GEMMs read slices: a token block's rows of the hidden copies, a chunk's rows of the weight
copy. A column slice of a transposed copy (the weight's per chunk; the hidden's per token block,
past the logits budget) is copied contiguous first (1 byte per element, ~0.3 ms a call at 128 K
x 4096), as ``_scaled_mm`` takes its operands dense. The logits come out in the compute dtype; the
weight gradient is written into its gradient (one block) or added in fp32 (several), the hidden
gradient's fp32 product added into its fp32 sum. ``_scaled_mm`` wants dimensions that are multiples
of 16: a call whose hidden size or token count is not runs bf16 (``fits``), as does a chunk whose
width is not (``takes``: the last chunk, cut at the real vocabulary).
"""

from __future__ import annotations

import torch

from meshtron.kernels import use_triton
from meshtron.kernels.cross_entropy import chunk_backward_reference
from meshtron.kernels.fp8 import _mm
from meshtron.kernels.fp8_cast import AMAX_FLOOR, Cast, fp8_cast
from meshtron.kernels.fp8_scaling import PER_TENSOR_RECIPES, Fp8Scaling

MULTIPLE = 16  # _scaled_mm's rule for every dimension it reduces over or writes as columns


def fits(scaling: Fp8Scaling, num_tokens: int, hidden_size: int, block_tokens: int, vocab_rows: int) -> bool:
    """Whether a call can run FP8 (else bf16): hidden size and token blocks multiples of 16, and a
    vocabulary (a shard may hold only padding). Refuses a recipe without per-tensor scales."""
    if scaling.recipe.recipe not in PER_TENSOR_RECIPES:
        raise ValueError(f"the FP8 output layer takes the delayed or tensorwise recipe, not '{scaling.recipe.recipe}'")
    return vocab_rows > 0 and all(d % MULTIPLE == 0 for d in (num_tokens, hidden_size, block_tokens))


class Fp8OutputGemms:
    """The FP8 copies of one call's hidden states and weight, and its three GEMMs per chunk.

    ``hidden`` [n, h], ``weight`` [V, h] (the token rows), ``grad_scale`` [n] (``w / n``);
    ``need_hidden`` / ``need_weight``: which gradients are taken (which transposed copies exist).
    Training only: every call's amaxes enter the histories (delayed scaling)."""

    def __init__(self, scaling: Fp8Scaling, hidden: torch.Tensor, weight: torch.Tensor, grad_scale: torch.Tensor,
                 need_hidden: bool, need_weight: bool):  # fmt: skip
        self.scaling, self.dtype = scaling, hidden.dtype
        self.h = scaling.quantize(hidden, "input", True, need_weight, scaling.seeded, True)
        self.w = scaling.quantize(weight, "weight", True, need_hidden, scaling.seeded, True)
        scaling.seeded = True
        self.grad_dtype = scaling.dtype("grad")
        bound = grad_scale.abs().amax().float().clamp(min=AMAX_FLOOR)  # max |dlogits|: see the module docstring
        self.grad_cast_scale = torch.finfo(self.grad_dtype).max / bound
        self.grad_inv = self.grad_cast_scale.reciprocal()

    @staticmethod
    def takes(cols: slice) -> bool:
        """Whether the chunk ``cols`` of the vocabulary runs FP8 (its width a multiple of 16)."""
        return (cols.stop - cols.start) % MULTIPLE == 0

    def logits(self, rows: slice, cols: slice) -> torch.Tensor:
        """[block, chunk] logits of token block ``rows`` and vocabulary chunk ``cols``, in the compute dtype."""
        return _mm(self.scaling, self.h.rows[rows], self.h.rows_inv, self.w.rows[cols], self.w.rows_inv, self.dtype)

    def _gradient_cast(self, logits: torch.Tensor, labels: torch.Tensor, start: int, lse: torch.Tensor,
                       grad: torch.Tensor, rows: bool, transposed: bool) -> Cast:  # fmt: skip
        """The chunk's ``dlogits = (softmax - onehot) * grad`` (``chunk_backward_reference``, in the
        compute dtype) cast at the static scale: where the kernels run, one pass from the logits
        (``triton_fp8_cast.cast``'s ``ce_gradient``), the logits read once and no dlogits written."""
        if not use_triton(self.scaling.recipe.fused_kernels, logits):
            dlogits = chunk_backward_reference(logits, labels, start, lse, grad)
            return fp8_cast(dlogits, self.grad_cast_scale, self.grad_dtype, rows, transposed, fused_kernels="off")
        from meshtron.kernels.triton_fp8_cast import cast

        q, qt, _ = cast(logits.contiguous(), self.grad_cast_scale, self.grad_dtype, rows, transposed, False,
                        ce_gradient=(labels, lse, grad.float().contiguous(), start))  # fmt: skip
        return Cast(q if rows else None, qt if transposed else None, None)

    def gradients(self, logits: torch.Tensor, labels: torch.Tensor, start: int, lse: torch.Tensor, grad: torch.Tensor,
                  rows: slice, cols: slice, grad_weight: torch.Tensor | None, grad_hidden: torch.Tensor | None,
                  add_weight: bool) -> None:  # fmt: skip
        """From the chunk's ``logits`` (its rows' ``labels``, vocabulary columns ``start``.., their
        ``lse`` and per-token ``grad``: ``chunk_backward_reference``'s arguments), the weight
        gradient ``dlogits^T @ h`` into ``grad_weight[cols]`` (written, or added in fp32 when
        ``add_weight``) and its part of the hidden gradient ``dlogits @ W`` added into the fp32
        ``grad_hidden[rows]``; None: not taken."""
        d = self._gradient_cast(logits, labels, start, lse, grad, grad_hidden is not None, grad_weight is not None)
        if grad_weight is not None:
            h_t = self.h.transposed[:, rows].contiguous()  # no copy with one token block
            if add_weight:
                grad_weight[cols] += _mm(self.scaling, d.transposed, self.grad_inv, h_t, self.h.transposed_inv, torch.float32)
            else:
                _mm(self.scaling, d.transposed, self.grad_inv, h_t, self.h.transposed_inv, grad_weight.dtype, out=grad_weight[cols])
        if grad_hidden is not None:
            w_t = self.w.transposed[:, cols].contiguous()
            grad_hidden[rows] += _mm(self.scaling, d.rows, self.grad_inv, w_t, self.w.transposed_inv, torch.float32)
