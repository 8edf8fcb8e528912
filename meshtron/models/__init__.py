"""Model construction: the one place the training loop, checkpoints and tools get a model from.

``model.model_type`` picks the family (Megatron users pick the ``pretrain_*.py`` script): ``gpt``
is the decoder (GPT, Llama, mixture of experts), ``bert`` the encoder of ``models/bert.py``, ``t5``
the encoder–decoder of ``models/t5.py``, ``ict`` the retriever of ``models/ict.py`` (two BERT towers).
"""

from __future__ import annotations

from meshtron.config import Config, ModelConfig
from meshtron.models import decoder
from meshtron.models.bert import Bert, bert_config_errors, bert_parameter_count
from meshtron.models.contract import ModelFamily
from meshtron.models.decoder import Decoder, decoder_layout_errors, layer_parameter_counts, num_parameters
from meshtron.models.ict import ICT, ict_config_errors, ict_flops_shape, ict_parameter_count
from meshtron.models.t5 import T5, t5_config_errors, t5_parameter_count

__all__ = ["MODEL_TYPES", "attends_causally", "build_model", "flops_shape", "layer_parameter_counts", "model_config_errors", "model_layout_errors",
           "num_parameters", "padded_vocab_size", "parameter_count"]  # fmt: skip

MODEL_TYPES = {"gpt": Decoder, "bert": Bert, "t5": T5, "ict": ICT}
_CONFIG_ERRORS = {"bert": bert_config_errors, "t5": t5_config_errors, "ict": ict_config_errors}
_PARAMETER_COUNTS = {"bert": bert_parameter_count, "ict": ict_parameter_count}


def build_model(model_cfg: ModelConfig, vocab_size: int, max_seq_length: int, padded_vocab_size: int = 0) -> ModelFamily:
    """The model for ``model_cfg``, initialized from the seed last given to ``torch.manual_seed``.

    ``vocab_size`` is the tokens' count (the tokenizer's, or ``model_cfg.vocab_size`` when set);
    ``padded_vocab_size`` the embedding's rows (0: as many), ``padded_vocab_size(...)`` of it for
    the run's tp. The padded rows take no part in any result, so every layout agrees.
    """
    return MODEL_TYPES[model_cfg.model_type](model_cfg, vocab_size, max_seq_length, padded_vocab_size)


def model_config_errors(cfg: Config) -> list[str]:
    """Why ``cfg`` does not fit its model type (empty when it does), each naming the flag to change."""
    kind = cfg.model.model_type
    if kind not in MODEL_TYPES:
        return [f"--model-type must be one of {sorted(MODEL_TYPES)}, got '{kind}'"]
    return _CONFIG_ERRORS[kind](cfg) if kind in _CONFIG_ERRORS else []


def model_layout_errors(model_cfg: ModelConfig, tp: int) -> list[str]:
    """Why the model's shapes cannot be split over ``tp`` tensor-parallel ranks (empty if they can).
    Every family splits the decoder's attention and MLP blocks, so their rules are the decoder's
    (T5's cross-attention splits by the same heads)."""
    return decoder_layout_errors(model_cfg, tp)


def parameter_count(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0, active: bool = False) -> int:
    """``num_parameters(build_model(cfg, vocab_size, max_seq_length))`` without building it (``active``:
    a mixture-of-experts layer counts only the experts a token passes); see ``decoder.parameter_count``."""
    if cfg.model_type == "t5":
        return t5_parameter_count(cfg, vocab_size, max_seq_length)
    count = decoder.parameter_count(cfg, vocab_size, max_seq_length, active)
    extra = _PARAMETER_COUNTS.get(cfg.model_type)
    return extra(cfg, vocab_size, count) if extra else count


def flops_shape(cfg: ModelConfig, vocab_size: int, seq_length: int) -> tuple[int, int]:
    """``(P, L)`` of ``flops_per_token`` for one token of a sample: the parameters that multiply its
    activations (all but lookups: an untied input embedding, learned positions; MoE layers count
    their active experts) and the layers it attends through. The retriever runs two sequences per
    sample through its towers (``ict_flops_shape``)."""
    if cfg.model_type == "ict":
        return ict_flops_shape(cfg, vocab_size, seq_length, decoder.parameter_count(cfg, vocab_size, seq_length))
    params = parameter_count(cfg, vocab_size, seq_length, active=True)
    if not cfg.tie_embeddings:
        params -= vocab_size * cfg.hidden_size
    if cfg.position_embedding_type == "learned_absolute":
        params -= (cfg.max_position_embeddings or seq_length) * cfg.hidden_size
    return params, cfg.num_layers


def attends_causally(cfg: ModelConfig) -> bool:
    """Whether a token attends only to earlier ones (decoders), which halves attention FLOPs."""
    return cfg.model_type not in ("bert", "ict")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int = 1) -> int:
    """Round ``vocab_size`` up to a multiple of ``divisible_by * tensor_parallel`` (Megatron's rule).

    Padding keeps the output GEMM's shape friendly to tensor cores and lets the vocabulary split
    evenly across tensor-parallel ranks; the extra rows are never a label.
    """
    multiple = max(1, divisible_by) * tensor_parallel
    return -(-vocab_size // multiple) * multiple
