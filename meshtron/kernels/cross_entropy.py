"""Output projection + cross-entropy that never holds the [tokens, vocab] logits at once.

With a 128 K vocabulary, the logits of 16 K tokens are 4 GiB in bf16, and the unfused loss
upcasts them to fp32 (8 GiB) and keeps a gradient of the same size: the largest activation of
a Llama-3 model. Here the vocabulary is cut into chunks. The forward pass computes one chunk of
logits at a time in the compute dtype (as ``F.linear`` would), folds it into a running fp32
log-sum-exp and the target logit, and keeps only those ([tokens] floats). The backward pass
recomputes each chunk of logits, turns it in place into its gradient
``(softmax - onehot) * grad_loss`` with the saved log-sum-exp, and takes the two gradient GEMMs
from it: the weight gradient of that vocabulary slice (complete: it sums over all tokens) and a
partial hidden-state gradient, summed over chunks in fp32.

The recompute costs one extra logits GEMM; it buys exactness for any upstream gradient (a
per-token loss may be masked and weighted by the caller after this returns). Where the caller
only wants the masked sum, ``cross_entropy_sum`` skips the recompute.

The per-chunk elementwise steps are the only part a kernel fuses (``triton_pointwise``); the
reference does them with PyTorch ops on an fp32 copy of the chunk.

A padded vocabulary (rows added so the table splits over tp) names its real rows
(``real_rows``): the chunks stop there, so padded rows never enter the softmax (their logits are
never computed) and their weight gradient is zero. Any padding thus gives the unpadded loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtron.kernels import use_triton

IGNORE_INDEX = -100
# Elements of one chunk of logits: 2**28 (512 MiB in bf16; 8 chunks for 16 K tokens of a 128 K
# vocabulary) keeps the GEMMs large and the per-chunk fp32 sums of the hidden gradient few; the
# reference path's fp32 temporaries of a chunk are then about 2 GiB.
CHUNK_ELEMENTS = 2**28


def default_chunk_size(num_tokens: int, vocab_size: int) -> int:
    """Vocabulary rows per chunk for ``num_tokens`` tokens: a multiple of 256, at most the vocabulary
    (at least 1: a vocabulary shard holding only padding has no chunk, but a step of 0 is no range)."""
    rows = max(256, (CHUNK_ELEMENTS // max(1, num_tokens)) // 256 * 256)
    return max(1, min(vocab_size, rows))


def chunk_forward_reference(logits: torch.Tensor, labels: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (log-sum-exp, target logit) of each row of one chunk (columns ``start``.. of the vocabulary).

    The target logit is 0 for rows whose label falls outside the chunk.
    """
    x = logits.float()
    local = labels - start
    inside = (local >= 0) & (local < x.shape[1])
    target = x.gather(1, local.clamp(0, x.shape[1] - 1)[:, None]).squeeze(1)
    return torch.logsumexp(x, dim=1), torch.where(inside, target, 0.0)


def chunk_backward_reference(
    logits: torch.Tensor, labels: torch.Tensor, start: int, lse: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """``(softmax - onehot(label)) * grad`` of one chunk, in the logits' dtype (written in place)."""
    x = logits.float()
    probs = torch.exp(x - lse[:, None])
    local = labels - start
    inside = (local >= 0) & (local < x.shape[1])
    probs.scatter_add_(1, local.clamp(0, x.shape[1] - 1)[:, None], -inside.to(probs.dtype)[:, None])
    logits.copy_(probs * grad[:, None])
    return logits


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, fused, real_rows):
        if fused:
            from meshtron.kernels.triton_pointwise import ce_chunk_forward as chunk_forward
        else:
            chunk_forward = chunk_forward_reference
        lse_parts, target = [], hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
        for start in range(0, real_rows, chunk_size):
            logits = hidden @ weight[start : min(start + chunk_size, real_rows)].t()
            lse, tgt = chunk_forward(logits, labels, start)
            lse_parts.append(lse)
            target += tgt
        lse = torch.logsumexp(torch.stack(lse_parts), dim=0)
        loss = torch.where(labels == IGNORE_INDEX, 0.0, lse - target)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_size, ctx.fused, ctx.real_rows = chunk_size, fused, real_rows
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        if ctx.fused:
            from meshtron.kernels.triton_pointwise import ce_chunk_backward as chunk_backward
        else:
            chunk_backward = chunk_backward_reference
        grad = torch.where(labels == IGNORE_INDEX, 0.0, grad_loss.float())
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        rows = ctx.real_rows
        grad_weight = padded_grad(weight, rows) if need_weight else None
        for start in range(0, rows, ctx.chunk_size):
            w = weight[start : min(start + ctx.chunk_size, rows)]
            dlogits = chunk_backward(hidden @ w.t(), labels, start, lse, grad)
            if need_weight:
                torch.mm(dlogits.t(), hidden, out=grad_weight[start : start + w.shape[0]])
            if need_hidden:
                grad_hidden += dlogits @ w
        if need_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def real_rows_of(weight: torch.Tensor, real_rows: int | None) -> int:
    """The rows of ``weight`` that are tokens (None: all); an early error for a count outside it."""
    if real_rows is None:
        return weight.shape[0]
    if not 0 <= real_rows <= weight.shape[0]:
        raise ValueError(f"real_rows {real_rows} outside the weight's {weight.shape[0]} rows")
    return real_rows


def padded_grad(weight: torch.Tensor, real_rows: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A weight-gradient buffer whose padded rows (from ``real_rows`` on) are zero and stay so."""
    if real_rows == weight.shape[0]:
        return torch.empty_like(weight, dtype=dtype)
    return torch.zeros_like(weight, dtype=dtype)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, fused_kernels: str = "auto", chunk_size: int = 0,
    real_rows: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Per-token cross-entropy [*labels.shape] (fp32; label -100 gives 0) of logits ``hidden @ weight.T``.

    ``hidden`` [..., h] in the compute dtype, ``weight`` [V, h]. ``fused_kernels='off'`` is the
    unfused reference (full logits, fp32 loss); otherwise the chunked path, its elementwise steps
    in Triton where ``use_triton`` says so. ``chunk_size`` (vocabulary rows, 0: automatic) is for tests.
    ``real_rows``: the weight's rows that are tokens (None: all); the rest is padding, kept out of
    the softmax, its gradient zero. Labels must lie below it.
    """
    rows = real_rows_of(weight, real_rows)
    if fused_kernels == "off":
        logits = F.linear(hidden, weight[:rows]).float()
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        return loss.view(labels.shape)
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk_size or default_chunk_size(flat.shape[0], rows)
    loss = _LinearCrossEntropy.apply(flat, weight, labels.reshape(-1), chunk, use_triton(fused_kernels, flat), rows)
    return loss.view(labels.shape)
