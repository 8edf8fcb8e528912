"""T5 pretraining samples: span corruption with sentinels, as Megatron builds them.

A sample packs consecutive sentences of one document to ``encoder_seq_length - 2`` tokens (the
mapping of ``masked_lm.py``, one sentence minimum) and truncates to that target. 15% of the
tokens are masked in whole-word spans of geometric length (p = 0.2, at most 10 words). Each span
becomes one sentinel ``<extra_id_k>`` (k counting from 0 per sample) in the encoder input; the
decoder reads ``[BOS]`` then, per span, its sentinel and its original tokens, and predicts the same
sequence shifted by one, ending in ``[EOS]``. Needs ``--vocab-extra-ids`` (T5 uses 100).

Batch of one sample (collation adds a leading batch dimension):

- ``encoder_tokens``        int64 [encoder_seq_length]: text with spans replaced by sentinels, padded
- ``decoder_tokens``        int64 [decoder_seq_length]: ``[BOS] s0 span0 s1 span1 ...``, padded
- ``labels``                int64 [decoder_seq_length]: ``s0 span0 s1 span1 ... [EOS]``, -100 at padding
- ``loss_mask``             float32 [decoder_seq_length]: 1 where labels count
- ``encoder_padding_mask``  bool [encoder_seq_length]: True at real tokens
- ``decoder_padding_mask``  bool [decoder_seq_length]: True at real tokens (causality is the model's)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshtron.data.indexed import IndexedDataset
from meshtron.data.masked_lm import (
    IGNORE_INDEX,
    T5_MAX_NGRAM,
    SentenceSampleDataset,
    SpecialIds,
    build_mapping,
    continuation_table,
    create_masked_lm_predictions,
    pad,
    special_ids,
)


@dataclass(frozen=True)
class T5Sampler:
    """How a T5 sample is made from its tokens: span corruption, the sentinels, the decoder's
    input and targets, the padding. ``T5Dataset`` feeds it a mapping row's sentences, mock data
    (``mock_sentences.py``) random ones."""

    special: SpecialIds
    continuation: np.ndarray  # ``continuation_table``: which ids join the word before them
    encoder_seq_length: int
    decoder_seq_length: int
    mask_prob: float

    def __post_init__(self):
        if not self.special.sentinels:
            raise ValueError("T5 needs sentinel tokens; set --vocab-extra-ids (T5 uses 100)")
        if self.encoder_seq_length < 3 or self.decoder_seq_length < 2:
            raise ValueError(f"T5 needs --encoder-seq-length >= 3 and --decoder-seq-length >= 2, got {self.encoder_seq_length}, "
                             f"{self.decoder_seq_length}")  # fmt: skip

    def __call__(self, sentences: list[list[int]], target: int, rng: np.random.RandomState, where: str) -> dict:
        """The sample of ``sentences`` (token ids, consecutive in one document) cut to ``target``
        tokens, drawing from the sample's ``rng``; ``where`` names the sample in errors."""
        sp = self.special
        tokens = [t for s in sentences for t in s][:target]
        masked, _, _, spans = create_masked_lm_predictions(
            tokens, target, rng, mask_prob=self.mask_prob, max_ngram=T5_MAX_NGRAM, continuation=self.continuation,
            skip_ids=(sp.cls, sp.sep), geometric=True, replacement=lambda _: sp.mask,
        )
        if len(spans) > len(sp.sentinels):
            raise ValueError(f"{where}: {len(spans)} masked spans but only {len(sp.sentinels)} sentinels; raise --vocab-extra-ids")
        encoder, targets, start = [], [], 0
        for sentinel, (positions, originals) in zip(sp.sentinels, spans):
            encoder += masked[start : positions[0]] + [sentinel]
            targets += [sentinel, *originals]
            start = positions[-1] + 1
        encoder += masked[start:]
        decoder, labels = [sp.bos, *targets], [*targets, sp.eos]
        if len(decoder) > self.decoder_seq_length:
            raise ValueError(f"{where}: the decoder needs {len(decoder)} tokens, more than --decoder-seq-length {self.decoder_seq_length}")
        encoder_tokens, encoder_mask = pad(encoder, self.encoder_seq_length, sp.pad)
        decoder_tokens, decoder_mask = pad(decoder, self.decoder_seq_length, sp.pad)
        return {
            "encoder_tokens": encoder_tokens,
            "decoder_tokens": decoder_tokens,
            "labels": pad(labels, self.decoder_seq_length, IGNORE_INDEX)[0],
            "loss_mask": decoder_mask.float(),
            "encoder_padding_mask": encoder_mask,
            "decoder_padding_mask": decoder_mask,
        }


class T5Dataset(SentenceSampleDataset):
    """``num_samples`` T5 samples from documents ``document_range`` of a sentence-level ``indexed``."""

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: int, encoder_seq_length: int,
                 decoder_seq_length: int, seed: int, cache_dir: str | None, tokenizer, mask_prob: float = 0.15,
                 short_seq_prob: float = 0.1, name: str = "train"):
        super().__init__(indexed, document_range, num_samples, seed, cache_dir, name)
        self.make = T5Sampler(special_ids(tokenizer), continuation_table(tokenizer), encoder_seq_length, decoder_seq_length, mask_prob)
        target = encoder_seq_length - 2
        self._load_mapping(
            {"encoder_seq_length": encoder_seq_length, "short_seq_prob": short_seq_prob},
            lambda docs: build_mapping(docs, indexed.sequence_lengths, num_samples, target, short_seq_prob, seed, 1),
        )

    def __getitem__(self, i: int) -> dict:
        rng, (first, end, target) = self._row(i)
        return self.make(self._sentences(first, end), target, rng, f"{self.name} sample {i}")
