"""The output layer of a language model: hidden states -> logits, or straight to the loss
(per token, or summed under per-token weights: the loss mask).

Its own module (rather than a method of the model) so that a parallel plan can swap it for the
vocabulary-parallel version, and so that a tied model's head holds no weight of its own: the
embedding matrix is handed to it at call time (``tied_weight``), on whichever pipeline stage.

A vocabulary padded to a multiple of ``make_vocab_size_divisible_by`` x tp has rows that stand for
no token: the layer knows the real count (``vocab_size``) and the padded rows take no part in the
logits, the softmax or the loss, so the padding, which changes with tp, never changes a result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.kernels.cross_entropy import linear_cross_entropy
from meshtron.kernels.cross_entropy_sum import linear_cross_entropy_sum
from meshtron.kernels.fp8_scaling import Fp8Scaling

IGNORE_INDEX = -100


def labelled_rows(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of ``hidden`` [..., h] whose label is not -100: ([n, h], their labels [n], their
    flat index [n]). A masked LM labels ~15 % of its positions: the logits of the others are
    never needed (their loss and gradient are zero), so skipping them is exact. Costs one host
    sync (the count)."""
    index = (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, index), labels.reshape(-1).index_select(0, index), index


def labelled_rows_and_weights(hidden: torch.Tensor, labels: torch.Tensor, loss_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``labelled_rows``' rows [n, h] and labels [n], with their ``loss_weights`` [n]."""
    rows, row_labels, index = labelled_rows(hidden, labels)
    return rows, row_labels, loss_weights.reshape(-1).index_select(0, index)


def spread_to_tokens(loss: torch.Tensor, index: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row losses [n] back to ``labels``' shape, zero at the rows ``labelled_rows`` skipped."""
    return loss.new_zeros(labels.numel()).index_copy(0, index, loss).view(labels.shape)


class OutputLayer(nn.Module):
    """``weight`` [rows, h] of its own (untied), or none when the embedding is tied to it; with
    ``bias``, a [rows] bias of its own even when tied (BERT's LM head). The first ``vocab_size``
    rows are tokens (0: all ``rows``), the others padding. ``weight_reused``: several calls of one
    forward use it (multi-token prediction's depths), so, as a tied weight's, its gradients meet in
    autograd and are never written into ``main_grad`` by the loss itself."""

    def __init__(self, hidden_size: int, rows: int, tied: bool, fused_kernels: str = "auto", bias: bool = False,
                 vocab_size: int = 0, weight_reused: bool = False):  # fmt: skip
        super().__init__()
        if not 0 <= vocab_size <= rows:
            raise ValueError(f"a vocabulary of {vocab_size} tokens does not fit {rows} rows")
        self.vocab_size = vocab_size or rows
        self.fused_kernels = fused_kernels
        self.grad_accum_fusion = False  # set by apply_gradient_accumulation_fusion
        self.weight_reused = weight_reused
        self.fp8: Fp8Scaling | None = None  # --fp8-output-layer: the fused loss's GEMMs in FP8 (set by parallel/setup.py)
        self.weight = None if tied else nn.Parameter(torch.empty(rows, hidden_size))
        self.bias = nn.Parameter(torch.zeros(rows)) if bias else None

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                tied_weight: torch.Tensor | None = None, loss_weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Logits [..., vocab_size] (the real tokens' only) without ``labels``; with them, per-token cross-entropy in fp32 (label
        -100 gives 0) without holding the [..., V] logits at once (``kernels/cross_entropy``; with a
        bias, from the full logits of the labelled rows only: the per-token chunks take no bias). With ``loss_weights`` (shaped
        like ``labels``) the fp32 scalar ``sum(loss_weights * loss)`` instead, its gradients taken
        in the forward (``kernels/cross_entropy_sum``: one logits GEMM fewer; with a bias, over
        the labelled rows only, the bias in each chunk's GEMM)."""
        weight = self.weight if self.weight is not None else tied_weight
        real = self.vocab_size
        if labels is None:
            return F.linear(hidden, weight[:real], None if self.bias is None else self.bias[:real])
        if loss_weights is not None and (self.bias is None or self.fused_kernels != "off"):
            if self.bias is not None:  # a masked LM: its labelled rows only
                hidden, labels, loss_weights = labelled_rows_and_weights(hidden, labels, loss_weights)
            fuse = self.grad_accum_fusion and self.weight is not None and not self.weight_reused  # a tied weight's two gradients meet in autograd
            return linear_cross_entropy_sum(hidden, weight, labels, loss_weights, self.fused_kernels, fuse_weight_grad=fuse, real_rows=real,
                                            bias=self.bias, fp8=self.fp8)  # fmt: skip
        if self.bias is not None:
            rows, row_labels, index = labelled_rows(hidden, labels)
            logits = F.linear(rows, weight[:real], self.bias[:real])
            loss = spread_to_tokens(F.cross_entropy(logits.float(), row_labels, reduction="none"), index, labels)
            return loss if loss_weights is None else (loss * loss_weights).sum()
        return linear_cross_entropy(hidden, weight, labels, self.fused_kernels, real_rows=real)
