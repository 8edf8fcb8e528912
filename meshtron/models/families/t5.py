"""T5 (``--model-type t5``): an encoder and a decoder stack in one ``layers`` list, over two
sequences (the encoder's and the decoder's), trained on span-corrupted sentences."""

from __future__ import annotations

from meshtron.config import Config, encoder_decoder_layers
from meshtron.data.builder import t5_datasets
from meshtron.data.masked_lm import t5_data_errors
from meshtron.data.mock_sentences import mock_vocabulary_errors
from meshtron.inference.sampling import fill_sentinels
from meshtron.models.decoder import decoder_layout_errors
from meshtron.models.registry import BlockShape, FamilySpec, register
from meshtron.models.t5 import T5, t5_config_errors, t5_flops_per_token


def t5_errors(cfg: Config) -> list[str]:
    return t5_config_errors(cfg) + t5_data_errors(cfg.data) + mock_vocabulary_errors(cfg)


def t5_blocks(cfg: Config) -> list[BlockShape]:
    """Encoder blocks on the encoder's tokens, then decoder blocks on the decoder's, whose
    cross-attention reads the encoder's."""
    encoder, decoder = encoder_decoder_layers(cfg.model)
    seq, dec = cfg.data.seq_length, cfg.data.decoder_seq_length
    return [BlockShape(seq)] * encoder + [BlockShape(dec, cross_tokens=seq)] * decoder


T5_FAMILY = register(FamilySpec(
    name="t5", build=T5, layout_errors=decoder_layout_errors,
    flops_shape=None, flops_per_token=t5_flops_per_token, causal=True,  # its decoder; the FLOPs count both stacks
    # Two kinds of blocks over two sequences, and relative positions pin the split (t5_config_errors): the even split.
    pipeline_costs=None, datasets=t5_datasets, config_errors=t5_errors,
    num_blocks=lambda m: sum(encoder_decoder_layers(m)),
    sample_tokens=lambda d: d.seq_length + d.decoder_seq_length, output_tokens=lambda d: d.decoder_seq_length,
    block_shapes=t5_blocks, sentence_data=True, generate=fill_sentinels,
))  # fmt: skip
