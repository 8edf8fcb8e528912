"""MMIDIDX files: byte-exact against an independent writer of the documented layout, both directions."""

import struct

import numpy as np
import pytest

from meshtron.data.indexed import DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder, best_dtype

CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
FMT = {"uint16": "H", "int32": "i"}


def reference_write(prefix, documents, dtype_name):
    """Write the layout byte by byte with struct, from the format notes only. documents: list of lists of sequences."""
    itemsize = struct.calcsize("<" + FMT[dtype_name])
    lengths, pointers, doc_idx = [], [], [0]
    with open(prefix + ".bin", "wb") as f:
        pos = 0
        for doc in documents:
            for seq in doc:
                f.write(struct.pack(f"<{len(seq)}{FMT[dtype_name]}", *seq))
                lengths.append(len(seq))
                pointers.append(pos)
                pos += len(seq) * itemsize
            doc_idx.append(len(lengths))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype_name]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def random_documents(rng, n_docs, vocab, multi):
    docs = []
    for _ in range(n_docs):
        n_seq = int(rng.integers(1, 4)) if multi else 1
        docs.append([rng.integers(0, vocab, int(rng.integers(1, 50))).tolist() for _ in range(n_seq)])
    return docs


def build_ours(prefix, documents, dtype):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in documents:
        if len(doc) == 1:
            b.add_document(doc[0])
        else:
            for seq in doc:
                b.add_item(seq)
            b.end_document()
    b.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype_name,vocab,multi", [("uint16", 65000, False), ("int32", 200_000, False), ("uint16", 50, True)])
def test_bytes_match_reference_writer(tmp_path, dtype_name, vocab, multi):
    docs = random_documents(np.random.default_rng(0), 40, vocab, multi)
    reference_write(str(tmp_path / "ref"), docs, dtype_name)
    build_ours(str(tmp_path / "ours"), docs, getattr(np, dtype_name))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes(), ext


def test_reader_reads_reference_files(tmp_path):
    docs = random_documents(np.random.default_rng(1), 30, 1000, multi=True)
    reference_write(str(tmp_path / "ref"), docs, "uint16")
    ds = IndexedDataset(str(tmp_path / "ref"))
    flat = [seq for doc in docs for seq in doc]
    assert len(ds) == len(flat) and ds.dtype == np.uint16
    for i, seq in enumerate(flat):
        assert ds[i].tolist() == seq
    assert ds.sequence_lengths.dtype == np.int32 and ds.document_indices.dtype == np.int64
    assert ds.document_indices.tolist() == np.cumsum([0] + [len(d) for d in docs]).tolist()
    assert ds.get(2, offset=1, length=2).tolist() == flat[2][1:3]
    assert ds.get(3, offset=1).tolist() == flat[3][1:]
    assert ds.num_tokens == sum(map(len, flat))
    with pytest.raises(IndexError):
        ds.get(0, offset=0, length=len(flat[0]) + 1)


def test_add_documents_fast_path_matches_per_document(tmp_path):
    docs = random_documents(np.random.default_rng(2), 20, 500, multi=True) + [[]]  # last: empty document
    build_ours(str(tmp_path / "slow"), docs[:-1], np.uint16)
    b = IndexedDatasetBuilder(str(tmp_path / "slow2.bin"), np.uint16)
    for doc in docs[:-1]:
        for seq in doc:
            b.add_item(seq)
        b.end_document()
    b.add_document([])
    b.finalize(str(tmp_path / "slow2.idx"))
    fast = IndexedDatasetBuilder(str(tmp_path / "fast.bin"), np.uint16)
    flat = [seq for doc in docs for seq in doc]
    fast.add_documents(np.concatenate([np.asarray(s) for s in flat]), [len(s) for s in flat], [len(d) for d in docs])
    fast.finalize(str(tmp_path / "fast.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"fast{ext}").read_bytes() == (tmp_path / f"slow2{ext}").read_bytes()
    ds = IndexedDataset(str(tmp_path / "fast"))
    assert ds.document_indices[-1] == ds.document_indices[-2] == len(flat)  # the empty document has no sequence


def test_dtype_choice_and_codes():
    assert best_dtype(50257) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(128256) == np.int32
    assert {np.dtype(v).name: k for k, v in DTYPE_CODES.items()} == CODES


def test_token_out_of_dtype_range_is_an_error(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError, match="does not fit uint16"):
        b.add_document([1, 70000])


def _write_small(tmp_path):
    prefix = str(tmp_path / "d")
    build_ours(prefix, [[[1, 2, 3]], [[4, 5]]], np.uint16)
    return prefix


@pytest.mark.parametrize(
    "corrupt,message",
    [
        (lambda idx: b"NOTMAGIC!" + idx[9:], "magic"),
        (lambda idx: idx[:9] + struct.pack("<Q", 2) + idx[17:], "version"),
        (lambda idx: idx[:17] + bytes([9]) + idx[18:], "dtype code"),
        (lambda idx: idx[:-3], "need"),
        (lambda idx: idx[:10], "header"),
    ],
)
def test_corrupt_index_names_the_file(tmp_path, corrupt, message):
    prefix = _write_small(tmp_path)
    with open(prefix + ".idx", "rb") as f:
        data = f.read()
    with open(prefix + ".idx", "wb") as f:
        f.write(corrupt(data))
    with pytest.raises(ValueError, match=message) as err:
        IndexedDataset(prefix)
    assert prefix + ".idx" in str(err.value)


def test_truncated_bin_names_the_file(tmp_path):
    prefix = _write_small(tmp_path)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(6)
    with pytest.raises(ValueError, match="has 6 bytes .* describes 10") as err:
        IndexedDataset(prefix)
    assert prefix + ".bin" in str(err.value)


def test_pickles_by_path(tmp_path):
    import pickle

    prefix = _write_small(tmp_path)
    blob = pickle.dumps(IndexedDataset(prefix))
    assert len(blob) < 300 and pickle.loads(blob)[1].tolist() == [4, 5]


def test_missing_files_say_to_give_the_prefix(tmp_path):
    with pytest.raises(FileNotFoundError, match="prefix without"):
        IndexedDataset(str(tmp_path / "nothing"))
