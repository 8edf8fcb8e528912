"""Model construction: the one place the training loop, checkpoints and tools get a model from."""

from __future__ import annotations

from meshtron.config import ModelConfig
from meshtron.models.contract import ModelFamily
from meshtron.models.decoder import Decoder, decoder_layout_errors, num_parameters, parameter_count

__all__ = ["build_model", "model_layout_errors", "num_parameters", "padded_vocab_size", "parameter_count"]


def build_model(model_cfg: ModelConfig, vocab_size: int, max_seq_length: int) -> ModelFamily:
    """The model for ``model_cfg``, initialized from the seed last given to ``torch.manual_seed``.

    ``vocab_size`` is the embedding's row count: pass ``padded_vocab_size(...)`` of the
    tokenizer's size (or ``model_cfg.vocab_size`` when set) so every parallel layout agrees.
    """
    return Decoder(model_cfg, vocab_size, max_seq_length)


def model_layout_errors(model_cfg: ModelConfig, tp: int) -> list[str]:
    """Why the model's shapes cannot be split over ``tp`` tensor-parallel ranks (empty if they can)."""
    return decoder_layout_errors(model_cfg, tp)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int = 1) -> int:
    """Round ``vocab_size`` up to a multiple of ``divisible_by * tensor_parallel`` (Megatron's rule).

    Padding keeps the output GEMM's shape friendly to tensor cores and lets the vocabulary split
    evenly across tensor-parallel ranks; the extra rows are never a label.
    """
    multiple = max(1, divisible_by) * tensor_parallel
    return -(-vocab_size // multiple) * multiple
