"""The embedded default dataset: the corpus of ``corpus.py`` turned into a tokenizer and a
Megatron indexed dataset, built once per cache directory and reused.

Decoders read it document by document with a byte-level BPE; BERT, T5 and ICT read it sentence by sentence
(``preprocess --split-sentences``) with a WordPiece vocabulary trained on it, in a ``sentences``
subdirectory of the cache.
"""

from __future__ import annotations

import json
import os
import sysconfig
from typing import Callable

from meshtron.data import preprocess
from meshtron.data.corpus import embedded_corpus_documents
from meshtron.data.tokenizers import train_bpe_tokenizer, train_wordpiece_vocab

EMBEDDED_VOCAB_SIZE = 4096  # the embedded corpus's vocabulary (BPE, or WordPiece for sentence data)


def _complete(cache_dir: str, stamp: dict, files: list[str]) -> bool:
    try:
        with open(os.path.join(cache_dir, "corpus.json")) as f:
            return json.load(f) == stamp and all(os.path.isfile(p) for p in files)
    except (OSError, ValueError):
        return False


def _prepare(cache_dir: str, stamp: dict, tokenizer_file: str, level: str, train: Callable[[list[str], str], str],
             preprocess_args: list[str], workers: int) -> tuple[str, str]:  # fmt: skip
    """Corpus jsonl -> tokenizer file (``train(docs, path)``) -> ``corpus_text_{level}.bin/.idx``
    in ``cache_dir`` (``preprocess_args`` name the tokenizer); reused when complete."""
    os.makedirs(cache_dir, exist_ok=True)
    jsonl = os.path.join(cache_dir, "corpus.jsonl")
    tok_path = os.path.join(cache_dir, tokenizer_file)
    prefix = os.path.join(cache_dir, f"corpus_text_{level}")
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
    train(docs, tok_path)
    preprocess.main(["--input", jsonl, "--output-prefix", os.path.join(cache_dir, "corpus"), *preprocess_args, tok_path,
                     "--workers", str(workers), "--quiet"])  # fmt: skip
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    return prefix, tok_path


def prepare_default_data(cache_dir: str, vocab_size: int = EMBEDDED_VOCAB_SIZE, workers: int = 1) -> tuple[str, str]:
    """Corpus jsonl -> BPE tokenizer.json -> ``corpus_text_document.bin/.idx`` in ``cache_dir``; reused when complete.

    Returns ``(data_prefix, tokenizer_path)``. Call it on one rank first (then a barrier) when
    several processes share ``cache_dir``.
    """
    stamp = {"vocab_size": vocab_size, "source": sysconfig.get_paths()["stdlib"], "format": 1}
    return _prepare(cache_dir, stamp, "tokenizer.json", "document", lambda docs, path: train_bpe_tokenizer(docs, vocab_size, path),
                    ["--append-eod", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"], workers)  # fmt: skip


def prepare_default_sentence_data(cache_dir: str, vocab_size: int = EMBEDDED_VOCAB_SIZE, workers: int = 1) -> tuple[str, str]:
    """Corpus jsonl -> WordPiece vocab.txt -> ``corpus_text_sentence.bin/.idx`` (one sequence per
    sentence) in ``cache_dir``; reused when complete. Returns ``(data_prefix, vocab_path)``."""
    stamp = {"vocab_size": vocab_size, "source": sysconfig.get_paths()["stdlib"], "format": 1, "level": "sentence"}
    return _prepare(cache_dir, stamp, "vocab.txt", "sentence", lambda docs, path: train_wordpiece_vocab(docs, vocab_size, path),
                    ["--split-sentences", "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file"], workers)  # fmt: skip


def default_data(cache_dir: str, sentences: bool) -> tuple[str, dict[str, str]]:
    """The embedded corpus as a family reads it (``sentences``: split into sentences, its spec's
    ``sentence_data``; else documents): its data prefix and the data config fields that name its
    tokenizer. Call it on one rank first (then a barrier) when processes share the cache."""
    if sentences:
        prefix, vocab = prepare_default_sentence_data(os.path.join(cache_dir, "sentences"))
        return prefix, {"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": vocab}
    prefix, tokenizer = prepare_default_data(cache_dir)
    return prefix, {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tokenizer}
