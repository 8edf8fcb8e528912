"""What BERT, T5 and ICT samples share: sentence-packed sample mappings, masking, per-sample RNG.

Their data is sentence-level (``meshtron preprocess --split-sentences``): each sequence of the
indexed dataset is a sentence and the document index groups sentences into documents. A sample is
a run of consecutive sentences of ONE document (``build_mapping``; ICT's ``build_blocks_mapping``).
Both reproduce Megatron's mappings exactly, random numbers included (std::mt19937 is numpy's
legacy generator; std::mt19937_64, which shuffles, is written out here), so the same files, seed
and sizes give the same samples. Each sample draws its masks from ``RandomState(seed + index)``,
as Megatron does, so sample i is the same whichever process reads it, and resuming at a sample
count replays exactly.

Masking (``create_masked_lm_predictions``) is Megatron's whole-word n-gram masking: a word is a
piece plus its ``##`` continuations; n-grams of up to ``max_ngram`` words are masked with
probability proportional to 1/n (BERT, n <= 3) or with a geometric length, p = 0.2 (SpanBERT; T5,
n <= 10), until ``mask_prob`` of the tokens are masked. Megatron's permutation and "longer n-grams"
options, which neither pretraining script turns on, are left out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import islice

import numpy as np
import torch

from meshtron.data.gpt_dataset import cached_indices, default_cache_dir
from meshtron.data.indexed import IndexedDataset
from meshtron.progress import CHUNK, progress

LONG_SENTENCE_LEN = 512  # documents with a longer sentence are skipped, as in Megatron
BERT_MAX_NGRAM = 3  # Megatron's fixed choices for BERT and T5 (no flag sets them)
T5_MAX_NGRAM = 10
IGNORE_INDEX = -100  # label of positions without a loss, as the loss expects
_U64 = (1 << 64) - 1


def mt19937_64(seed: int, n: int) -> np.ndarray:
    """The first ``n`` outputs of C++'s ``std::mt19937_64(seed)``, vectorized per 312-word block."""
    mt = [seed & _U64]
    for i in range(1, 312):
        mt.append((6364136223846793005 * (mt[-1] ^ (mt[-1] >> 62)) + i) & _U64)
    state = np.array(mt, dtype=np.uint64)
    upper, lower, matrix = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF), np.uint64(0xB5026F5AA96619E9)

    def mix(cur, nxt, far):
        x = (cur & upper) | (nxt & lower)
        return far ^ (x >> np.uint64(1)) ^ np.where(x & np.uint64(1), matrix, np.uint64(0))

    blocks = []
    for _ in range(-(-n // 312)):
        state[:156] = mix(state[:156], state[1:157], state[156:])  # reads only words not yet twisted
        state[156:311] = mix(state[156:311], state[157:], state[:155])  # reads the words twisted above
        state[311:] = mix(state[311:], state[:1], state[155:156])
        y = state.copy()
        y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
        y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        y ^= y >> np.uint64(43)
        blocks.append(y)
    return np.concatenate(blocks)[:n] if blocks else np.zeros(0, np.uint64)


def shuffle_rows(rows: np.ndarray, seed: int) -> np.ndarray:
    """Megatron's Fisher-Yates over mapping rows with ``std::mt19937_64(seed + 1)``."""
    n = len(rows)
    if n < 2:
        return rows
    js = (mt19937_64(seed + 1, n - 1) % np.arange(n, 1, -1, dtype=np.uint64)).tolist()
    perm = list(range(n))
    with progress(n - 1, "shuffling samples", unit="swap", unit_scale=True) as bar:
        for lo in range(0, n - 1, CHUNK):
            top = n - 1 - lo  # swaps i = top, top - 1, ... down to 1, a chunk at a time
            for i, j in zip(range(top, max(top - CHUNK, 0), -1), js[lo : lo + CHUNK]):
                perm[i], perm[j] = perm[j], perm[i]
            bar.update(min(CHUNK, top))
    return rows[perm]


class _Mt32:
    """Raw 32-bit draws of ``std::mt19937(seed)`` (numpy's legacy seeding is the same), in chunks."""

    def __init__(self, seed: int):
        self._rng = np.random.RandomState(seed)
        self._buf: list[int] = []

    def __call__(self) -> int:
        if not self._buf:
            self._buf = self._rng.randint(0, 1 << 32, size=4096, dtype=np.uint64).tolist()[::-1]
        return self._buf.pop()


def _mapping_dtype(num_sentences: int):
    return np.uint64 if num_sentences > np.iinfo(np.uint32).max else np.uint32


def _eligible(docs: list[int], sizes: np.ndarray, min_sentences: int, long_check_from: int) -> list[int]:
    """Documents with enough sentences and (when they have ``long_check_from`` or more) none too long."""
    out = []
    for d in range(len(docs) - 1):
        first, last = docs[d], docs[d + 1]
        if last - first < min_sentences:
            continue
        if last - first >= long_check_from and int(sizes[first:last].max()) > LONG_SENTENCE_LEN:
            continue
        out.append(d)
    return out


def _epochs(num_samples: int, one_epoch, what: str) -> list[tuple]:
    """Whole epochs of ``one_epoch(epoch)`` rows until ``num_samples`` rows exist (Megatron's rule)."""
    rows: list[tuple] = []
    epoch = 0
    with progress(num_samples, f"{what} mapping", unit=what) as bar:
        while len(rows) < num_samples:
            before = len(rows)
            epoch_rows = one_epoch(epoch)
            while chunk := list(islice(epoch_rows, CHUNK)):
                rows.extend(chunk)
                bar.update(len(chunk))
            if len(rows) == before:
                raise ValueError(f"no {what} fits: every document is too short or has a sentence over {LONG_SENTENCE_LEN} tokens")
            epoch += 1
    return rows


def build_mapping(docs: np.ndarray, sizes: np.ndarray, num_samples: int, max_seq_length: int, short_seq_prob: float,
                  seed: int, min_sentences: int) -> np.ndarray:
    """Rows ``(first sentence, end sentence, target length)``, shuffled; Megatron's ``build_mapping``.

    ``docs`` are the document boundaries in sentence ids (``document_indices`` of a split). A
    sample grows sentence by sentence until it reaches its target length (unless that would leave
    a single sentence behind) or the document ends. The target is ``max_seq_length``, or with
    probability ``short_seq_prob`` a uniform draw in [2, max_seq_length].
    """
    ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0
    draw = _Mt32(seed)

    def target() -> int:
        if ratio == 0:
            return max_seq_length
        r = draw()
        return 2 + r % (max_seq_length - 1) if r % ratio == 0 else max_seq_length

    docs_l = [int(x) for x in docs]
    sizes_l = sizes.tolist() if len(sizes) < 1 << 24 else sizes  # a list is faster to walk; huge files stay mapped
    eligible = _eligible(docs_l, sizes, min_sentences, 2)

    def one_epoch(epoch: int):
        for d in eligible:
            first, last = docs_l[d], docs_l[d + 1]
            prev, seq_len, num_sent, t = first, 0, 0, target()
            for s in range(first, last):
                seq_len += sizes_l[s]
                num_sent += 1
                remain = last - s - 1
                if (seq_len >= t and remain > 1 and num_sent >= min_sentences) or remain == 0:
                    yield (prev, s + 1, t)
                    prev, seq_len, num_sent, t = s + 1, 0, 0, target()

    rows = _epochs(num_samples, one_epoch, "sample")
    return shuffle_rows(np.array(rows, dtype=_mapping_dtype(len(sizes))), seed)


def build_blocks_mapping(docs: np.ndarray, sizes: np.ndarray, title_sizes: np.ndarray, num_samples: int,
                         max_seq_length: int, seed: int, use_one_sent_blocks: bool, first_document: int = 0) -> np.ndarray:
    """ICT blocks: rows ``(first sentence, end sentence, document, block id)``, shuffled; Megatron's ``build_blocks_mapping``.

    A block fills ``max_seq_length`` minus its document's title length; blocks number from 0 in
    each epoch. ``document`` is ``first_document`` plus the position in ``docs`` (the id in the
    indexed dataset, where titles are looked up).
    """
    min_sent = 1 if use_one_sent_blocks else 2
    docs_l = [int(x) for x in docs]
    sizes_l = sizes.tolist() if len(sizes) < 1 << 24 else sizes
    eligible = _eligible(docs_l, sizes, min_sent, min_sent)

    def one_epoch(epoch: int):
        block = 0
        for d in eligible:
            first, last = docs_l[d], docs_l[d + 1]
            t = max_seq_length - int(title_sizes[d])
            prev, seq_len, num_sent = first, 0, 0
            for s in range(first, last):
                seq_len += sizes_l[s]
                num_sent += 1
                remain = last - s - 1
                if (seq_len >= t and remain >= min_sent and num_sent >= min_sent) or remain == 0:
                    yield (prev, s + 1, first_document + d, block)
                    block += 1
                    prev, seq_len, num_sent = s + 1, 0, 0

    rows = _epochs(num_samples, one_epoch, "block")
    return shuffle_rows(np.array(rows, dtype=_mapping_dtype(len(sizes))), seed)


@dataclass(frozen=True)
class SpecialIds:
    """The ids the BERT, T5 and ICT samples place around and in place of text: a WordPiece
    tokenizer's (``special_ids``) or, for mock data without one, reserved ids (``mock_sentences.py``)."""

    pad: int
    cls: int
    sep: int
    mask: int
    bos: int
    eos: int
    sentinels: tuple[int, ...]  # T5's <extra_id_k>, in k order
    vocab_size: int  # every id is below it (BERT's random replacements draw below it)


def special_ids(tokenizer) -> SpecialIds:
    """A BERT WordPiece tokenizer's special ids (``--vocab-extra-ids`` sentinels included)."""
    return SpecialIds(tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.bos, tokenizer.eos,
                      tuple(getattr(tokenizer, "additional_special_tokens_ids", ())), tokenizer.vocab_size)  # fmt: skip


def continuation_table(tokenizer) -> np.ndarray:
    """``table[id]`` is True for WordPiece continuations (``##...``), which join the previous word."""
    table = np.zeros(tokenizer.vocab_size, dtype=bool)
    for i, tok in tokenizer.inv_vocab.items():
        table[i] = tok.startswith("##")
    return table


def create_masked_lm_predictions(tokens: list[int], target_length: int, rng: np.random.RandomState, *, mask_prob: float,
                                 max_ngram: int, continuation: np.ndarray, skip_ids: tuple[int, ...], geometric: bool, replacement):
    """Megatron's masking of one sample; draws from ``rng`` in Megatron's order.

    ``replacement(rng)`` gives the id a masked token becomes (None keeps it). Returns the masked
    tokens, masked positions (sorted), their original ids, and the masked spans as
    ``(positions, original ids)`` sorted by position.
    """
    words: list[list[int]] = []  # candidates: a word's positions; [CLS]/[SEP] are never masked
    for i, t in enumerate(tokens):
        if t in skip_ids:
            continue
        if continuation[t] and words:
            words[-1].append(i)
        else:
            words.append([i])
    n_mask = min(mask_prob * target_length, max(1, int(round(len(tokens) * mask_prob))))
    ngram_sizes = np.arange(1, max_ngram + 1, dtype=np.int64)
    probs = 1.0 / ngram_sizes
    probs = probs / probs.sum()
    probs = probs / probs.sum()  # normalized twice, as Megatron does, so choice() sees the same floats
    order = np.arange(len(words))
    rng.shuffle(order)  # the permutation Megatron applies to its candidate list
    out = list(tokens)
    masked: dict[int, int] = {}  # position -> original id
    spans = []
    for start in order.tolist():
        if len(masked) >= n_mask:
            break
        n = min(rng.geometric(0.2), max_ngram) if geometric else int(rng.choice(ngram_sizes, p=probs))
        while True:  # the longest n-gram from ``start`` with at most n words that fits the budget
            positions = [p for w in words[start : start + n] for p in w]
            n -= 1
            if n_mask >= len(masked) + len(positions):
                break
            if n == 0:
                positions = None
                break
        if positions is None or any(p in masked for p in positions):
            continue
        for p in positions:
            masked[p] = tokens[p]
            new = replacement(rng)
            out[p] = tokens[p] if new is None else new
        spans.append((positions, [tokens[p] for p in positions]))
    positions = sorted(masked)
    return out, positions, [masked[p] for p in positions], sorted(spans, key=lambda s: s[0][0])


def sample_rng(seed: int, index: int) -> np.random.RandomState:
    """The random state of sample ``index`` (Megatron's: ``RandomState((seed + index) % 2**32)``)."""
    return np.random.RandomState((seed + index) % 2**32)


def pad(ids: list[int], length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` padded to ``length`` and its padding mask (True at real tokens)."""
    if len(ids) > length:
        raise ValueError(f"{len(ids)} tokens do not fit a sequence of {length}")
    tokens = torch.full((length,), pad_id, dtype=torch.int64)
    tokens[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
    mask = torch.zeros(length, dtype=torch.bool)
    mask[: len(ids)] = True
    return tokens, mask


class SentenceSampleDataset(torch.utils.data.Dataset):
    """Base of the BERT, T5 and ICT datasets: a split's documents, their cached mapping, its length.

    Subclasses call ``_load_mapping`` with the parameters that shape the mapping and the function
    that builds it; ``len`` is ``num_samples`` (the mapping holds whole epochs, at least as many).
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: int, seed: int,
                 cache_dir: str | None, name: str):
        start, end = (int(x) for x in document_range)
        num_docs = len(indexed.document_indices) - 1
        if not 0 <= start < end <= num_docs:
            raise ValueError(f"{name} document range [{start}, {end}) is empty or outside {indexed.path_prefix} ({num_docs} documents); check --split")
        if num_samples < 1 or seed < 1:
            raise ValueError(f"{name}: num_samples ({num_samples}) and --seed ({seed}) must be positive")
        self.indexed, self.name, self.seed, self.num_samples = indexed, name, seed, num_samples
        self.document_range = (start, end)
        self.cache_dir = default_cache_dir(indexed, cache_dir)

    def _load_mapping(self, params: dict, build) -> None:
        start, end = self.document_range
        description = {"class": type(self).__name__, "path_prefix": os.path.abspath(self.indexed.path_prefix), "num_sequences": len(self.indexed),
                       "document_range": [start, end], "num_samples": self.num_samples, "seed": self.seed, "format": 1, **params}
        docs = np.asarray(self.indexed.document_indices[start : end + 1])
        arrays, self.cache_hit = cached_indices(description, self.cache_dir, self.name, ("sample_index",), lambda: {"sample_index": build(docs)})
        self.sample_index = arrays["sample_index"]
        self.description = description

    def __len__(self) -> int:
        return self.num_samples

    def _row(self, i: int) -> tuple[np.random.RandomState, list[int]]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name} sample {i} out of range [0, {self.num_samples})")
        return sample_rng(self.seed, i), [int(x) for x in self.sample_index[i]]

    def _sentences(self, first: int, end: int) -> list[list[int]]:
        return [self.indexed[s].tolist() for s in range(first, end)]


def masked_data_config_errors(data_cfg) -> list[str]:
    """Problems with the BERT/T5/ICT data fields of ``data_cfg`` that every one of them shares;
    ``bert_data_errors``, ``t5_data_errors`` and ``ict_data_errors`` add each model's."""
    errors = []
    if not 0.0 < data_cfg.mask_prob < 1.0:
        errors.append(f"--mask-prob {data_cfg.mask_prob} must be in (0, 1)")
    if not 0.0 <= data_cfg.short_seq_prob <= 1.0:
        errors.append(f"--short-seq-prob {data_cfg.short_seq_prob} must be in [0, 1]")
    if data_cfg.vocab_extra_ids < 0:
        errors.append(f"--vocab-extra-ids {data_cfg.vocab_extra_ids} must be >= 0")
    if not 0.0 <= data_cfg.query_in_block_prob <= 1.0:
        errors.append(f"--query-in-block-prob {data_cfg.query_in_block_prob} must be in [0, 1]")
    if data_cfg.encoder_seq_length < 0 or data_cfg.decoder_seq_length < 0:
        errors.append("--encoder-seq-length and --decoder-seq-length must be >= 0 (0: unset)")
    return errors


def bert_data_errors(data_cfg) -> list[str]:
    if data_cfg.seq_length < 5:
        return [f"BERT needs --seq-length >= 5 ([CLS] A [SEP] B [SEP]), got {data_cfg.seq_length}"]
    return []


def t5_data_errors(data_cfg) -> list[str]:
    errors = []
    enc = data_cfg.encoder_seq_length or data_cfg.seq_length
    if data_cfg.vocab_extra_ids < 1:
        errors.append("T5 needs sentinel tokens: set --vocab-extra-ids (Megatron's T5 uses 100)")
    if data_cfg.decoder_seq_length < 2:  # whether masked spans fit is known per sample (T5Dataset says)
        errors.append(f"T5 needs --decoder-seq-length >= 2, got {data_cfg.decoder_seq_length}")
    if enc < 3:
        errors.append(f"T5 needs an encoder length >= 3, got {enc}")
    return errors


def ict_data_errors(data_cfg) -> list[str]:
    if data_cfg.seq_length < 4:
        return [f"ICT needs --seq-length >= 4 ([CLS] title [SEP] block [SEP]), got {data_cfg.seq_length}"]
    return []
