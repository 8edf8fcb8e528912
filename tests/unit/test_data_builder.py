"""Datasets from a DataConfig, and the resumable micro-batch iterator."""

import itertools
import math

import numpy as np
import pytest
import torch

from meshtron.config import DataConfig
from meshtron.data.blended import BlendedDataset
from meshtron.data.builder import MicroBatchIterator, build_datasets
from meshtron.data.gpt_dataset import GPTDataset, MockGPTDataset
from meshtron.data.indexed import IndexedDatasetBuilder
from meshtron.data.tokenizers import ByteTokenizer


def make_prefix(tmp_path, name, n_docs, base):
    b = IndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), np.uint16)
    rng = np.random.default_rng(base)
    for d in range(n_docs):
        b.add_document(rng.integers(base, base + 100, int(rng.integers(5, 60))).tolist() + [256])
    b.finalize(str(tmp_path / f"{name}.idx"))
    return str(tmp_path / name)


def test_mock_splits():
    cfg = DataConfig(mock=True, seq_length=16)
    train, valid, test = build_datasets(cfg, ByteTokenizer(), (20, 4, 0), seed=1)
    assert isinstance(train, MockGPTDataset) and len(train) == 20 and len(valid) == 4 and test is None
    assert train[0]["tokens"].tolist() != valid[0]["tokens"].tolist()
    big = build_datasets(cfg, None, (5, 0, 0), seed=1, vocab_size=50_000)[0]
    assert int(max(big[i]["tokens"].max() for i in range(5))) > 257


def test_single_prefix_splits_and_flags(tmp_path):
    prefix = make_prefix(tmp_path, "a", 100, 0)
    cfg = DataConfig(data_path=[prefix], split="90,10,0", seq_length=32, tokenizer_type="ByteTokenizer", reset_attention_mask=True,
                     data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_datasets(cfg, ByteTokenizer(), (50, 10, 10), seed=3)
    assert isinstance(train, GPTDataset) and test is None  # empty document range
    assert train.description["document_range"] == [0, 90] and valid.description["document_range"] == [90, 100]
    assert set(train[0]) == {"tokens", "labels", "loss_mask", "position_ids", "document_ids"}
    same = build_datasets(cfg, ByteTokenizer(), (50, 10, 10), seed=3, data_prefixes=[prefix])[0]
    assert same.cache_hit and torch.equal(same[7]["tokens"], train[7]["tokens"])


def test_blend_sizes_members_like_megatron(tmp_path):
    a, b = make_prefix(tmp_path, "a", 80, 0), make_prefix(tmp_path, "b", 80, 1000)
    cfg = DataConfig(data_path=["0.25", a, "0.75", b], split="100,0,0", seq_length=16, tokenizer_type="ByteTokenizer")
    train, valid, test = build_datasets(cfg, ByteTokenizer(), (400, 5, 0), seed=3)
    assert isinstance(train, BlendedDataset) and valid is None and test is None
    assert [len(d) for d in train.datasets] == [math.ceil(0.25 * 400 * 1.005), math.ceil(0.75 * 400 * 1.005)]
    from_a = sum(int(train[i]["tokens"].max()) < 1000 for i in range(len(train)))
    assert from_a == 100


def _batches(ds, mbs, consumed, n, **kw):
    it = MicroBatchIterator(ds, mbs, consumed, **kw)
    out = [next(it) for _ in range(n)]
    it.close()
    return out


def test_iterator_resumes_exactly_and_wraps():
    ds = MockGPTDataset(10, 8, 50, seed=0)
    full = _batches(ds, 3, 0, 8)
    resumed = _batches(ds, 3, 9, 5)
    for x, y in zip(full[3:], resumed):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    it = MicroBatchIterator(ds, 3, 0)
    list(itertools.islice(it, 4))
    assert it.consumed_samples == 12
    wrapped = full[3]["tokens"]  # samples 9, 0, 1: wraps past the end
    assert wrapped.shape == (3, 8)
    assert torch.equal(wrapped[1], ds[0]["tokens"]) and torch.equal(wrapped[0], ds[9]["tokens"])


def test_iterator_data_parallel_slices_partition_the_global_batch():
    ds = MockGPTDataset(64, 4, 50, seed=0)
    single = _batches(ds, 8, 4, 2)
    ranks = [_batches(ds, 2, 4, 2, dp_rank=r, dp_size=4) for r in range(4)]
    for step in range(2):
        stacked = torch.cat([ranks[r][step]["tokens"] for r in range(4)])
        assert torch.equal(stacked, single[step]["tokens"])


def test_iterator_with_worker_processes_matches():
    ds = MockGPTDataset(20, 4, 50, seed=0)
    plain = _batches(ds, 2, 6, 3)
    workers = _batches(ds, 2, 6, 3, num_workers=1)
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(plain, workers))


def test_iterator_rejects_bad_setup():
    with pytest.raises(ValueError, match="dp_rank=2"):
        MicroBatchIterator(MockGPTDataset(4, 4, 10, 0), 1, 0, dp_rank=2, dp_size=2)
