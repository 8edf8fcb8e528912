"""The decoder family (``--model-type gpt``): GPT, Llama, mixture of experts, DeepSeek-V2's latent
attention — one ``Decoder`` whose config picks the variant."""

from __future__ import annotations

from meshtron.config import Config, ModelConfig
from meshtron.data.builder import decoder_datasets
from meshtron.inference.sampling import continue_prompt
from meshtron.layers.moe import moe_layer_pattern
from meshtron.models.decoder import Decoder, decoder_layout_errors
from meshtron.models.flops import layer_costs, multiplying_shape
from meshtron.models.hf_decoder import decoder_hf_export
from meshtron.models.mtp import mtp_config_errors
from meshtron.models.registry import BlockShape, FamilySpec, register
from meshtron.models.sizes import model_sizes


def decoder_config_errors(cfg: Config) -> list[str]:
    errors = mtp_config_errors(cfg)
    if cfg.model.position_embedding_type == "relative":
        errors.append("--position-embedding-type relative is T5's relative position buckets; use it with --model-type t5")
    return errors


def decoder_flops_shape(cfg: ModelConfig, vocab_size: int, seq_length: int) -> tuple[int, int]:
    return multiplying_shape(model_sizes(cfg, vocab_size, seq_length).total(active=True), cfg, vocab_size, seq_length)


def decoder_blocks(cfg: Config) -> list[BlockShape]:
    """Every layer on the sample's sequence, the mixture-of-experts ones marked."""
    return [BlockShape(cfg.data.seq_length, moe) for moe in moe_layer_pattern(cfg.model)]


DECODER = register(FamilySpec(
    name="gpt", build=Decoder, layout_errors=decoder_layout_errors, flops_shape=decoder_flops_shape, causal=True,
    pipeline_costs=layer_costs(decoder_flops_shape, causal=True), datasets=decoder_datasets,
    config_errors=decoder_config_errors, block_shapes=decoder_blocks, generate=continue_prompt, hf_export=decoder_hf_export, sft=True, mtp=True,
))  # fmt: skip
