"""Output projection + masked-sum cross-entropy whose gradients are computed in the forward.

A language model's loss is ``total = sum_i w_i * ce_i`` (``w``: the loss mask), so the upstream
gradient of every token is ``w_i`` times one scalar that backward brings. That is all the
chunked per-token loss (``cross_entropy.py``) does not know, and why it recomputes the logits in
backward. Knowing ``w``, this function takes the gradients while the logits are still there:

- forward, per vocabulary chunk: the logits GEMM (kept, in the compute dtype), folded into a
  running fp32 log-sum-exp; then, once the log-sum-exp is complete, each kept chunk is turned in
  place into ``(softmax - onehot) * w / n`` and gives the chunk's weight gradient (one GEMM,
  summed over every token) and a partial hidden gradient (one GEMM, summed over chunks in fp32);
- backward: both stored gradients times the scalar (times ``n``), nothing else; with
  gradient-accumulation fusion the weight's goes scaled into its fp32 ``main_grad`` in one pass.

Logits-sized GEMMs per call: 3 (logits, weight gradient, hidden gradient) against the per-token
path's 4 (its backward recomputes the logits). The price is memory: the [tokens, V] logits are
held at once in the compute dtype (16 K tokens x 128 K vocabulary: 3.9 GiB in bf16) for the
span of this forward. Where they exceed ``LOGITS_BUDGET_BYTES`` the tokens are taken in blocks
that fit; each block is handled as above and the weight gradient is summed over blocks in an
fp32 buffer (one more [V, h] fp32 add per block; still 3 GEMMs). From forward to backward the
function holds the weight gradient ([V, h], compute dtype) and the fp32 hidden gradient
([tokens, h]) instead of the hidden states: one micro batch's worth for each forward whose
backward is still to come (one under 1F1B on the last stage, up to pp under the interleaved
schedule); they are not pooled across micro batches, as each backward must hand autograd its own.

Alternatives that hold less: recomputing the logits in a second forward pass is again 4 GEMMs;
an online softmax over vocabulary chunks can rescale the hidden gradient row by row when the
log-sum-exp grows, but not a weight gradient already summed over tokens, so it needs token chunks
holding every vocabulary column (Liger's way): the token blocks here, used only past the budget,
as each costs the fp32 add above and smaller weight-gradient GEMMs.

Scaling by ``1/n`` (n: tokens in the call) keeps the stored gradients at a mean loss's magnitude,
inside fp16's range; backward multiplies by ``n`` again. With one token block the weight
gradient is the very GEMM of the per-token path's backward, rounded once more by the scalar.
The elementwise steps are ``cross_entropy``'s chunk functions (Triton or the PyTorch reference).
A padded vocabulary's rows past ``real_rows`` are never computed, as there (zero gradient).
Under tensor parallelism each rank runs this on its vocabulary shard, the log-sum-exp and target
logit combined over tp between the two passes (``parallel/tensor_parallel.py``). A bias of the
logits (BERT's LM head) joins each chunk's GEMM (``addmm``); its gradient is each chunk's
gradient summed over the tokens in fp32, stored and scaled in backward as the weight's.

Given the output layer's FP8 scaling state (``--fp8-output-layer``), the three GEMMs run in FP8
(``fp8_output``: the hidden states and the weight cast once per call, each chunk's gradient at a
static scale), in training only (evaluation takes the per-token path, in the compute dtype); a
chunk or a call whose shape ``_scaled_mm`` cannot take runs as above. A bias keeps the layer bf16.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from meshtron.kernels import fp8_output, use_triton
from meshtron.kernels.cross_entropy import (
    IGNORE_INDEX,
    chunk_backward_reference,
    chunk_forward_reference,
    default_chunk_size,
    linear_cross_entropy,
    padded_grad,
    real_rows_of,
)
from meshtron.kernels.fp8_scaling import Fp8Scaling
from meshtron.kernels.grad_accum_fusion import accumulate_scaled_of

# Logits kept at once: 4 GiB holds 16 K tokens of a 128 K vocabulary in bf16 (B1's micro batch).
LOGITS_BUDGET_BYTES = 4 * 2**30


def block_tokens_for(num_tokens: int, vocab_size: int, element_size: int, budget_bytes: int) -> int:
    """Tokens per block whose [block, V] logits fit ``budget_bytes`` (at least 1, at most all)."""
    return max(1, min(num_tokens, budget_bytes // max(1, vocab_size * element_size)))


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, token_weights, chunk_size, block_tokens, fused, vocab_start, combine_shards,
                fuse_weight_grad, real_rows, fp8):  # fmt: skip
        if fused:
            from meshtron.kernels.triton_pointwise import ce_chunk_backward as chunk_backward
            from meshtron.kernels.triton_pointwise import ce_chunk_forward as chunk_forward
        else:
            chunk_forward, chunk_backward = chunk_forward_reference, chunk_backward_reference
        n = hidden.shape[0]
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        ignored = labels == IGNORE_INDEX
        weights = torch.where(ignored, 0.0, token_weights.float())
        grad_scale = weights / n
        several_blocks = block_tokens < n
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        grad_weight = None
        if need_weight and several_blocks:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        elif need_weight:
            grad_weight = padded_grad(weight, real_rows)
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if ctx.needs_input_grad[2] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        chunks = [slice(start, min(start + chunk_size, real_rows)) for start in range(0, real_rows, chunk_size)]
        gemms = None if fp8 is None else fp8_output.Fp8OutputGemms(fp8, hidden, weight[:real_rows], grad_scale, need_hidden, need_weight)
        for first in range(0, n, block_tokens):
            rows = slice(first, first + block_tokens)
            h, block_labels = hidden[rows], labels[rows]
            logits, lse_parts = [], []
            target = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
            for cols in chunks:
                if gemms is not None and gemms.takes(cols):
                    logits.append(gemms.logits(rows, cols))
                else:
                    logits.append(h @ weight[cols].t() if bias is None else torch.addmm(bias[cols], h, weight[cols].t()))
                lse, tgt = chunk_forward(logits[-1], block_labels, vocab_start + cols.start)
                lse_parts.append(lse)
                target += tgt
            # A shard holding only padding adds nothing to the sum of exponentials: log 0.
            lse = torch.logsumexp(torch.stack(lse_parts), dim=0) if lse_parts else torch.full_like(target, float("-inf"))
            if combine_shards is not None:
                lse, target = combine_shards(lse, target)
            total += (torch.where(ignored[rows], 0.0, lse - target) * weights[rows]).sum()
            if not (need_hidden or need_weight or grad_bias is not None):
                continue
            for i, cols in enumerate(chunks):
                if gemms is not None and gemms.takes(cols):  # the gradient made and cast in one pass
                    gemms.gradients(logits[i], block_labels, vocab_start + cols.start, lse, grad_scale[rows], rows, cols,
                                    grad_weight, grad_hidden, several_blocks)  # fmt: skip
                    logits[i] = None
                    continue
                dlogits = chunk_backward(logits[i], block_labels, vocab_start + cols.start, lse, grad_scale[rows])
                logits[i] = None  # free each chunk once its gradients are taken
                if need_weight and several_blocks:
                    grad_weight[cols] += dlogits.t() @ h
                elif need_weight:
                    torch.mm(dlogits.t(), h, out=grad_weight[cols])
                if need_hidden:
                    grad_hidden[rows] += dlogits @ weight[cols]
                if grad_bias is not None:
                    grad_bias[cols] += dlogits.sum(0, dtype=torch.float32)
        if need_weight and several_blocks:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.num_tokens, ctx.hidden_dtype, ctx.fused = n, hidden.dtype, fused
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.param = weight if fuse_weight_grad else None  # the parameter, with its main_grad (see grad_accum_fusion)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        factor = grad_total.float() * ctx.num_tokens
        if grad_bias is not None:
            grad_bias = (grad_bias * factor).to(ctx.bias_dtype)
        if grad_hidden is not None:
            grad_hidden = (grad_hidden * factor).to(ctx.hidden_dtype)
        if grad_weight is not None and ctx.param is not None:
            accumulate_scaled_of(ctx.param, grad_weight, factor, ctx.fused)
            grad_weight = None
        elif grad_weight is not None:
            grad_weight = grad_weight.mul_(factor)  # in place: the stored gradient is ours alone, backward runs once
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor,
    fused_kernels: str = "auto",
    chunk_size: int = 0,
    budget_bytes: int = LOGITS_BUDGET_BYTES,
    vocab_start: int = 0,
    combine_shards: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    fuse_weight_grad: bool = False,
    real_rows: int | None = None,
    bias: torch.Tensor | None = None,
    fp8: Fp8Scaling | None = None,
) -> torch.Tensor:
    """``sum(token_weights * ce)`` (fp32 scalar; label -100 counts 0) of logits ``hidden @ weight.T``
    (``+ bias``, [V] like the weight's rows, when given).

    ``hidden`` [..., h] in the compute dtype, ``weight`` [V, h], ``labels`` and ``token_weights``
    shaped like ``hidden[..., 0]``. Gradients are taken in the forward (3 GEMMs, see the module
    docstring) when autograd needs any; otherwise, and with ``fused_kernels='off'`` (the unfused
    reference), it is the per-token loss summed. ``chunk_size`` (vocabulary rows, 0: automatic)
    and ``budget_bytes`` (logits held at once) are for tests.

    A vocabulary shard (tensor parallelism): ``weight`` holds rows ``vocab_start``.. of the
    vocabulary, ``hidden`` every token, and ``combine_shards(lse, target)`` turns this shard's fp32
    log-sum-exp and target logit (0 where the label lies elsewhere) into the whole vocabulary's (a
    collective); the hidden gradient is then this shard's part, to be summed over shards. Sharded,
    the function runs even without gradients (the per-token fallback knows no shards).

    ``fuse_weight_grad`` (gradient-accumulation fusion, where ``weight`` has a ``main_grad``): the
    weight gradient goes in fp32 straight into ``weight.main_grad``, scaled on the way
    (``accumulate_scaled_of``), instead of back to autograd.

    ``real_rows``: the weight's rows that are tokens (None: all; on a shard, possibly 0); the rest
    is padding, kept out of the softmax, its gradient zero.

    ``fp8``: the output layer's FP8 scaling state (delayed or tensorwise; ``fp8_output``): the three
    GEMMs in FP8 where gradients are taken. Not with a bias (BERT's LM head stays bf16).
    """
    if fp8 is not None and bias is not None:
        raise ValueError("the FP8 output layer takes no bias: a head with a bias (BERT's LM head) stays bf16, give it no FP8 state")
    rows = real_rows_of(weight, real_rows)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if combine_shards is None and (fused_kernels == "off" or not needs_grad):
        if bias is not None:  # the unfused reference: full logits
            logits = F.linear(hidden, weight[:rows], bias[:rows]).float()
            per_token = F.cross_entropy(logits.reshape(-1, rows), labels.reshape(-1), reduction="none").view(labels.shape)
            return (per_token * token_weights).sum()
        return (linear_cross_entropy(hidden, weight, labels, fused_kernels, chunk_size, rows) * token_weights).sum()
    flat = hidden.reshape(-1, hidden.shape[-1])
    block = block_tokens_for(flat.shape[0], rows, flat.element_size(), budget_bytes)
    chunk = chunk_size or default_chunk_size(block, rows)
    fuse_weight_grad = fuse_weight_grad and hasattr(weight, "main_grad") and weight.requires_grad
    if fp8 is not None and block < flat.shape[0]:
        block = max(fp8_output.MULTIPLE, block // fp8_output.MULTIPLE * fp8_output.MULTIPLE)  # FP8 blocks of 16 tokens
    # FP8 in training only (evaluation: the compute dtype, the histories left alone), where the shapes fit.
    fp8 = fp8 if needs_grad and fp8 is not None and fp8_output.fits(fp8, *flat.shape, block, rows) else None
    return _LinearCrossEntropySum.apply(flat, weight, bias, labels.reshape(-1), token_weights.reshape(-1), chunk, block,
                                        use_triton(fused_kernels, flat), vocab_start, combine_shards, fuse_weight_grad, rows, fp8)  # fmt: skip
