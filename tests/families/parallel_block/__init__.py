"""The parallel-block family (``model.py``) and its registration: ``--model-type
tests.families.parallel_block:parallel_block`` imports this package, which registers it."""

from __future__ import annotations

from meshtron.config import Config, ModelConfig
from meshtron.data.builder import decoder_datasets
from meshtron.models.decoder import decoder_layout_errors
from meshtron.models.registry import FamilySpec, register
from meshtron.models.sizes import model_sizes
from tests.families.parallel_block.model import ParallelBlockDecoder


def flops_shape(cfg: ModelConfig, vocab_size: int, seq_length: int) -> tuple[int, int]:
    """All but the input embedding (a lookup) multiply a token's activations; every layer attends."""
    return model_sizes(cfg, vocab_size, seq_length).total() - vocab_size * cfg.hidden_size, cfg.num_layers


def config_errors(cfg: Config) -> list[str]:
    m = cfg.model
    return ["parallel_block is dense with standard attention; drop --num-experts / --multi-latent-attention"] if m.num_experts or m.multi_latent_attention else []


PARALLEL_BLOCK = register(FamilySpec(
    name="parallel_block", build=ParallelBlockDecoder, layout_errors=decoder_layout_errors, flops_shape=flops_shape, causal=True, pipeline_costs=None,  # the even split
    datasets=decoder_datasets, config_errors=config_errors,
))  # fmt: skip
