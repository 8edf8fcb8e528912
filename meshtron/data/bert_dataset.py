"""BERT pretraining samples: masked LM plus sentence-order prediction (SOP), as Megatron builds them.

A sample packs consecutive sentences of one document to ``seq_length - 3`` tokens (the
mapping of ``masked_lm.py``). With the binary head the sentences are cut at a random pivot into
segments A and B, swapped with probability 0.5 (SOP: the model tells whether the order is the
original), and the longer segment is trimmed from a random end until both fit. Tokens are
``[CLS] A [SEP] B [SEP]``; 15% of them are masked (whole words, n-grams up to 3; 80% become
[MASK], 10% a random id, 10% stay).

Batch of one sample (the model's batch after collation adds a leading batch dimension):

- ``tokens``        int64 [seq_length]: the masked input, padded with the tokenizer's pad id
- ``types``         int64 [seq_length]: token type, 0 for [CLS] A [SEP] (and padding), 1 for B [SEP]
- ``labels``        int64 [seq_length]: the original id at masked positions, -100 elsewhere
- ``loss_mask``     float32 [seq_length]: 1 at masked positions
- ``padding_mask``  bool [seq_length]: True at real tokens, False at padding
- ``is_random``     int64 []: SOP label, 1 when A and B were swapped (always 0 without the binary head)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshtron.data.indexed import IndexedDataset
from meshtron.data.masked_lm import (
    BERT_MAX_NGRAM,
    IGNORE_INDEX,
    SentenceSampleDataset,
    SpecialIds,
    build_mapping,
    continuation_table,
    create_masked_lm_predictions,
    pad,
    special_ids,
)


@dataclass(frozen=True)
class BertSampler:
    """How a BERT sample is made from its sentences: the sentence-order pair, the trimming, the
    masking and the padding. ``BERTDataset`` feeds it a mapping row's sentences, mock data
    (``mock_sentences.py``) random ones."""

    special: SpecialIds
    continuation: np.ndarray  # ``continuation_table``: which ids join the word before them
    seq_length: int
    mask_prob: float
    binary_head: bool

    def __post_init__(self):
        if self.seq_length < 5:
            raise ValueError(f"BERT needs --seq-length >= 5 ([CLS] A [SEP] B [SEP]), got {self.seq_length}")

    def _replacement(self, rng: np.random.RandomState):
        """80% [MASK], 10% a uniformly random id of the vocabulary, 10% unchanged (None)."""
        if rng.random() < 0.8:
            return self.special.mask
        if rng.random() >= 0.5:
            return int(rng.randint(0, self.special.vocab_size))
        return None

    def __call__(self, sentences: list[list[int]], target: int, rng: np.random.RandomState) -> dict:
        """The sample of ``sentences`` (token ids, consecutive in one document) cut to ``target``
        tokens, drawing from the sample's ``rng``."""
        pivot, swapped = len(sentences), False
        if self.binary_head:
            pivot = int(rng.randint(1, len(sentences))) if len(sentences) >= 3 else 1
            swapped = rng.random() < 0.5
        a = [t for s in sentences[:pivot] for t in s]
        b = [t for s in sentences[pivot:] for t in s]
        if swapped:
            a, b = b, a
        while len(a) + len(b) > target:  # trim the longer segment from a random end
            longer = a if len(a) > len(b) else b
            del longer[0 if rng.random() < 0.5 else -1]
        sp = self.special
        tokens = [sp.cls, *a, sp.sep] + ([*b, sp.sep] if b else [])
        types = [0] * (len(a) + 2) + [1] * (len(tokens) - len(a) - 2)
        masked, positions, originals, _ = create_masked_lm_predictions(
            tokens, target, rng, mask_prob=self.mask_prob, max_ngram=BERT_MAX_NGRAM, continuation=self.continuation,
            skip_ids=(sp.cls, sp.sep), geometric=False, replacement=self._replacement,
        )
        tokens_t, padding_mask = pad(masked, self.seq_length, sp.pad)
        where = torch.tensor(positions, dtype=torch.int64)
        labels = torch.full((self.seq_length,), IGNORE_INDEX, dtype=torch.int64)
        labels[where] = torch.tensor(originals, dtype=torch.int64)
        loss_mask = torch.zeros(self.seq_length, dtype=torch.float32)
        loss_mask[where] = 1.0
        return {
            "tokens": tokens_t,
            "types": pad(types, self.seq_length, 0)[0],
            "labels": labels,
            "loss_mask": loss_mask,
            "padding_mask": padding_mask,
            "is_random": torch.tensor(int(swapped), dtype=torch.int64),
        }


class BERTDataset(SentenceSampleDataset):
    """``num_samples`` BERT samples from documents ``document_range`` of a sentence-level ``indexed``."""

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: int, seq_length: int, seed: int,
                 cache_dir: str | None, tokenizer, mask_prob: float = 0.15, short_seq_prob: float = 0.1, binary_head: bool = True,
                 name: str = "train"):
        super().__init__(indexed, document_range, num_samples, seed, cache_dir, name)
        self.make = BertSampler(special_ids(tokenizer), continuation_table(tokenizer), seq_length, mask_prob, binary_head)
        target, min_sentences = seq_length - 3, 2 if binary_head else 1
        self._load_mapping(
            {"seq_length": seq_length, "short_seq_prob": short_seq_prob, "min_sentences": min_sentences},
            lambda docs: build_mapping(docs, indexed.sequence_lengths, num_samples, target, short_seq_prob, seed, min_sentences),
        )

    def __getitem__(self, i: int) -> dict:
        rng, (first, end, target) = self._row(i)
        return self.make(self._sentences(first, end), target, rng)
