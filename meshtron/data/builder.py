"""Train/valid/test datasets from a ``DataConfig``, and the resumable micro-batch iterator."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshtron.config import Config, DataConfig
from meshtron.data.blended import BlendedDataset, build_blending_indices, parse_data_path
from meshtron.data.gpt_dataset import GPTDataset, MockGPTDataset, split_document_ranges
from meshtron.data.chat_template import conversation_template
from meshtron.data.data_sources import has_per_split_data, names_data, split_blends
from meshtron.data.indexed import IndexedDataset
from meshtron.data.masked_lm import bert_data_errors, ict_data_errors, masked_data_config_errors, t5_data_errors
from meshtron.data.sft_dataset import build_sft_datasets

SPLIT_NAMES = ("train", "valid", "test")
_BLEND_MARGIN = 1.005  # Megatron asks each blended dataset for this much more than its share


def build_datasets(
    data_cfg: DataConfig,
    tokenizer,
    num_samples: tuple[int, int, int],
    seed: int,
    data_prefixes: list[str] | None = None,
    vocab_size: int | None = None,
):
    """(train, valid, test) of a decoder's data; a split with 0 samples or no documents is None.
    Documents (``GPTDataset``), mock tokens, or with ``--sft`` conversations from a jsonl
    (``build_sft_datasets``). The masked-LM families read sentences (``build_sentence_datasets``);
    each family names its builder in its spec (``models.registry``).

    Mock data draws ids below ``vocab_size`` (default: the tokenizer's), so it needs no tokenizer.
    """
    if data_cfg.mock:
        vocab = vocab_size or (tokenizer.vocab_size if tokenizer is not None else 0)
        if vocab <= 0:
            raise ValueError("--mock-data needs a vocabulary size: pass vocab_size or a tokenizer")
        return tuple(
            MockGPTDataset(n, data_cfg.seq_length, vocab, seed + k, data_cfg.reset_attention_mask) if n > 0 else None
            for k, n in enumerate(num_samples)
        )
    if tokenizer is None:
        raise ValueError("--data-path needs a tokenizer for its end-of-document id; set --tokenizer-type")
    if data_cfg.sft:
        template = conversation_template(data_cfg.sft_chat_template, data_cfg.tokenizer_type, data_cfg.tokenizer_model)
        return build_sft_datasets(data_cfg, tokenizer, num_samples, seed, template)
    sources = Sources.read(data_cfg, data_prefixes, len)

    def one(k: int, ds_i: int, n: int) -> GPTDataset:
        return GPTDataset(
            sources.indexed[ds_i], sources.ranges[ds_i][k], n, data_cfg.seq_length, seed, data_cfg.data_cache_path or None, tokenizer.eod,
            data_cfg.reset_position_ids, data_cfg.reset_attention_mask, data_cfg.eod_mask_loss, name=SPLIT_NAMES[k],
        )

    return _splits(sources, num_samples, seed, one)


def decoder_datasets(cfg: Config, tokenizer, num_samples: tuple[int, int, int], seed: int, data_prefixes: list[str] | None = None,
                     vocab_size: int | None = None):  # fmt: skip
    """``build_datasets`` in the signature of a family's ``datasets`` hook."""
    return build_datasets(cfg.data, tokenizer, num_samples, seed, data_prefixes, vocab_size)


@dataclass
class Sources:
    """The indexed datasets a run reads, each with its weight in its blend and its document range
    in each split, and which datasets make up each split's blend: every ``--data-path`` dataset,
    its documents divided by ``--split``; or per-split blends (``data_sources.py``), each dataset
    whole in its own split."""

    indexed: list[IndexedDataset]
    weights: list[float]
    ranges: list[list[tuple[int, int]]]
    blends: list[list[int]]

    @classmethod
    def read(cls, data_cfg: DataConfig, data_prefixes: list[str] | None, count: Callable[[IndexedDataset], int]) -> "Sources":
        """``data_prefixes`` (equally weighted: the embedded corpus) or the config's data; ``count``
        gives a dataset's documents."""
        if has_per_split_data(data_cfg):
            sources = cls([], [], [], [])
            for k, blend in enumerate(split_blends(data_cfg)):
                prefixes, weights = parse_data_path(blend) if blend else ([], [])
                sources.blends.append(list(range(len(sources.indexed), len(sources.indexed) + len(prefixes))))
                for prefix, weight in zip(prefixes, weights):
                    sources.indexed.append(IndexedDataset(prefix))
                    sources.weights.append(weight)
                    sources.ranges.append([(0, count(sources.indexed[-1])) if split == k else (0, 0) for split in range(3)])
            return sources
        if data_prefixes:
            prefixes, weights = list(data_prefixes), [1.0 / len(data_prefixes)] * len(data_prefixes)
        else:
            prefixes, weights = parse_data_path(data_cfg.data_path)
        indexed = [IndexedDataset(p) for p in prefixes]
        every = list(range(len(indexed)))
        return cls(indexed, weights, [split_document_ranges(data_cfg.split, count(ds)) for ds in indexed], [every, every, every])


def _splits(sources: Sources, num_samples: tuple[int, int, int], seed: int, one) -> tuple:
    """Per split, ``one(split, dataset, n)`` alone (a blend of one dataset) or a blend of the
    blend's datasets with documents in the split."""
    out = []
    ranges, weights = sources.ranges, sources.weights
    for k, n in enumerate(num_samples):
        members = [i for i in sources.blends[k] if ranges[i][k][1] > ranges[i][k][0] and weights[i] > 0]
        if n <= 0 or not members:
            out.append(None)
        elif len(sources.blends[k]) == 1:
            out.append(one(k, members[0], n))
        else:
            w = [weights[i] for i in members]
            w = [x / sum(w) for x in w]
            dataset_index, _ = build_blending_indices(w, n)
            needed = np.bincount(dataset_index, minlength=len(members))
            sizes = [max(math.ceil(x * n * _BLEND_MARGIN), int(c)) for x, c in zip(w, needed)]
            parts = [one(k, i, m) for i, m in zip(members, sizes)]
            out.append(BlendedDataset(parts, w, n, seed))
    return tuple(out)


def build_sentence_datasets(
    what: str, data_cfg: DataConfig, tokenizer, num_samples: tuple[int, int, int], seed: int, data_prefixes: list[str] | None,
    data_errors: Callable[[DataConfig], list[str]], one: Callable[..., Any], mock: Callable[[int, int], Any],
):  # fmt: skip
    """(train, valid, test) on sentence-level ``--data-path`` files (or ``data_prefixes``, equally
    weighted: the embedded corpus) for the family ``what`` (named in messages), once the shared
    and its own ``data_errors`` are none. ``one(indexed, documents, titles, **common)`` builds a
    split's dataset over a prefix's document range; ``common`` holds what every sentence dataset takes.
    With ``--mock-data``, ``mock(num_samples, seed)`` builds each split instead (``mock_sentences.py``),
    each with its own seed as for GPT.

    ``--split`` divides documents (not sentences); several weighted prefixes blend as for GPT.
    """
    errors = masked_data_config_errors(data_cfg) + data_errors(data_cfg)
    if errors:
        raise ValueError("; ".join(errors))
    if data_cfg.mock:
        return tuple(mock(n, seed + k) if n > 0 else None for k, n in enumerate(num_samples))
    if not (names_data(data_cfg) or data_prefixes):
        raise ValueError(f"{what} needs sentence-split data: --data-path PREFIX_text_sentence (meshtron preprocess --split-sentences)")
    sources = Sources.read(data_cfg, data_prefixes, lambda ds: len(ds.document_indices) - 1)
    titles = IndexedDataset(data_cfg.titles_data_path) if data_cfg.titles_data_path else None
    if titles is not None and len(sources.indexed) > 1:
        raise ValueError("--titles-data-path holds the titles of one --data-path; ICT blends are not supported")
    cache = data_cfg.data_cache_path or None

    def split(k: int, i: int, n: int):
        return one(sources.indexed[i], sources.ranges[i][k], titles, num_samples=n, seed=seed, cache_dir=cache, tokenizer=tokenizer,
                   name=SPLIT_NAMES[k])  # fmt: skip

    return _splits(sources, num_samples, seed, split)


def bert_datasets(cfg: Config, tokenizer, num_samples: tuple[int, int, int], seed: int, data_prefixes: list[str] | None = None,
                  vocab_size: int | None = None):  # fmt: skip
    """BERT's ``BERTDataset`` splits (``MockBERTDataset`` with ``--mock-data``); ``--bert-no-binary-head``
    drops the sentence-order pairs."""
    from meshtron.data.bert_dataset import BERTDataset
    from meshtron.data.mock_sentences import MockBERTDataset, MockVocabulary

    d = cfg.data
    shared = dict(seq_length=d.seq_length, mask_prob=d.mask_prob, short_seq_prob=d.short_seq_prob, binary_head=cfg.model.bert_binary_head)

    def one(indexed, documents, titles, **common):
        return BERTDataset(indexed, documents, **shared, **common)

    def mock(n: int, split_seed: int):
        return MockBERTDataset(n, split_seed, MockVocabulary.build(tokenizer, vocab_size, d.vocab_extra_ids), **shared)

    return build_sentence_datasets("bert", d, tokenizer, num_samples, seed, data_prefixes, bert_data_errors, one, mock)


def t5_datasets(cfg: Config, tokenizer, num_samples: tuple[int, int, int], seed: int, data_prefixes: list[str] | None = None,
                vocab_size: int | None = None):  # fmt: skip
    """T5's ``T5Dataset`` splits (span corruption with sentinels; ``MockT5Dataset`` with ``--mock-data``)."""
    from meshtron.data.mock_sentences import MockT5Dataset, MockVocabulary
    from meshtron.data.t5_dataset import T5Dataset

    d = cfg.data
    shared = dict(encoder_seq_length=d.encoder_seq_length or d.seq_length, decoder_seq_length=d.decoder_seq_length, mask_prob=d.mask_prob,
                  short_seq_prob=d.short_seq_prob)  # fmt: skip

    def one(indexed, documents, titles, **common):
        return T5Dataset(indexed, documents, **shared, **common)

    def mock(n: int, split_seed: int):
        return MockT5Dataset(n, split_seed, MockVocabulary.build(tokenizer, vocab_size, d.vocab_extra_ids), **shared)

    return build_sentence_datasets("t5", d, tokenizer, num_samples, seed, data_prefixes, t5_data_errors, one, mock)


def ict_datasets(cfg: Config, tokenizer, num_samples: tuple[int, int, int], seed: int, data_prefixes: list[str] | None = None,
                 vocab_size: int | None = None):  # fmt: skip
    """The retriever's ``ICTDataset`` splits (a sentence as the query of its block; titles optional;
    ``MockICTDataset`` with ``--mock-data``)."""
    from meshtron.data.ict_dataset import ICTDataset
    from meshtron.data.mock_sentences import MockICTDataset, MockVocabulary

    d = cfg.data
    shared = dict(seq_length=d.seq_length, query_in_block_prob=d.query_in_block_prob, use_one_sent_docs=d.use_one_sent_docs)

    def one(indexed, documents, titles, **common):
        return ICTDataset(indexed, documents, titles=titles, **shared, **common)

    def mock(n: int, split_seed: int):
        return MockICTDataset(n, split_seed, MockVocabulary.build(tokenizer, vocab_size, d.vocab_extra_ids), **shared)

    return build_sentence_datasets("ict", d, tokenizer, num_samples, seed, data_prefixes, ict_data_errors, one, mock)


def collate(samples: list[dict]) -> dict:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


class MicroBatchIterator:
    """Megatron's pretraining sampler as an endless iterator of collated micro-batches.

    Global step g covers samples ``consumed + g*B*dp ... + (g+1)*B*dp`` (modulo the dataset
    length, so training never runs dry); rank r takes its ``B`` slice. ``consumed_samples``
    counts global samples handed out, so a new iterator built from it continues exactly.
    """

    def __init__(self, dataset, micro_batch_size: int, consumed_samples: int, dp_rank: int = 0, dp_size: int = 1, num_workers: int = 0):
        if len(dataset) == 0:
            raise ValueError("MicroBatchIterator needs a non-empty dataset")
        if not 0 <= dp_rank < dp_size or micro_batch_size < 1 or consumed_samples < 0:
            raise ValueError(f"bad sampler setup: micro_batch_size={micro_batch_size}, consumed_samples={consumed_samples}, dp_rank={dp_rank}, dp_size={dp_size}")
        self.dataset, self.micro_batch_size = dataset, micro_batch_size
        self.consumed_samples, self.dp_rank, self.dp_size = consumed_samples, dp_rank, dp_size
        self.num_workers = num_workers
        self._it = None

    def _index_batches(self):
        step = self.micro_batch_size * self.dp_size
        start = self.consumed_samples + self.dp_rank * self.micro_batch_size
        n = len(self.dataset)
        while True:
            yield [(start + j) % n for j in range(self.micro_batch_size)]
            start += step

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._it is None:
            if self.num_workers > 0:
                loader = torch.utils.data.DataLoader(
                    self.dataset, batch_sampler=self._index_batches(), num_workers=self.num_workers, collate_fn=collate, persistent_workers=True
                )
                self._it = iter(loader)
            else:
                self._it = (collate([self.dataset[i] for i in idx]) for idx in self._index_batches())
        batch = next(self._it)
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return batch

    def close(self) -> None:
        """Stop worker processes now (otherwise interpreter exit waits seconds for them)."""
        self._it = None  # dropping the loader's iterator shuts its workers down
