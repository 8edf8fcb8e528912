"""GPT sampling: checked against naive pure-Python references of the stream and of Megatron's loops."""

import os

import numpy as np
import pytest

from meshtron.data.gpt_dataset import GPTDataset, MockGPTDataset, build_sample_index, sample_dict, split_document_ranges
from meshtron.data.indexed import IndexedDataset, IndexedDatasetBuilder

EOD = 0


@pytest.fixture
def indexed(tmp_path):
    """60 documents of 1..40 tokens; token values encode (document, position) so any mix-up shows."""
    rng = np.random.default_rng(0)
    b = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.int32)
    for d in range(60):
        n = int(rng.integers(1, 40))
        b.add_document([d * 1000 + k + 1 for k in range(n - 1)] + [EOD])
    b.finalize(str(tmp_path / "d.idx"))
    return IndexedDataset(str(tmp_path / "d"))


def make(indexed, tmp_path, num_samples, seq=16, seed=7, rng=(0, 60), **kw):
    return GPTDataset(indexed, rng, num_samples, seq, seed, str(tmp_path / "cache"), EOD, **kw)


def naive_sample_index(sizes, doc_index, seq):
    """Megatron's sample-index loop, transcribed one step at a time."""
    total = sum(int(sizes[d]) for d in doc_index)
    n = (total - 1) // seq
    out = [(0, 0)]
    pos, off = 0, 0
    for _ in range(n):
        remaining = seq + 1
        while remaining:
            doc_len = int(sizes[doc_index[pos]]) - off
            remaining -= doc_len
            if remaining <= 0:
                off += remaining + doc_len - 1
                remaining = 0
            else:
                pos, off = pos + 1, 0
        out.append((pos, off))
    return out


def test_sample_index_matches_megatron_loop(indexed):
    doc_index = np.random.RandomState(3).permutation(np.tile(np.arange(60), 2)).astype(np.int32)
    for seq in (1, 5, 16, 64):
        got = build_sample_index(indexed.sequence_lengths, doc_index, seq)
        assert [tuple(r) for r in got.tolist()] == naive_sample_index(indexed.sequence_lengths, doc_index, seq)


def test_samples_are_windows_of_the_shuffled_stream(indexed, tmp_path):
    ds = make(indexed, tmp_path, 150)
    epochs = -(-(150 * 16 + 1) // int(indexed.sequence_lengths.sum()))
    assert epochs > 1
    stream = [t for d in ds.document_index for t in indexed[int(d)].tolist()]
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        assert ds.sample_tokens(i).tolist() == stream[j * 16 : j * 16 + 17], i
        item = ds[i]
        assert item["tokens"].tolist() == stream[j * 16 : j * 16 + 16]
        assert item["labels"].tolist() == stream[j * 16 + 1 : j * 16 + 17]
    counts = np.bincount(ds.document_index, minlength=60)
    assert set(counts.tolist()) == {epochs}  # every document once per epoch


def test_one_epoch_uses_every_token(indexed, tmp_path):
    total = int(indexed.sequence_lengths.sum())
    n = (total - 1) // 16
    ds = make(indexed, tmp_path, n)
    assert len(ds.document_index) == 60 and sorted(ds.document_index.tolist()) == list(range(60))
    assert sorted(ds.shuffle_index.tolist()) == list(range(n))
    by_position = sorted((int(ds.shuffle_index[i]), i) for i in range(n))
    rebuilt = ds.sample_tokens(by_position[0][1]).tolist()
    for _, i in by_position[1:]:
        window = ds.sample_tokens(i).tolist()
        assert window[0] == rebuilt[-1]  # consecutive samples share one token
        rebuilt += window[1:]
    assert len(rebuilt) > total - 16
    stream = [t for d in ds.document_index for t in indexed[int(d)].tolist()]
    assert rebuilt == stream[: len(rebuilt)]


def test_separate_final_epoch_keeps_first_epochs_whole(indexed, tmp_path):
    per_epoch = (int(indexed.sequence_lengths.sum()) - 1) // 16
    ds = make(indexed, tmp_path, per_epoch + 3)  # the final epoch gives few samples: shuffled on its own
    assert sorted(ds.document_index[:60].tolist()) == list(range(60))
    assert sorted(ds.shuffle_index[:per_epoch].tolist()) == list(range(per_epoch))


def test_determinism_and_cache(indexed, tmp_path):
    a = make(indexed, tmp_path, 100)
    assert not a.cache_hit
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 4 and all(f.split("-")[1:3] == ["GPTDataset", "train"] for f in files)
    b = make(indexed, tmp_path, 100)
    assert b.cache_hit and sorted(os.listdir(tmp_path / "cache")) == files
    fresh = GPTDataset(indexed, (0, 60), 100, 16, 7, str(tmp_path / "other"), EOD)
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
        assert np.array_equal(getattr(a, name), getattr(fresh, name))
    assert not np.array_equal(make(indexed, tmp_path, 100, seed=8).shuffle_index, a.shuffle_index)
    make(indexed, tmp_path, 100, seq=8)
    assert len(os.listdir(tmp_path / "cache")) == 12  # another description, other files


def test_default_cache_dir_is_beside_data(indexed, tmp_path):
    GPTDataset(indexed, (0, 30), 10, 8, 1, None, EOD)
    assert any(f.endswith("shuffle_index.npy") for f in os.listdir(tmp_path / "cache"))


def naive_masks(tokens, eod, reset_pos, eod_mask):
    """Megatron's per-eod loop."""
    n = len(tokens)
    loss = [0.0 if eod_mask and t == eod else 1.0 for t in tokens]
    pos = list(range(n))
    doc, docs = 0, []
    prev = 0
    for i, t in enumerate(tokens):
        docs.append(doc)
        if t == eod:
            doc += 1
            if reset_pos:
                for k in range(i + 1, n):
                    pos[k] -= i + 1 - prev
                prev = i + 1
    return loss, pos, docs


@pytest.mark.parametrize("reset_pos,reset_mask,eod_mask", [(True, True, True), (False, True, False), (True, False, False)])
def test_masks_and_positions(reset_pos, reset_mask, eod_mask):
    text = np.array([5, 6, EOD, 7, EOD, EOD, 8, 9, 10, EOD, 11])
    out = sample_dict(text, EOD, reset_pos, reset_mask, eod_mask)
    loss, pos, docs = naive_masks(text[:-1].tolist(), EOD, reset_pos, eod_mask)
    assert out["loss_mask"].tolist() == loss and out["position_ids"].tolist() == pos
    assert ("document_ids" in out) == reset_mask
    if reset_mask:
        assert out["document_ids"].tolist() == docs == [0, 0, 0, 1, 1, 2, 3, 3, 3, 3]
    assert out["tokens"].dtype.is_floating_point is False and str(out["loss_mask"].dtype) == "torch.float32"


def test_errors(indexed, tmp_path):
    with pytest.raises(ValueError, match="--seq-length 5000"):
        make(indexed, tmp_path, 4, seq=5000)
    with pytest.raises(ValueError, match="--split"):
        make(indexed, tmp_path, 4, rng=(10, 10))


def test_mock_dataset():
    ds = MockGPTDataset(10, 32, 100, seed=3)
    a, b = ds[4], MockGPTDataset(10, 32, 100, seed=3)[4]
    assert a["tokens"].tolist() == b["tokens"].tolist() and a["tokens"].shape == (32,)
    assert a["labels"][:-1].tolist() == a["tokens"][1:].tolist()
    assert a["tokens"].tolist() != ds[5]["tokens"].tolist()
    assert 0 <= int(a["tokens"].min()) and int(a["tokens"].max()) < 100


def test_split_ranges_megatron_rounding():
    assert split_document_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges("1,1,1", 10) == [(0, 4), (4, 7), (7, 10)]  # rounding error moves every boundary
    assert split_document_ranges("100,0,0", 7) == [(0, 7), (7, 7), (7, 7)]
    assert split_document_ranges("98,2", 100) == [(0, 98), (98, 100), (100, 100)]
    assert split_document_ranges("0,5,5", 3) == [(0, 0), (0, 1), (1, 3)]
    with pytest.raises(ValueError, match="--split"):
        split_document_ranges("a,b", 10)
