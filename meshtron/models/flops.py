"""Training FLOPs: the one formula the project counts them with, and the shapes families feed it.

Throughput (MFU), the pipeline's cost-balanced split and benchmarks all count FLOPs here, so the
numbers they report agree. A family gives its ``flops_shape`` (or, where one shape cannot say it,
a ``flops_per_token`` of its own: T5's two sequences), and its ``pipeline_costs``.
"""

from __future__ import annotations

from collections.abc import Callable

from meshtron.config import ModelConfig
from meshtron.models.sizes import model_sizes
from meshtron.parallel.pipeline_balance import PipelineCosts


def flops_per_token(num_params: int, num_layers: int, seq_length: int, hidden_size: int, causal: bool = True) -> float:
    """Training FLOPs per token of a causal decoder: ``6 P + 6 L S h``.

    ``6 P``: forward (2) and backward (4) through every parameter, the tied embedding counted once
    as the output projection. ``6 L S h``: the attention score and value products, halved for
    causality (12 L S h / 2); an encoder (``causal=False``) attends to every key: ``12 L S h``.
    """
    return 6.0 * num_params + (6.0 if causal else 12.0) * num_layers * seq_length * hidden_size


def multiplying_shape(count: int, cfg: ModelConfig, vocab_size: int, seq_length: int) -> tuple[int, int]:
    """``(P, L)`` from a model's parameter ``count`` (``models.sizes``; MoE layers counted by their active experts):
    all but the lookups (an untied input embedding, learned positions), which multiply nothing; a
    tied table counts once, as the output projection."""
    params = count - (0 if cfg.tie_embeddings else vocab_size * cfg.hidden_size)
    if cfg.position_embedding_type == "learned_absolute":
        params -= (cfg.max_position_embeddings or seq_length) * cfg.hidden_size
    return params, cfg.num_layers + cfg.mtp_num_layers  # a multi-token prediction depth attends like a layer


def layer_costs(flops_shape: Callable[[ModelConfig, int, int], tuple[int, int]], causal: bool):
    """The pipeline cost model of a family whose blocks are the decoder's layers and whose head is
    one vocabulary projection (``flops_shape`` its token's shape): a block ``6 P + 6 S h`` (``12 S
    h`` when it attends both ways; ``P`` its parameters a token passes, so MoE layers count their
    active experts), the head ``6 V h`` and its final norm's (the loss's elementwise work is not
    counted), the embedding nothing: together the family's ``flops_per_token``."""

    def costs(cfg: ModelConfig, vocab_size: int, seq_length: int) -> PipelineCosts:
        h = cfg.hidden_size
        layers = model_sizes(cfg, vocab_size, seq_length).block_counts(active=True)
        blocks = [flops_per_token(p, 1, seq_length, h, causal) for p in layers]
        head = flops_shape(cfg, vocab_size, seq_length)[0] - sum(layers)  # output layer (tied or not), final norm
        return PipelineCosts(embed=0.0, blocks=blocks, head=flops_per_token(head, 0, seq_length, h))

    return costs
