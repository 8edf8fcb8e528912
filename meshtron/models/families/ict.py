"""The retriever (``--model-type ict``): two BERT towers (or one shared) scoring queries against
contexts, one pipeline stage, optionally started from a BERT checkpoint (``--bert-load``)."""

from __future__ import annotations

from meshtron.config import Config
from meshtron.data.builder import ict_datasets
from meshtron.data.masked_lm import ict_data_errors
from meshtron.data.mock_sentences import mock_vocabulary_errors
from meshtron.models import decoder
from meshtron.models.ict import ICT, ict_config_errors, ict_flops_shape
from meshtron.models.registry import BlockShape, FamilySpec, register


def ict_errors(cfg: Config) -> list[str]:
    return ict_config_errors(cfg) + ict_data_errors(cfg.data) + mock_vocabulary_errors(cfg)


def ict_blocks(cfg: Config) -> list[BlockShape]:
    """Every block runs a query and a context (both through the one tower when shared)."""
    towers = 1 if cfg.model.biencoder_shared_query_context_model else 2
    return [BlockShape(cfg.data.seq_length * 2 // towers)] * (towers * cfg.model.num_layers)


ICT_FAMILY = register(FamilySpec(
    name="ict", build=ICT, layout_errors=decoder.decoder_layout_errors, flops_shape=ict_flops_shape, causal=False,
    pipeline_costs=None,  # one stage (ict_config_errors refuses pp): nothing to balance
    datasets=ict_datasets, config_errors=ict_errors, output_tokens=lambda d: 0,  # scores, no vocabulary output
    block_shapes=ict_blocks, sentence_data=True, bert_load=True,
))  # fmt: skip
