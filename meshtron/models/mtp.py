"""Multi-token prediction (DeepSeek-V3's MTP; Megatron-Core's ``--mtp-num-layers``): after the
last block, depth k (1..D) predicts the token k + 1 positions ahead.

Depth k takes the previous depth's normalized hidden states (for k = 1 the main model's, after
its final norm, as Megatron-Core and DeepSeek's inference code feed them) and the embedding of
the tokens shifted by k, normalizes each (``hnorm``, ``enorm``), projects their concatenation
``[embedding | hidden]`` back to the model's width (``eh_proj``) and runs one transformer block
of the model's own kind (MLA and MoE for DeepSeek); its final norm and the model's shared output
layer give the loss against the labels shifted by k. The embedding and the output layer are the
main model's (under pipeline parallelism the last stage holds a copy of the embedding, as of a
tied one). Depth k's loss is a per-micro-batch mean over the shifted loss mask; the depths'
mean, times ``--mtp-loss-scaling-factor``, is the objective's auxiliary term, logged per depth
(``mtp_loss/k``, each already times factor / D). Generation never runs it.

The shifted tokens, labels and mask are cut from the whole sequence before context parallelism
cuts the batch (``shifted_targets``, the family's ``prepare_batch``): a context-parallel rank's
last positions need the first tokens of the next rank's chunk, which the whole sequence has. The
last k positions (and, with ``document_ids``, those whose target lies in the next document) have
no target at depth k: their mask is 0 and their token 0. A depth's loss sum and count are
summed over the context-parallel ranks (``LossSums``, the plan's ``SequenceSum(over_tp=False)``);
the tensor-parallel ranks already hold the whole sum (the output layer gathers the sequence).

Hugging Face's DeepSeek-V3 files hold depth k as layer ``num_hidden_layers + k - 1`` with
``enorm``, ``hnorm``, ``eh_proj``, the block's tensors, ``shared_head.norm`` (our
``final_norm``) and copies of the embedding and output layer (``models/hf_deepseek_v3.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshtron.config import Config, ModelConfig
from meshtron.layers.norms import build_norm
from meshtron.models import contract as c
from meshtron.models.sizes import model_sizes

BLOCK_PREFIX = "layers.*."  # the decoder plan's patterns for its blocks, repeated for each depth's block


def target_keys(depth: int) -> tuple[str, str, str]:
    """The batch keys of depth ``depth``'s input tokens, labels and loss mask."""
    return f"mtp_tokens_{depth}", f"mtp_labels_{depth}", f"mtp_loss_mask_{depth}"


def _shifted(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` [b, s] moved k positions left, the last k filled with 0."""
    out = torch.zeros_like(t)
    out[:, : t.shape[1] - k] = t[:, k:]
    return out


def shifted_targets(batch: c.Batch, depths: int) -> c.Batch:
    """``batch`` with each depth's inputs and targets (``target_keys``), from the whole sequence:
    depth k at position i reads token i + k and predicts label i + k, where the loss mask at
    i + k allows it and, with ``document_ids``, i + k is in i's document. Unchanged without
    labels and a loss mask (generation, direct calls)."""
    if not depths or batch.get("labels") is None or batch.get("loss_mask") is None:
        return batch
    out = dict(batch)
    documents = batch.get("document_ids")
    for k in range(1, depths + 1):
        mask = _shifted(batch["loss_mask"], k)
        if documents is not None:
            mask = mask * (_shifted(documents, k) == documents).to(mask.dtype)
        tokens, labels, loss_mask = target_keys(k)
        out.update({tokens: _shifted(batch["tokens"], k), labels: _shifted(batch["labels"], k), loss_mask: mask})
    return out


class LossSums(nn.Module):
    """A depth's (loss sum, count) over the micro batch from this rank's tokens: the same in one
    process; under context parallelism the plan replaces it by the sum over the cp ranks
    (``SequenceSum(over_tp=False)``: every tp rank already holds the whole sums)."""

    def forward(self, sums: torch.Tensor) -> torch.Tensor:
        return sums


class PredictionDepth(nn.Module):
    """One depth: ``enorm``, ``hnorm``, ``eh_proj`` [h, 2h], the model's kind of ``layer``, and
    ``final_norm`` before the shared output layer."""

    def __init__(self, cfg: ModelConfig, layer: nn.Module):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = build_norm(cfg.normalization, h, cfg.norm_epsilon, cfg.fused_kernels)
        self.hnorm = build_norm(cfg.normalization, h, cfg.norm_epsilon, cfg.fused_kernels)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = layer
        self.final_norm = build_norm(cfg.normalization, h, cfg.norm_epsilon, cfg.fused_kernels)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """The previous depth's normalized hidden states and the shifted tokens' embedding -> this
        depth's, normalized (what the output layer and the next depth read); ``inputs``: what every block reads."""
        joined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        return self.final_norm(self.layer(self.eh_proj(joined), **inputs))


def depth_loss(sums: nn.Module, total: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale`` x the micro batch's mean loss of one depth: its loss sum ``total`` (fp32) over
    the count of ``mask``, both completed over the ranks holding other tokens (``sums``)."""
    total, count = sums(torch.stack([total.float(), mask.sum().float()])).unbind()
    return scale * total / count.clamp(min=1)


def mtp_plan(block_plan: c.Plan, depths: int) -> c.Plan:
    """The depths' entries: each block split as the model's blocks are (``block_plan``'s
    ``layers.*.`` patterns under ``mtp.*.layer.``); the norms and ``eh_proj`` whole on every tp
    rank (under sequence parallelism on the rank's tokens, gradients summed over tp, as MLA's
    down-projections); the loss sums over cp."""
    if not depths:
        return []
    blocks = [("mtp.*.layer." + p.removeprefix(BLOCK_PREFIX), s) for p, s in block_plan if p.startswith(BLOCK_PREFIX)]
    whole = [(f"mtp.*.{name}", c.SequenceParallelNorm()) for name in ("enorm", "hnorm", "eh_proj", "final_norm")]
    return [*blocks, *whole, ("mtp_loss_sums", c.SequenceSum(over_tp=False))]


def mtp_parameter_count(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0) -> int:
    """The prediction depths' own parameters (the embedding and output layer are the model's),
    read off the meta-built model (``models/sizes.py``)."""
    return sum(p.numel for p in model_sizes(cfg, vocab_size, max_seq_length).params if p.name.startswith("mtp."))


def mtp_config_errors(cfg: Config) -> list[str]:
    """What multi-token prediction does not take, each naming the flag."""
    m = cfg.model
    errors = []
    if m.mtp_num_layers < 0:
        errors.append(f"--mtp-num-layers must be 0 (off) or a positive number of depths, got {m.mtp_num_layers}")
    if m.mtp_num_layers > 0 and m.position_embedding_type == "learned_absolute":
        errors.append("--mtp-num-layers: the prediction depths embed shifted tokens without learned positions; use "
                      "--position-embedding-type rope with it")  # fmt: skip
    if m.mtp_num_layers > 0 and m.mtp_loss_scaling_factor < 0:
        errors.append(f"--mtp-loss-scaling-factor must not be negative, got {m.mtp_loss_scaling_factor}")
    return errors
