"""Tokenizers behind one small interface, selected by Megatron-LM's ``--tokenizer-type`` names.

Every tokenizer has ``encode``, ``encode_batch`` (the preprocessing fast path), ``decode``,
``vocab_size`` (every id is below it), ``eod`` (the end-of-document id appended between
documents), ``bos_id`` (its begin-of-text id, None where it has none) and ``name``.

Text that spells a special token (``<|endoftext|>``) becomes that token's id, as in Megatron-LM's
tokenizers built on Hugging Face and tiktoken; ``split_special_tokens=True`` encodes it as plain
text instead, as the GPT-2 tokenizer of Megatron-LM releases before ``megatron.core.tokenizers``
did. SentencePiece and BERT WordPiece always read such text as text (as Megatron's do).
"""

from __future__ import annotations

import base64
import difflib
import os
import re
from functools import cached_property
from typing import Iterable

import numpy as np

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_RESERVED_SPECIAL = 256


class Tokenizer:
    """The interface the data layer and inference rely on."""

    name: str = ""
    vocab_size: int = 0
    eod: int = -1
    bos_id: int | None = None  # what hf-export writes as bos_token_id

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_text(self, text: str) -> list[int]:
        """The ids of ``text`` alone, without the BOS ``encode`` may add: a piece of a longer
        sequence (a turn of a conversation). Special tokens spelled in the text stay special."""
        return self.encode(text)

    def encode_batch_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """All texts' ids back to back (int64) and each text's id count: what a ``.bin`` needs."""
        encoded = self.encode_batch(texts)
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        flat = np.fromiter((i for ids in encoded for i in ids), np.int64, int(lengths.sum()))
        return flat, lengths

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eod={self.eod})"


_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # a Hugging Face model name, ``org/model``


def _hub_cached_tokenizer(name: str) -> str | None:
    """The ``tokenizer.json`` of Hugging Face model ``name`` from the local Hugging Face cache,
    where Megatron's launch scripts (which name e.g. ``NousResearch/Meta-Llama-3-8B``) expect it
    to come from; meshtron never downloads it. None when ``name`` is a path or not cached."""
    if os.path.exists(name) or not _HUB_NAME.fullmatch(name):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "tokenizer.json")
    except Exception:  # huggingface_hub missing (it comes with tokenizers), or a name it refuses
        return None
    return found if isinstance(found, str) else None


def _need_file(path: str, flag: str, tokenizer_type: str, what: str) -> str:
    if not path:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag} (the {what})")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} {path} does not exist (the {what} for --tokenizer-type {tokenizer_type})")
    return path


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and 256 as end of document; needs no file."""

    name = "ByteTokenizer"
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HuggingFaceTokenizer(Tokenizer):
    """A ``tokenizer.json`` through the ``tokenizers`` library; its post-processor (e.g. a BOS) applies."""

    def __init__(self, tokenizer, name: str, eod: int | None = None, source: str = "", split_special_tokens: bool = False):
        self._tok = tokenizer
        self._tok.encode_special_tokens = split_special_tokens
        self.split_special_tokens = split_special_tokens
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.bos_id = next((vocab[t] for t in BOS_CANDIDATES if t in vocab), None)
        if eod is None:
            found = [vocab[t] for t in EOD_CANDIDATES if t in vocab]
            if not found:
                raise ValueError(f"{source}: no end-of-document token among {list(EOD_CANDIDATES)}; add one to the tokenizer")
            eod = found[0]
        self.eod = eod

    @cached_property
    def _fast(self):
        """tiktoken's engine where it encodes exactly as this tokenizer (GPT-2-style BPE), else None."""
        from meshtron.data.bpe_engine import tiktoken_engine

        return tiktoken_engine(self._tok)

    def _fast_encode(self, text: str) -> list[int]:
        if self.split_special_tokens:
            return self._fast.encode_ordinary(text)
        return self._fast.encode(text, allowed_special="all")

    @classmethod
    def from_file(cls, tokenizer_model: str, split_special_tokens: bool = False) -> "HuggingFaceTokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = _hub_cached_tokenizer(tokenizer_model)
        if path is None and _HUB_NAME.fullmatch(tokenizer_model) and not os.path.exists(tokenizer_model):
            raise FileNotFoundError(f"--tokenizer-model {tokenizer_model} is neither a path nor in the local Hugging Face cache "
                                    f"(meshtron does not download: `huggingface-cli download {tokenizer_model} tokenizer.json` first)")  # fmt: skip
        path = path or _need_file(tokenizer_model, "--tokenizer-model", "HuggingFaceTokenizer", "tokenizer.json file or a folder holding one")
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"--tokenizer-model {tokenizer_model}: folder has no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(path)
        except Exception as exc:
            raise ValueError(f"--tokenizer-model {path}: cannot load as a tokenizer.json: {exc}") from exc
        return cls(tok, name=f"HuggingFaceTokenizer({path})", source=path, split_special_tokens=split_special_tokens)

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast_encode(text)
        return self._tok.encode(text).ids

    def encode_text(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            return [self._fast_encode(t) for t in texts]
        return [e.ids for e in self._tok.encode_batch_fast(texts)]

    def encode_batch_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self._fast is None:
            return super().encode_batch_flat(texts)
        allowed = set() if self.split_special_tokens else "all"
        arrays = [self._fast.encode_to_numpy(t, allowed_special=allowed, disallowed_special=()) for t in texts]
        lengths = np.fromiter(map(len, arrays), np.int64, len(arrays))
        return (np.concatenate(arrays) if arrays else np.zeros(0, np.uint32)), lengths

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _gpt2_bpe(vocab_file: str, merge_file: str, split_special_tokens: bool = False) -> HuggingFaceTokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    _need_file(vocab_file, "--vocab-file", "GPT2BPETokenizer", "GPT-2 vocab.json")
    _need_file(merge_file, "--merge-file", "GPT2BPETokenizer", "GPT-2 merges.txt")
    try:
        tok = HFTokenizer(models.BPE.from_file(vocab_file, merge_file))
    except Exception as exc:
        raise ValueError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: cannot load as GPT-2 BPE: {exc}") from exc
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    eod = tok.token_to_id("<|endoftext|>")
    if eod is None:
        raise ValueError(f"--vocab-file {vocab_file} has no '<|endoftext|>' token, which GPT2BPETokenizer uses as end of document")
    tok.add_special_tokens(["<|endoftext|>"])  # text spelling it maps to its id, as Hugging Face's GPT-2 tokenizer does
    return HuggingFaceTokenizer(tok, name=f"GPT2BPETokenizer({vocab_file})", eod=eod, split_special_tokens=split_special_tokens)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``.model``; end of document is its EOS. ``add_bos`` mirrors Megatron's Llama2Tokenizer."""

    def __init__(self, model_file: str, tokenizer_type: str = "SentencePieceTokenizer", add_bos: bool = False):
        import sentencepiece as spm

        _need_file(model_file, "--tokenizer-model", tokenizer_type, "sentencepiece .model file")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except Exception as exc:
            raise ValueError(f"--tokenizer-model {model_file}: cannot load as a sentencepiece model: {exc}") from exc
        self.name = f"{tokenizer_type}({model_file})"
        self.vocab_size = self._sp.vocab_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError(f"--tokenizer-model {model_file} has no EOS piece, which {tokenizer_type} uses as end of document")
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self._bos = [self.bos_id] if add_bos and self.bos_id is not None else []

    def encode(self, text: str) -> list[int]:
        return self._bos + self._sp.encode(text)

    def encode_text(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._bos + ids for ids in self._sp.encode(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(list(ids))


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Read a tiktoken rank file: one ``base64(token_bytes) rank`` per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as exc:
                raise ValueError(f"--tokenizer-model {path} line {lineno}: expected 'base64_token rank' ({exc})") from None
    return ranks


def llama3_special_tokens(num_reserved: int = LLAMA3_NUM_RESERVED_SPECIAL) -> list[str]:
    """Llama 3's special tokens in id order; they follow the ranked tokens."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    return named + [f"<|reserved_special_token_{i}|>" for i in range(5, num_reserved - 5)]


class TikTokenizer(Tokenizer):
    """A tiktoken rank file with Llama 3's split pattern and 256 special tokens after the ranks."""

    _MAX_CHARS = 400_000  # tiktoken slows badly on huge inputs; Llama 3 encodes in pieces this long
    _MAX_RUN = 25_000  # and cuts runs of only (non-)whitespace every this many characters
    _LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (_MAX_RUN + 1, _MAX_RUN + 1))

    def __init__(self, model_file: str, split_special_tokens: bool = False):
        import tiktoken

        _need_file(model_file, "--tokenizer-model", "TikTokenizer", "tiktoken rank file")
        ranks = load_tiktoken_ranks(model_file)
        base = len(ranks)
        specials = {t: base + i for i, t in enumerate(llama3_special_tokens())}
        self._enc = tiktoken.Encoding(name=os.path.basename(model_file), pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
        self.name = f"TikTokenizer({model_file})"
        self.vocab_size = base + len(specials)
        self.eod = specials["<|end_of_text|>"]
        self.bos_id = specials["<|begin_of_text|>"]
        self.split_special_tokens = split_special_tokens

    def _pieces(self, text: str) -> list[str]:
        """Llama 3's cut points: every 400k characters, and inside overlong (non-)whitespace runs."""
        if len(text) <= self._MAX_RUN:
            return [text]
        out = []
        for i in range(0, len(text), self._MAX_CHARS):
            chunk = text[i : i + self._MAX_CHARS]
            cuts = [0]
            for m in self._LONG_RUN.finditer(chunk):
                cuts.extend(range(m.start() + self._MAX_RUN, m.end(), self._MAX_RUN))
            cuts.append(len(chunk))
            out.extend(chunk[a:b] for a, b in zip(cuts, cuts[1:]))
        return out

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._pieces(text):
            ids.extend(self._enc.encode_ordinary(piece) if self.split_special_tokens else self._enc.encode(piece, allowed_special="all"))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode(list(ids))


class BertWordPieceTokenizer(HuggingFaceTokenizer):
    """A BERT ``vocab.txt`` as Megatron's ``BertWordPieceLowerCase`` / ``BertWordPieceCase``.

    Ids follow the file's line order; ``[BOS]``, ``[EOS]`` (also the end of document) and
    ``--vocab-extra-ids`` sentinels ``<extra_id_0..N-1>`` (T5's span markers) get the next ids when
    the file lacks them, as in Megatron. They join the WordPiece vocabulary, not the added-token
    list, so text spelling ``[EOS]`` is word-pieced like any other text, again as in Megatron.
    ``encode`` adds no [CLS]/[SEP]: the datasets place those.
    """

    def __init__(self, vocab_file: str, lower_case: bool, vocab_extra_ids: int = 0):
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers

        tokenizer_type = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        _need_file(vocab_file, "--vocab-file", tokenizer_type, "WordPiece vocab.txt")
        with open(vocab_file, encoding="utf-8") as f:
            tokens = [line.strip() for line in f]
        while tokens and not tokens[-1]:
            tokens.pop()  # a trailing newline is not a token
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in vocab:
                raise ValueError(f"--vocab-file {vocab_file}: token {t!r} on lines {vocab[t] + 1} and {i + 1}; ids must be unique")
            vocab[t] = i
        missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]") if t not in vocab]
        if missing:
            raise ValueError(f"--vocab-file {vocab_file} lacks {missing}, which {tokenizer_type} needs")
        self.additional_special_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for t in ["[BOS]", "[EOS]", *self.additional_special_tokens]:
            vocab.setdefault(t, len(vocab))
        tok = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
        tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        super().__init__(tok, name=f"{tokenizer_type}({vocab_file})", eod=vocab["[EOS]"])
        self.vocab = vocab
        self.inv_vocab = {i: t for t, i in vocab.items()}
        self.cls, self.sep, self.pad, self.mask = (vocab[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"))
        self.bos, self.eos = vocab["[BOS]"], vocab["[EOS]"]
        self.additional_special_tokens_ids = [vocab[t] for t in self.additional_special_tokens]


TOKENIZER_TYPES = (
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "ByteTokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "DeepSeekV2Tokenizer",
)
# Types that name a model's Hugging Face tokenizer rather than an algorithm of their own (the
# ROCm/PAI DeepSeek scripts' type): read from the tokenizer.json in --tokenizer-model.
HF_TOKENIZER_ALIASES = ("HuggingFaceTokenizer", "DeepSeekV2Tokenizer")


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str = "",
    vocab_file: str = "",
    merge_file: str = "",
    vocab_extra_ids: int = 0,
    split_special_tokens: bool = False,
) -> Tokenizer:
    """Build the tokenizer a ``--tokenizer-type`` names from the files its flags point at.

    ``vocab_extra_ids`` (``--vocab-extra-ids``, T5's sentinels) applies to the BERT WordPiece types;
    ``split_special_tokens`` (module docstring) to the Hugging Face, GPT-2 and tiktoken types.
    """
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(vocab_file, tokenizer_type == "BertWordPieceLowerCase", vocab_extra_ids)
    if tokenizer_type in HF_TOKENIZER_ALIASES:
        return HuggingFaceTokenizer.from_file(tokenizer_model, split_special_tokens)
    if tokenizer_type == "GPT2BPETokenizer":
        return _gpt2_bpe(vocab_file, merge_file, split_special_tokens)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return SentencePieceTokenizer(tokenizer_model, "Llama2Tokenizer", add_bos=True)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(tokenizer_model, split_special_tokens)
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    close = difflib.get_close_matches(tokenizer_type or "", TOKENIZER_TYPES, n=1, cutoff=0.4)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ValueError(f"unknown --tokenizer-type '{tokenizer_type}'; valid types: {', '.join(TOKENIZER_TYPES)}.{hint}")


def saved_tokenizer(root: str | os.PathLike, saved: dict[str, str], vocab_extra_ids: int = 0) -> Tokenizer:
    """The tokenizer a checkpoint's meta names (``{"tokenizer_type": ..., file flags: paths}``),
    its files relative to the checkpoint directory ``root``, where the trainer copied them."""
    files = {key: os.path.join(root, path) for key, path in saved.items() if key != "tokenizer_type"}
    return build_tokenizer(saved["tokenizer_type"], **files, vocab_extra_ids=vocab_extra_ids)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, path: str) -> str:
    """Train a byte-level BPE (special token ``<|endoftext|>``) and save it as tokenizer.json at ``path``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tmp = f"{path}.tmp{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, path)
    return path


def train_wordpiece_vocab(texts: Iterable[str], vocab_size: int, path: str) -> str:
    """Train a lower-cased WordPiece vocabulary (BERT's normalizer and pre-tokenizer, ``##``
    continuations, [PAD] [UNK] [CLS] [SEP] [MASK] first) and write it as a ``vocab.txt`` at
    ``path``, one token per line in id order: what ``BertWordPieceLowerCase`` reads."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    tok = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                                        show_progress=False)  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer)
    tokens = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(t + "\n" for t, _ in tokens)
    os.replace(tmp, path)
    return path
