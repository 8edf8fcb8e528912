"""Model construction and the questions code outside ``models/`` asks about a model, each answered
by its family's spec (``registry.py``; the built-in families in ``families/``).

``model.model_type`` picks the family (Megatron users pick the ``pretrain_*.py`` script): ``gpt``
is the decoder (GPT, Llama, mixture of experts), ``bert`` the encoder of ``models/bert.py``, ``t5``
the encoder–decoder of ``models/t5.py``, ``ict`` the retriever of ``models/ict.py`` (two BERT towers).
"""

from __future__ import annotations

from meshtron.config import Config, ModelConfig
from meshtron.models.contract import ModelFamily
from meshtron.models.decoder import num_parameters
from meshtron.models.flops import flops_per_token
from meshtron.models.registry import FamilySpec, family, family_error, family_names, register, spec_for
from meshtron.models.sizes import model_sizes
from meshtron.models import families  # noqa: F401  (registers the built-in families)

__all__ = ["FamilySpec", "build_model", "family", "family_error", "family_names", "flops_per_token", "flops_shape",
           "model_config_errors", "model_flops_per_token", "model_layout_errors", "num_blocks", "num_parameters", "padded_vocab_size",
           "parameter_count", "pipeline_costs", "register", "sample_tokens", "spec_for"]  # fmt: skip


def build_model(model_cfg: ModelConfig, vocab_size: int, max_seq_length: int, padded_vocab_size: int = 0) -> ModelFamily:
    """The model for ``model_cfg``, initialized from the seed last given to ``torch.manual_seed``.

    ``vocab_size`` is the tokens' count (the tokenizer's, or ``model_cfg.vocab_size`` when set);
    ``padded_vocab_size`` the embedding's rows (0: as many), ``padded_vocab_size(...)`` of it for
    the run's tp. The padded rows take no part in any result, so every layout agrees.
    """
    return spec_for(model_cfg).build(model_cfg, vocab_size, max_seq_length, padded_vocab_size)


def model_config_errors(cfg: Config) -> list[str]:
    """Why ``cfg`` does not fit its family (empty when it does), each naming the flag to change."""
    spec = spec_for(cfg.model)
    errors = spec.config_errors(cfg)
    if cfg.checkpoint.bert_load and not spec.bert_load:
        names = " or ".join(name for name in family_names() if family(name).bert_load)
        errors.append(f"--bert-load starts the ICT retriever's towers; use it with --model-type {names}")
    return errors


def model_layout_errors(model_cfg: ModelConfig, tp: int) -> list[str]:
    """Why the model's shapes cannot be split over ``tp`` tensor-parallel ranks (empty if they can)."""
    return spec_for(model_cfg).layout_errors(model_cfg, tp)


def parameter_count(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0, active: bool = False) -> int:
    """``num_parameters(build_model(cfg, vocab_size, max_seq_length))``, read off the model built on
    the meta device (``sizes.model_sizes``: no storage, cached per config); with ``active`` a routed
    expert counts only the top-k share of it a token passes (shared experts whole)."""
    return model_sizes(cfg, vocab_size, max_seq_length).total(active)


def flops_shape(cfg: ModelConfig, vocab_size: int, seq_length: int) -> tuple[int, int]:
    """``(P, L)`` of ``flops_per_token`` for one token of a sample: the parameters that multiply its
    activations (all but lookups: an untied input embedding, learned positions; MoE layers count
    their active experts) and the layers it attends through (the family's ``flops_shape``)."""
    shape = spec_for(cfg).flops_shape
    if shape is None:
        raise ValueError(f"--model-type {cfg.model_type} counts its FLOPs per sample (model_flops_per_token), not by one shape")
    return shape(cfg, vocab_size, seq_length)


def model_flops_per_token(cfg: ModelConfig, vocab_size: int, seq_length: int, decoder_seq_length: int = 0) -> float:
    """Training FLOPs per token of a sample (``flops.flops_per_token`` of the family's shape, or its
    own count: T5's per encoder or decoder token)."""
    spec = spec_for(cfg)
    if spec.flops_per_token is not None:
        return spec.flops_per_token(cfg, vocab_size, seq_length, decoder_seq_length)
    params, layers = spec.flops_shape(cfg, vocab_size, seq_length)
    return flops_per_token(params, layers, seq_length, cfg.hidden_size, spec.causal)


def sample_tokens(cfg: Config) -> int:
    """Tokens of one training sample (T5: its encoder's and its decoder's)."""
    return spec_for(cfg.model).sample_tokens(cfg.data)


def num_blocks(m: ModelConfig) -> int:
    """Blocks the pipeline splits (T5: its encoder's and its decoder's, in one sequence)."""
    return spec_for(m).num_blocks(m)


def pipeline_costs(cfg: ModelConfig, vocab_size: int, seq_length: int):
    """The modeled cost of each piece the pipeline splits (``pipeline_balance.PipelineCosts``), or
    None for a family that declares the even split."""
    costs = spec_for(cfg).pipeline_costs
    return None if costs is None else costs(cfg, vocab_size, seq_length)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int = 1) -> int:
    """Round ``vocab_size`` up to a multiple of ``divisible_by * tensor_parallel`` (Megatron's rule).

    Padding keeps the output GEMM's shape friendly to tensor cores and lets the vocabulary split
    evenly across tensor-parallel ranks; the extra rows are never a label.
    """
    multiple = max(1, divisible_by) * tensor_parallel
    return -(-vocab_size // multiple) * multiple
