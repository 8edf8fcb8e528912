"""BERT (``--model-type bert``): the decoder's blocks attending both ways, with masked-LM and
sentence-order heads, trained on sentence-split data."""

from __future__ import annotations

from meshtron.config import Config, ModelConfig
from meshtron.data.builder import bert_datasets
from meshtron.data.masked_lm import bert_data_errors
from meshtron.models import decoder
from meshtron.models.bert import Bert, bert_config_errors, bert_parameter_count
from meshtron.models.flops import layer_costs, multiplying_shape
from meshtron.models.hf_bert import bert_hf_export
from meshtron.models.rank_parameters import bert_rank_parameters
from meshtron.models.registry import FamilySpec, register


def bert_count(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0, active: bool = False) -> int:
    return bert_parameter_count(cfg, vocab_size, decoder.parameter_count(cfg, vocab_size, max_seq_length, active))


def bert_flops_shape(cfg: ModelConfig, vocab_size: int, seq_length: int) -> tuple[int, int]:
    return multiplying_shape(bert_count(cfg, vocab_size, seq_length, active=True), cfg, vocab_size, seq_length)


def bert_errors(cfg: Config) -> list[str]:
    return bert_config_errors(cfg) + bert_data_errors(cfg.data)


BERT = register(FamilySpec(
    name="bert", build=Bert, parameter_count=bert_count, rank_parameters=bert_rank_parameters,
    layout_errors=decoder.decoder_layout_errors, flops_shape=bert_flops_shape, causal=False,
    pipeline_costs=layer_costs(bert_flops_shape, causal=False), datasets=bert_datasets, config_errors=bert_errors,
    sentence_data=True, hf_export=bert_hf_export,
))  # fmt: skip
