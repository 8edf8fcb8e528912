"""Inverse Cloze Task (ICT) samples for the retriever: a pseudo-query sentence and its block.

Blocks are runs of consecutive sentences of one document filling ``seq_length - 3`` tokens less
the document's title (``build_blocks_mapping`` in ``masked_lm.py``; documents of one sentence only
with ``--use-one-sent-docs``). For each block one sentence is drawn as the query; with probability
``--query-in-block-prob`` it stays in the block, otherwise it is removed, so the model must find
the block from context rather than by matching the sentence. Titles come from
``--titles-data-path``, a document-level indexed dataset with one title per document of the
block data (as Megatron's ICT reads them); without it the context has no title segment.

Batch of one sample (collation adds a leading batch dimension):

- ``query_tokens``          int64 [seq_length]: ``[CLS] query [SEP]``, padded with the pad id
- ``query_padding_mask``    bool [seq_length]: True at real tokens
- ``context_tokens``        int64 [seq_length]: ``[CLS] title [SEP] block [SEP]`` (``[CLS] block [SEP]`` untitled)
- ``context_padding_mask``  bool [seq_length]: True at real tokens
- ``block_indices``         int64 [4]: first sentence, end sentence, document, block id (an evidence index key)

Unlike Megatron's ICT, whose query draws come from one generator shared by all samples, each
sample draws from its own ``RandomState(seed + index)``, so samples are reproducible and resumable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshtron.data.indexed import IndexedDataset
from meshtron.data.masked_lm import SentenceSampleDataset, SpecialIds, build_blocks_mapping, pad, special_ids


@dataclass(frozen=True)
class ICTSampler:
    """How an ICT sample is made from its block: the query drawn and kept or removed, the title,
    the padding. ``ICTDataset`` feeds it a mapping row's sentences, mock data (``mock_sentences.py``)
    random ones."""

    special: SpecialIds
    seq_length: int
    query_in_block_prob: float

    def __post_init__(self):
        if self.seq_length < 4:
            raise ValueError(f"ICT needs --seq-length >= 4, got {self.seq_length}")

    def __call__(self, block: list[list[int]], title: list[int] | None, rng: np.random.RandomState, row: list[int]) -> dict:
        """The sample of ``block`` (sentences of one document) under ``title`` (None: untitled),
        drawing from the sample's ``rng``; ``row`` becomes its ``block_indices``."""
        block = list(block)
        q = int(rng.randint(0, len(block)))
        query = list(block[q]) if rng.random() < self.query_in_block_prob else block.pop(q)
        sp = self.special
        prefix = [sp.cls, *title, sp.sep] if title is not None else [sp.cls]
        context = [t for s in block for t in s][: self.seq_length - len(prefix) - 1]
        query_tokens, query_mask = pad([sp.cls, *query[: self.seq_length - 2], sp.sep], self.seq_length, sp.pad)
        context_tokens, context_mask = pad([*prefix, *context, sp.sep], self.seq_length, sp.pad)
        return {
            "query_tokens": query_tokens,
            "query_padding_mask": query_mask,
            "context_tokens": context_tokens,
            "context_padding_mask": context_mask,
            "block_indices": torch.tensor(row, dtype=torch.int64),
        }


class ICTDataset(SentenceSampleDataset):
    """``num_samples`` ICT samples from documents ``document_range`` of a sentence-level ``indexed``."""

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: int, seq_length: int, seed: int,
                 cache_dir: str | None, tokenizer, titles: IndexedDataset | None = None, query_in_block_prob: float = 0.1,
                 use_one_sent_docs: bool = False, name: str = "train"):
        super().__init__(indexed, document_range, num_samples, seed, cache_dir, name)
        num_docs = len(indexed.document_indices) - 1
        if titles is not None and len(titles) != num_docs:
            raise ValueError(f"--titles-data-path {titles.path_prefix} has {len(titles)} titles but {indexed.path_prefix} has {num_docs} documents")
        self.make = ICTSampler(special_ids(tokenizer), seq_length, query_in_block_prob)
        self.titles = titles
        start, end = self.document_range
        if titles is not None:
            title_sizes = np.asarray(titles.sequence_lengths[start:end])
        else:
            title_sizes = np.zeros(end - start, dtype=np.int32)
        self._load_mapping(
            {"seq_length": seq_length, "use_one_sent_docs": use_one_sent_docs, "titles": titles.path_prefix if titles is not None else ""},
            lambda docs: build_blocks_mapping(docs, indexed.sequence_lengths, title_sizes, num_samples, seq_length - 3, seed,
                                              use_one_sent_docs, first_document=start),
        )

    def __getitem__(self, i: int) -> dict:
        rng, row = self._row(i)
        first, end, doc, _ = row
        title = self.titles[doc].tolist() if self.titles is not None else None
        return self.make(self._sentences(first, end), title, rng, row)
