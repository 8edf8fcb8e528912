"""The embedded default dataset: the corpus of ``corpus.py`` turned into a BPE tokenizer and a
Megatron indexed dataset, built once per cache directory and reused."""

from __future__ import annotations

import json
import os
import sysconfig

from meshtron.data import preprocess
from meshtron.data.corpus import embedded_corpus_documents
from meshtron.data.tokenizers import train_bpe_tokenizer


def _complete(cache_dir: str, stamp: dict, files: list[str]) -> bool:
    try:
        with open(os.path.join(cache_dir, "corpus.json")) as f:
            return json.load(f) == stamp and all(os.path.isfile(p) for p in files)
    except (OSError, ValueError):
        return False


EMBEDDED_VOCAB_SIZE = 4096  # the embedded corpus's BPE vocabulary


def prepare_default_data(cache_dir: str, vocab_size: int = EMBEDDED_VOCAB_SIZE, workers: int = 1) -> tuple[str, str]:
    """Corpus jsonl -> BPE tokenizer.json -> ``corpus_text_document.bin/.idx`` in ``cache_dir``; reused when complete.

    Returns ``(data_prefix, tokenizer_path)``. Call it on one rank first (then a barrier) when
    several processes share ``cache_dir``.
    """
    os.makedirs(cache_dir, exist_ok=True)
    jsonl = os.path.join(cache_dir, "corpus.jsonl")
    tok_path = os.path.join(cache_dir, "tokenizer.json")
    prefix = os.path.join(cache_dir, "corpus_text_document")
    stamp = {"vocab_size": vocab_size, "source": sysconfig.get_paths()["stdlib"], "format": 1}
    if _complete(cache_dir, stamp, [jsonl, tok_path, prefix + ".bin", prefix + ".idx"]):
        return prefix, tok_path
    stamp_path = os.path.join(cache_dir, "corpus.json")
    if os.path.exists(stamp_path):
        os.remove(stamp_path)
    docs = embedded_corpus_documents()
    tmp = f"{jsonl}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    os.replace(tmp, jsonl)
    train_bpe_tokenizer(docs, vocab_size, tok_path)
    preprocess.main(
        ["--input", jsonl, "--output-prefix", os.path.join(cache_dir, "corpus"), "--tokenizer-type", "HuggingFaceTokenizer",
         "--tokenizer-model", tok_path, "--append-eod", "--workers", str(workers), "--quiet"]
    )
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    return prefix, tok_path
