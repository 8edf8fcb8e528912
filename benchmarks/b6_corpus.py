"""B6 inputs: a jsonl of Python source text and a GPT-2-style byte-level BPE trained on it.

Documents are this interpreter's standard library and site-packages ``.py`` files in sorted path
order, one ``{"text": source}`` per line, until ``--megabytes`` of jsonl. The tokenizer is a
50257-entry byte-level BPE (GPT-2's size, ``<|endoftext|>`` last as in GPT-2) trained on the first
documents, written as ``vocab.json``/``merges.txt`` plus a ``tokenizer_config.json`` so that a folder
named ``gpt2`` holding them is what ``AutoTokenizer.from_pretrained("gpt2")`` loads offline.

    python benchmarks/b6_corpus.py --out /tmp/b6 [--megabytes 60]
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig

GPT2_VOCAB = 50257


def python_sources():
    for root in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(".py"):
                    yield os.path.join(dirpath, name)


def write_corpus(path: str, megabytes: float) -> int:
    limit, written, docs = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        for src in python_sources():
            try:
                text = open(src, encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line.encode())
            docs += 1
            if written >= limit:
                break
    return docs


def train_tokenizer(corpus: str, folder: str, train_megabytes: float = 15) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        seen = 0
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                seen += len(line)
                if seen > train_megabytes * 1e6:
                    return
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=GPT2_VOCAB - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(), trainer=trainer)
    os.makedirs(folder, exist_ok=True)
    tok.model.save(folder)
    vocab_path = os.path.join(folder, "vocab.json")
    vocab = json.load(open(vocab_path, encoding="utf-8"))
    vocab["<|endoftext|>"] = len(vocab)  # GPT-2's place for it: the last id
    json.dump(vocab, open(vocab_path, "w", encoding="utf-8"), ensure_ascii=False)
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1 << 30, "add_prefix_space": False,
              "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}  # fmt: skip
    json.dump(config, open(os.path.join(folder, "tokenizer_config.json"), "w"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--megabytes", type=float, default=60)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    corpus = os.path.join(args.out, "python_src.jsonl")
    if not os.path.exists(corpus):
        print(f"{write_corpus(corpus, args.megabytes)} documents -> {corpus}")
    folder = os.path.join(args.out, "gpt2")
    if not os.path.exists(os.path.join(folder, "merges.txt")):
        train_tokenizer(corpus, folder)
        print(f"tokenizer -> {folder}")


if __name__ == "__main__":
    main()
