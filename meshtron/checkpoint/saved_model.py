"""The model and tokenizer a ``--save`` directory describes, rebuilt in one process: what
``generate``, ``finetune`` and ``evaluate-retrieval`` start from.

Everything needed is in the checkpoint's meta: the run's config, the padded vocabulary size and
the tokenizer files the trainer copied beside the weights. Weights load in fp32, on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtron.checkpoint.checkpoint import CheckpointError, load_checkpoint, read_meta
from meshtron.config import Config
from meshtron.data.tokenizers import Tokenizer, build_tokenizer, saved_tokenizer
from meshtron.models import build_model, family, spec_for
from meshtron.models.contract import ModelFamily


@dataclass
class SavedModel:
    config: Config
    model: ModelFamily
    tokenizer: Tokenizer
    meta: dict[str, Any]  # the checkpoint's meta, with "iteration"


def load_saved_model(load_dir: str, iteration: int | None = None, needs: str | None = None,
                     tokenizer: dict[str, str] | None = None) -> SavedModel:  # fmt: skip
    """The newest checkpoint of ``load_dir`` (or ``iteration``'s) as a one-process model in fp32;
    ``needs``: the family (``--model-type``) the caller needs (a clear error names what the checkpoint holds);
    ``tokenizer``: ``build_tokenizer``'s arguments, in place of the one saved beside the weights."""
    root = Path(load_dir)
    meta = read_meta(root, iteration)
    cfg = Config.from_dict(meta["config"])
    if needs is not None and spec_for(cfg.model) is not family(needs):
        raise CheckpointError(f"{root} holds a '{cfg.model.model_type}' model; this needs a --model-type {needs} checkpoint")
    tokenizer = _tokenizer(root, meta, cfg, tokenizer)
    model = build_model(cfg.model, meta["vocab_size"], cfg.data.seq_length)
    load_checkpoint(root, model, iteration=meta["iteration"], load_rng=False)
    return SavedModel(cfg, model, tokenizer, meta)


def _tokenizer(root: Path, meta: dict[str, Any], cfg: Config, given: dict[str, str] | None) -> Tokenizer:
    """The tokenizer ``given``, else the one the trainer copied beside the weights. A run on
    ``--mock-data`` without ``--tokenizer-type`` saved none: its ids stand for no text until one is named."""
    vocab = meta["vocab_size"]
    if given and given.get("tokenizer_type"):
        tokenizer = build_tokenizer(**given, vocab_extra_ids=cfg.data.vocab_extra_ids)
        if tokenizer.vocab_size > vocab:
            raise CheckpointError(f"--tokenizer-type {given['tokenizer_type']} has {tokenizer.vocab_size} tokens, "
                                  f"more than the {vocab} of the model in {root}")  # fmt: skip
        return tokenizer
    saved = meta.get("tokenizer") or {}
    if not saved.get("tokenizer_type"):
        raise CheckpointError(f"{root} has no tokenizer: its run trained on --mock-data without --tokenizer-type. Name one whose ids "
                              f"fit its {vocab}-token vocabulary: --tokenizer-type ByteTokenizer, or --tokenizer-type NAME with "
                              "--tokenizer-model PATH (or --vocab-file and --merge-file)")  # fmt: skip
    return saved_tokenizer(root, saved, cfg.data.vocab_extra_ids)
