"""``meshtron preprocess``: jsonl text -> tokenized ``{prefix}_{key}_document.bin/.idx``.

Takes the flags of Megatron-LM's ``tools/preprocess_data.py`` and writes the same files. With
``--split-sentences`` each sentence is one sequence (the document index groups a document's
sentences) and the files are ``{prefix}_{key}_sentence.bin/.idx``, the input of BERT, T5 and ICT;
sentences come from NLTK's Punkt with parameters that need no download (``sentences.py``). Workers
receive chunks of raw lines and send back packed numpy arrays, so the parent only writes bytes;
each chunk is encoded in one batch call straight to a numpy array. GPT-2-style byte-level BPE
tokenizers run on tiktoken's engine where it provably gives the same ids (``bpe_engine.py``), the
main source of speed. Text spelling a special token maps to its id unless ``--split-special-tokens``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

import numpy as np

from meshtron.data.indexed import IndexedDatasetBuilder, best_dtype
from meshtron.data.sentences import SentenceSplitter
from meshtron.data.tokenizers import TOKENIZER_TYPES, Tokenizer, build_tokenizer


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshtron preprocess", description="Tokenize a jsonl file into indexed .bin/.idx datasets.")
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract; one output dataset each")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (Punkt), for BERT/T5/ICT")
    g.add_argument("--keep-newlines", action="store_true", help="with --split-sentences: keep the whitespace after each sentence")
    g.add_argument("--lang", default="english", choices=["english"], help="Punkt language")
    g.add_argument("--punkt-cache-dir", default="", help="where the learned Punkt statistics are cached (default ~/.cache/meshtron/punkt)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, help=" | ".join(TOKENIZER_TYPES))
    g.add_argument("--tokenizer-model", default="")
    g.add_argument("--vocab-file", default="")
    g.add_argument("--merge-file", default="")
    g.add_argument("--vocab-extra-ids", type=int, default=0, help="T5 sentinels <extra_id_N> added to BERT WordPiece vocabularies")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    g.add_argument("--split-special-tokens", action="store_true",
                   help="encode text that spells a special token (e.g. <|endoftext|>) as plain text; default: its id, as in "
                        "current Megatron-LM (its GPT2BPETokenizer before megatron.core.tokenizers split it)")  # fmt: skip
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx (_sentence with --split-sentences)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--chunk-size", type=int, default=64, help="lines sent to a worker at a time")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress updates")
    g.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    return p


class _Encoder:
    """Per-process state: the tokenizer is built once in each worker (or once in-process)."""

    tokenizer: Tokenizer | None = None
    args: argparse.Namespace | None = None
    splitter: SentenceSplitter | None = None

    @classmethod
    def init(cls, args: argparse.Namespace) -> None:
        cls.args = args
        cls.tokenizer = _make_tokenizer(args)
        cls.tokenizer.encode("")  # builds lazy engines here, once, before forked workers inherit them
        # Reset on every run: in-process runs (one worker) share this class.
        cls.splitter = SentenceSplitter(args.keep_newlines, args.punkt_cache_dir or None) if args.split_sentences else None

    @classmethod
    def encode_chunk(cls, chunk: list[tuple[int, bytes]]):
        """Lines -> per key (flat token array, per-document sequence lengths), and bytes read."""
        args, tok = cls.args, cls.tokenizer
        texts: dict[str, list[str]] = {k: [] for k in args.json_keys}
        seqs_per_doc: dict[str, list[int]] = {k: [] for k in args.json_keys}  # sentences per document
        nbytes = 0
        for lineno, line in chunk:
            nbytes += len(line)
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{args.input} line {lineno}: not valid JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{args.input} line {lineno}: expected a JSON object, got {type(obj).__name__}")
            for key in args.json_keys:
                if key not in obj:
                    raise ValueError(f"{args.input} line {lineno}: no key '{key}' (it has {sorted(obj)}); pick one with --json-keys")
                value = obj[key]
                if isinstance(value, list):
                    parts = value  # already sentences, as in Megatron
                else:
                    parts = cls.splitter.split(value) if cls.splitter is not None else [value]
                if not all(isinstance(v, str) for v in parts):
                    raise ValueError(f"{args.input} line {lineno}: '{key}' must be a string or a list of strings")
                texts[key].extend(parts)
                seqs_per_doc[key].append(len(parts))
        out = {}
        for key in args.json_keys:
            flat, lengths = tok.encode_batch_flat(texts[key])
            out[key] = _pack(flat, lengths, np.asarray(seqs_per_doc[key], np.int64), tok.eod if args.append_eod else None)
        return out, nbytes


def _pack(flat: np.ndarray, lengths: np.ndarray, seqs_per_doc: np.ndarray, eod: int | None):
    """One chunk's sequences -> (tokens, kept sequence lengths, kept sequences per document).

    Megatron's rule: empty sequences are dropped, and eod ends each document that kept any.
    """
    doc_of_seq = np.repeat(np.arange(len(seqs_per_doc)), seqs_per_doc)
    keep = lengths > 0
    kept_lengths = lengths[keep]
    kept_per_doc = np.bincount(doc_of_seq[keep], minlength=len(seqs_per_doc))
    if eod is not None and len(kept_lengths):
        last_of_doc = np.cumsum(kept_per_doc)[kept_per_doc > 0] - 1  # in kept_lengths
        ends = np.cumsum(kept_lengths)[last_of_doc]  # where each document's tokens end in flat
        flat = np.insert(flat, ends, eod)
        kept_lengths = kept_lengths.copy()
        kept_lengths[last_of_doc] += 1
    return flat, kept_lengths, kept_per_doc


def _make_tokenizer(args: argparse.Namespace) -> Tokenizer:
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file, args.vocab_extra_ids,
                           args.split_special_tokens)  # fmt: skip


def _chunks(path: str, size: int):
    with open(path, "rb") as f:
        chunk = []
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            chunk.append((lineno, line))
            if len(chunk) == size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


_PARTIAL = ".partial"


def _check_not_empty(args: argparse.Namespace, docs: int, tokens: int) -> None:
    """An empty dataset would only fail later, in training, with a less clear error."""
    if docs == 0:
        raise ValueError(f"--input {args.input} has no documents (no non-blank lines); nothing to preprocess")
    if tokens == 0:
        keys = ", ".join(f"'{k}'" for k in args.json_keys)
        raise ValueError(f"--input {args.input}: every {keys} of its {docs} documents is empty; no tokens to write")


def main(argv: list[str] | None = None) -> list[str]:
    """Run preprocessing; returns the written prefixes (without .bin/.idx)."""
    args = _parser().parse_args(argv)
    if args.keep_newlines and not args.split_sentences:
        raise SystemExit("--keep-newlines only applies with --split-sentences")
    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"--input {args.input} does not exist")
    if args.workers < 1 or args.chunk_size < 1:
        raise ValueError("--workers and --chunk-size must be at least 1")
    # Fails fast on a bad tokenizer and learns (and caches) Punkt's statistics once, before any
    # worker starts; forked workers inherit all of it.
    _Encoder.init(args)
    tokenizer = _Encoder.tokenizer
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    level = "sentence" if args.split_sentences else "document"
    prefixes = [f"{args.output_prefix}_{key}_{level}" for key in args.json_keys]
    dtype = best_dtype(tokenizer.vocab_size)
    # Written under partial names and renamed at the end: a failed run leaves neither a 0-byte
    # .bin nor a half-written dataset in place of an older complete one.
    builders = {k: IndexedDatasetBuilder(p + _PARTIAL + ".bin", dtype) for k, p in zip(args.json_keys, prefixes)}

    from tqdm import tqdm

    total = os.path.getsize(args.input)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", disable=True if args.quiet else None)
    start = time.perf_counter()
    docs = tokens = 0
    last_log = 0
    pool = None
    finished = False
    try:
        if args.workers == 1:
            results = map(_Encoder.encode_chunk, _chunks(args.input, args.chunk_size))
        else:
            fork = sys.platform.startswith("linux")
            ctx = multiprocessing.get_context("fork" if fork else "spawn")
            env_before = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # each worker is one process of parallelism
            try:
                pool = ctx.Pool(args.workers, initializer=None if fork else _Encoder.init, initargs=() if fork else (args,))
            finally:
                if env_before is None:
                    os.environ.pop("TOKENIZERS_PARALLELISM")
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = env_before
            results = pool.imap(_Encoder.encode_chunk, _chunks(args.input, args.chunk_size))
        for out, nbytes in results:
            for key, (flat, lengths, per_doc) in out.items():
                builders[key].add_documents(flat, lengths, per_doc)
            first = out[args.json_keys[0]]
            docs += len(first[2])
            tokens += sum(len(v[0]) for v in out.values())
            bar.update(nbytes)
            if docs - last_log >= args.log_interval:
                last_log = docs
                bar.set_postfix(docs=docs, tok_s=f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f}")
        _check_not_empty(args, docs, tokens)
        for key, p in zip(args.json_keys, prefixes):
            builders[key].finalize(p + _PARTIAL + ".idx")
            for ext in (".bin", ".idx"):
                os.replace(p + _PARTIAL + ext, p + ext)
        finished = True
    finally:
        if pool is not None:
            pool.terminate()
        bar.close()
        if not finished:
            for key, p in zip(args.json_keys, prefixes):
                builders[key].abort()
                if os.path.exists(p + _PARTIAL + ".idx"):
                    os.remove(p + _PARTIAL + ".idx")
    seconds = time.perf_counter() - start
    if not args.quiet:
        print(f"preprocess: {docs} documents, {tokens} tokens in {seconds:.2f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s) "
              f"-> {', '.join(p + '.bin/.idx' for p in prefixes)}")
    return prefixes


if __name__ == "__main__":
    main()
