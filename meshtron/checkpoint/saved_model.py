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
from meshtron.data.tokenizers import Tokenizer, build_tokenizer
from meshtron.models import build_model, family, spec_for
from meshtron.models.contract import ModelFamily


@dataclass
class SavedModel:
    config: Config
    model: ModelFamily
    tokenizer: Tokenizer
    meta: dict[str, Any]  # the checkpoint's meta, with "iteration"


def load_saved_model(load_dir: str, iteration: int | None = None, needs: str | None = None) -> SavedModel:
    """The newest checkpoint of ``load_dir`` (or ``iteration``'s) as a one-process model in fp32;
    ``needs``: the family (``--model-type``) the caller needs (a clear error names what the checkpoint holds)."""
    root = Path(load_dir)
    meta = read_meta(root, iteration)
    cfg = Config.from_dict(meta["config"])
    if needs is not None and spec_for(cfg.model) is not family(needs):
        raise CheckpointError(f"{root} holds a '{cfg.model.model_type}' model; this needs a --model-type {needs} checkpoint")
    files = {key: str(root / path) for key, path in meta["tokenizer"].items() if key != "tokenizer_type"}
    tokenizer = build_tokenizer(meta["tokenizer"]["tokenizer_type"], **files, vocab_extra_ids=cfg.data.vocab_extra_ids)
    model = build_model(cfg.model, meta["vocab_size"], cfg.data.seq_length)
    load_checkpoint(root, model, iteration=meta["iteration"], load_rng=False)
    return SavedModel(cfg, model, tokenizer, meta)
