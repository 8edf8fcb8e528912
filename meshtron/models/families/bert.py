"""BERT (``--model-type bert``): the decoder's blocks attending both ways, with masked-LM and
sentence-order heads, trained on sentence-split data."""

from __future__ import annotations

from meshtron.config import Config, ModelConfig
from meshtron.data.builder import bert_datasets
from meshtron.data.masked_lm import bert_data_errors
from meshtron.data.mock_sentences import mock_vocabulary_errors
from meshtron.models import decoder
from meshtron.models.bert import Bert, bert_config_errors
from meshtron.models.flops import layer_costs, multiplying_shape
from meshtron.models.hf_bert import bert_hf_export
from meshtron.models.registry import FamilySpec, register
from meshtron.models.sizes import model_sizes


def bert_flops_shape(cfg: ModelConfig, vocab_size: int, seq_length: int) -> tuple[int, int]:
    return multiplying_shape(model_sizes(cfg, vocab_size, seq_length).total(active=True), cfg, vocab_size, seq_length)


def bert_errors(cfg: Config) -> list[str]:
    return bert_config_errors(cfg) + bert_data_errors(cfg.data) + mock_vocabulary_errors(cfg)


BERT = register(FamilySpec(
    name="bert", build=Bert, layout_errors=decoder.decoder_layout_errors, flops_shape=bert_flops_shape, causal=False,
    pipeline_costs=layer_costs(bert_flops_shape, causal=False), datasets=bert_datasets, config_errors=bert_errors,
    sentence_data=True, hf_export=bert_hf_export,
))  # fmt: skip
