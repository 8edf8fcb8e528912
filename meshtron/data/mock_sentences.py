"""``--mock-data`` for the sentence families (BERT, T5, ICT): random sentences, no files, no NLTK.

Megatron-Core's mock GPT data keeps the GPT dataset's sample logic and mocks only what it reads
(random runs of tokens in place of the indexed file). Likewise a mock sample here is a run of
random sentences handed to its family's own sample builder (``BertSampler``, ``T5Sampler``,
``ICTSampler``), so the masking (``--mask-prob`` of the tokens, whole words, n-grams), the
sentence-order pairs, the span corruption, the padding, and the sample's keys, dtypes and shapes
are the real dataset's.

Sample ``i`` depends only on ``(seed, i)``: its sentences come from ``default_rng([seed, i])``, its
masks from the real datasets' per-sample ``RandomState(seed + i)``; each split has its own seed.
Sentences of ``SENTENCE_TOKENS`` tokens fill a sample's target length as a document's fill it in
the real mapping: the sequence less its special tokens, or with probability ``--short-seq-prob`` a
uniform draw in [2, that] (BERT, T5). A BERT sample with the sentence-order head has two sentences
or more; an ICT block is untitled and is document ``i``'s sentences ``0..n``, block ``i``.

The ids: with a BERT WordPiece tokenizer (``--tokenizer-type BertWordPieceLowerCase --vocab-file
...``), its special ids and its ``##`` pieces (which join the word before them); words are every
other id. Without a tokenizer the vocabulary is the model's (``--vocab-size``) and ids are reserved:
0 [PAD], 1 [CLS], 2 [SEP], 3 [MASK], 4 [BOS], 5 [EOS], and the top ``--vocab-extra-ids`` ids are
T5's sentinels (where the WordPiece tokenizer puts them, after its vocabulary); every other id is
a one-piece word.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshtron.data.bert_dataset import BertSampler
from meshtron.data.ict_dataset import ICTSampler
from meshtron.data.masked_lm import SpecialIds, continuation_table, sample_rng, special_ids
from meshtron.data.t5_dataset import T5Sampler

RESERVED_IDS = 6  # [PAD] [CLS] [SEP] [MASK] [BOS] [EOS] are ids 0..5 without a tokenizer
SENTENCE_TOKENS = (8, 40)  # a mock sentence's length, drawn uniformly in this range (inclusive)


def reserved_id_errors(vocab_size: int, num_sentinels: int) -> list[str]:
    """Without a tokenizer: whether ``vocab_size`` leaves a word id beside the reserved ones."""
    if vocab_size <= RESERVED_IDS + num_sentinels:
        return [f"--mock-data without a tokenizer reserves ids 0-5 and the top --vocab-extra-ids ({num_sentinels}) for special "
                f"tokens; --vocab-size {vocab_size} leaves no word id: raise it"]  # fmt: skip
    return []


def mock_vocabulary_errors(cfg) -> list[str]:
    """``reserved_id_errors`` of a config's mock run without a tokenizer, checked before any process
    starts (``--vocab-size`` 0 is the default vocabulary, large enough)."""
    d, vocab = cfg.data, cfg.model.vocab_size
    return reserved_id_errors(vocab, d.vocab_extra_ids) if d.mock and not d.tokenizer_type and vocab else []


@dataclass(frozen=True)
class MockVocabulary:
    """The ids mock sentences are made of: special ids, which ids continue a word, the word ids."""

    special: SpecialIds
    continuation: np.ndarray
    words: np.ndarray

    @classmethod
    def build(cls, tokenizer, vocab_size: int | None, num_sentinels: int) -> MockVocabulary:
        """The tokenizer's ids, or without one the reserved ids in a vocabulary of ``vocab_size``."""
        if tokenizer is not None:
            special, continuation = special_ids(tokenizer), continuation_table(tokenizer)
        else:
            if not vocab_size:
                raise ValueError("--mock-data needs a vocabulary size: pass vocab_size or a tokenizer")
            for error in reserved_id_errors(vocab_size, num_sentinels):
                raise ValueError(error)
            special = SpecialIds(*range(RESERVED_IDS), tuple(range(vocab_size - num_sentinels, vocab_size)), vocab_size)
            continuation = np.zeros(vocab_size, dtype=bool)
        taken = [special.pad, special.cls, special.sep, special.mask, special.bos, special.eos, *special.sentinels]
        return cls(special, continuation, np.setdiff1d(np.arange(special.vocab_size), taken))


class MockSentenceDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of random sentences; subclasses make each into their family's sample."""

    def __init__(self, num_samples: int, seed: int, vocabulary: MockVocabulary):
        self.num_samples, self.seed, self.vocabulary = num_samples, seed, vocabulary

    def __len__(self) -> int:
        return self.num_samples

    def _draw(self, i: int, max_target: int, short_seq_prob: float, min_sentences: int) -> tuple[list[list[int]], int]:
        """Sample ``i``'s sentences and its target length (``max_target``, or a short one)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"mock sample {i} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, i])
        target = int(rng.integers(2, max_target + 1)) if rng.random() < short_seq_prob else max_target
        words, (shortest, longest) = self.vocabulary.words, SENTENCE_TOKENS
        sentences, tokens = [], 0
        while tokens < target or len(sentences) < min_sentences:
            sentences.append(words[rng.integers(0, len(words), int(rng.integers(shortest, longest + 1)))].tolist())
            tokens += len(sentences[-1])
        return sentences, target


class MockBERTDataset(MockSentenceDataset):
    """``BERTDataset``'s samples over random sentences."""

    def __init__(self, num_samples: int, seed: int, vocabulary: MockVocabulary, seq_length: int, mask_prob: float = 0.15,
                 short_seq_prob: float = 0.1, binary_head: bool = True):  # fmt: skip
        super().__init__(num_samples, seed, vocabulary)
        self.make = BertSampler(vocabulary.special, vocabulary.continuation, seq_length, mask_prob, binary_head)
        self.short_seq_prob, self.min_sentences = short_seq_prob, 2 if binary_head else 1

    def __getitem__(self, i: int) -> dict:
        sentences, target = self._draw(i, self.make.seq_length - 3, self.short_seq_prob, self.min_sentences)
        return self.make(sentences, target, sample_rng(self.seed, i))


class MockT5Dataset(MockSentenceDataset):
    """``T5Dataset``'s samples over random sentences."""

    def __init__(self, num_samples: int, seed: int, vocabulary: MockVocabulary, encoder_seq_length: int, decoder_seq_length: int,
                 mask_prob: float = 0.15, short_seq_prob: float = 0.1):  # fmt: skip
        super().__init__(num_samples, seed, vocabulary)
        self.make = T5Sampler(vocabulary.special, vocabulary.continuation, encoder_seq_length, decoder_seq_length, mask_prob)
        self.short_seq_prob = short_seq_prob

    def __getitem__(self, i: int) -> dict:
        sentences, target = self._draw(i, self.make.encoder_seq_length - 2, self.short_seq_prob, 1)
        return self.make(sentences, target, sample_rng(self.seed, i), f"mock sample {i}")


class MockICTDataset(MockSentenceDataset):
    """``ICTDataset``'s samples over random untitled blocks."""

    def __init__(self, num_samples: int, seed: int, vocabulary: MockVocabulary, seq_length: int, query_in_block_prob: float = 0.1,
                 use_one_sent_docs: bool = False):  # fmt: skip
        super().__init__(num_samples, seed, vocabulary)
        self.make = ICTSampler(vocabulary.special, seq_length, query_in_block_prob)
        self.min_sentences = 1 if use_one_sent_docs else 2

    def __getitem__(self, i: int) -> dict:
        block, _ = self._draw(i, self.make.seq_length - 3, 0.0, self.min_sentences)
        return self.make(block, None, sample_rng(self.seed, i), [0, len(block), i, i])
