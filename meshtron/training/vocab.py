"""The run's tokenizer and the model's vocabulary size, one rule for training and ``estimate``.

Real data needs its tokenizer (for the end-of-document id). With ``--mock-data`` a named
tokenizer still sizes the vocabulary, as in Megatron, so a mock run of a Llama 3 config has
Llama 3's embedding table; with none, ``--vocab-size`` (default 32000) does.
"""

from __future__ import annotations

from meshtron.config import Config
from meshtron.data.tokenizers import Tokenizer, build_tokenizer
from meshtron.models import padded_vocab_size

MOCK_DEFAULT_VOCAB = 32000


def run_tokenizer(cfg: Config) -> Tokenizer | None:
    """The tokenizer ``cfg.data`` names, or None for mock data that names none."""
    d = cfg.data
    if d.mock and not d.tokenizer_type:
        return None
    try:
        return build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file, d.vocab_extra_ids)
    except (ValueError, FileNotFoundError) as exc:
        if not d.mock:
            raise
        raise type(exc)(f"{exc} (with --mock-data the tokenizer only sizes the vocabulary: drop --tokenizer-type and "
                        f"--tokenizer-model and set --vocab-size instead)") from exc  # fmt: skip


def token_vocab_size(cfg: Config, tokenizer: Tokenizer | None) -> int:
    """Tokens the model knows: the tokenizer's vocabulary plus ``--extra-vocab-size`` (or
    ``--vocab-size`` when larger). Mock data draws below it; no padding."""
    m = cfg.model
    base = tokenizer.vocab_size + m.extra_vocab_size if tokenizer else (m.vocab_size or MOCK_DEFAULT_VOCAB)
    if m.vocab_size and tokenizer and m.vocab_size < base:
        raise ValueError(f"--vocab-size {m.vocab_size} is smaller than the tokenizer's {base}")
    return max(m.vocab_size, base)


def model_vocab_size(cfg: Config, tokenizer: Tokenizer | None) -> int:
    """Rows of the embedding table: ``token_vocab_size`` padded to ``--make-vocab-size-divisible-by``
    x tp. The padded rows are in no softmax, loss or logit (``layers/output.py``)."""
    m = cfg.model
    return padded_vocab_size(token_vocab_size(cfg, tokenizer), m.make_vocab_size_divisible_by, cfg.parallel.tensor_parallel)
