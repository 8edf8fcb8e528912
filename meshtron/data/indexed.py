"""Indexed token datasets in the MMIDIDX layout (``PREFIX.bin`` + ``PREFIX.idx``).

Bit-compatible with Megatron-LM's files, so data preprocessed by either tool trains in both.
``.bin`` holds every sequence's token ids back to back; ``.idx`` holds a 34-byte header, then
sequence lengths (int32), byte pointers into ``.bin`` (int64) and document boundaries (int64).
"""

from __future__ import annotations

import os
import struct

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def best_dtype(vocab_size: int) -> type:
    """The narrowest token dtype Megatron would pick: uint16 below 65500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dtype_code(dtype) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} has no MMIDIDX code; use one of {[np.dtype(d).name for d in DTYPE_CODES.values()]}") from None


class IndexedDatasetBuilder:
    """Streams token sequences to ``bin_path``; ``finalize`` writes the index."""

    def __init__(self, bin_path: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self._bin_path = bin_path
        self._file = open(bin_path, "wb")
        self._lengths: list[int] = []
        self._doc_indices: list[int] = [0]
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._bounds = (int(info.min), int(info.max))
        else:
            self._bounds = None

    def _write(self, tokens) -> int:
        arr = np.asarray(tokens)
        if self._bounds is not None and arr.size and arr.dtype != self.dtype:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._bounds[0] or hi > self._bounds[1]:
                raise ValueError(
                    f"{self._bin_path}: token id range [{lo}, {hi}] does not fit {self.dtype.name}; "
                    f"build with dtype=best_dtype(vocab_size) for the tokenizer's vocabulary"
                )
        self._file.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        return int(arr.size)

    def add_item(self, tokens) -> None:
        """Append one sequence to the current document."""
        self._lengths.append(self._write(tokens))

    def add_documents(self, tokens, lengths, sequences_per_document=None) -> None:
        """Many documents at once from one flat array (the preprocessing fast path).

        ``lengths`` are the sequence lengths; ``sequences_per_document`` how many sequences each
        document has (default one each; 0 makes an empty document).
        """
        lengths = np.asarray(lengths, np.int64)
        if lengths.sum() != np.size(tokens):
            raise ValueError(f"{self._bin_path}: lengths sum to {lengths.sum()} but {np.size(tokens)} tokens were given")
        per_doc = np.ones(len(lengths), np.int64) if sequences_per_document is None else np.asarray(sequences_per_document, np.int64)
        if per_doc.sum() != len(lengths):
            raise ValueError(f"{self._bin_path}: documents hold {per_doc.sum()} sequences but {len(lengths)} lengths were given")
        self._write(tokens)
        base = len(self._lengths)
        self._lengths.extend(lengths.tolist())
        self._doc_indices.extend((base + np.cumsum(per_doc)).tolist())

    def end_document(self) -> None:
        """Close the current document after one or more ``add_item`` calls."""
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens) -> None:
        """One document as one sequence. An empty one adds a document with no sequence, as Megatron does."""
        if len(tokens):
            self.add_item(tokens)
        self.end_document()

    def abort(self) -> None:
        """Close and delete the partly written ``.bin`` (a failed build leaves no file behind)."""
        self._file.close()
        if os.path.exists(self._bin_path):
            os.remove(self._bin_path)

    def finalize(self, idx_path: str) -> None:
        self._file.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.asarray(self._doc_indices, dtype=np.int64)
        with open(idx_path, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, _VERSION, self._code, len(lengths), len(docs)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(docs.tobytes())


class IndexedDataset:
    """Read-only view of ``path_prefix.bin``/``.idx``; ``ds[i]`` is sequence i as a numpy array (no copy)."""

    def __init__(self, path_prefix: str):
        self.path_prefix = path_prefix
        idx_path, bin_path = path_prefix + ".idx", path_prefix + ".bin"
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{p} not found; --data-path takes the prefix without .bin/.idx (as written by `meshtron preprocess`)")
        self._read_index(idx_path)
        self._check_bin(bin_path)
        self._bin = np.memmap(bin_path, dtype=self.dtype, mode="r") if os.path.getsize(bin_path) else np.zeros(0, self.dtype)

    def _read_index(self, idx_path: str) -> None:
        size = os.path.getsize(idx_path)

        def bad(what: str) -> ValueError:
            return ValueError(f"{idx_path}: not a valid MMIDIDX index ({what}); re-run `meshtron preprocess` to rebuild it")

        if size < _HEADER.size:
            raise bad(f"{size} bytes is shorter than the {_HEADER.size}-byte header")
        with open(idx_path, "rb") as f:
            magic, version, code, n, d = _HEADER.unpack(f.read(_HEADER.size))
        if magic != _MAGIC:
            raise bad(f"magic {magic!r}, expected {_MAGIC!r}")
        if version != _VERSION:
            raise bad(f"version {version}, expected {_VERSION}")
        if code not in DTYPE_CODES:
            raise bad(f"unknown dtype code {code}")
        expected = _HEADER.size + 12 * n + 8 * d
        if size not in (expected, expected + n):  # + n: the multimodal variant's per-sequence modes
            raise bad(f"{n} sequences and {d} document indices need {expected} bytes, file has {size}")
        if d < 1:
            raise bad("document index is empty")
        self.dtype = np.dtype(DTYPE_CODES[code])
        mm = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(mm, dtype=np.int32, count=n, offset=off)
        self.sequence_pointers = np.frombuffer(mm, dtype=np.int64, count=n, offset=off + 4 * n)
        self.document_indices = np.frombuffer(mm, dtype=np.int64, count=d, offset=off + 12 * n)
        docs = self.document_indices
        if docs[0] != 0 or docs[-1] != n or np.any(np.diff(docs) < 0):
            raise bad(f"document indices must rise from 0 to {n}, got {docs[0]}..{docs[-1]}")
        if n and (np.any(self.sequence_lengths < 0) or self.sequence_pointers[0] != 0):
            raise bad("negative sequence length or first pointer not 0")
        if n > 1 and np.any(np.diff(self.sequence_pointers) != self.sequence_lengths[:-1].astype(np.int64) * self.dtype.itemsize):
            raise bad("sequence pointers do not match sequence lengths")

    def _check_bin(self, bin_path: str) -> None:
        n = len(self.sequence_lengths)
        need = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n else 0
        have = os.path.getsize(bin_path)
        if have != need:
            raise ValueError(
                f"{bin_path}: has {have} bytes but its index {self.path_prefix}.idx describes {need}; "
                f"the pair is truncated or mismatched, re-run `meshtron preprocess`"
            )

    def __getstate__(self) -> str:
        return self.path_prefix  # reopen by path: pickling the memmaps would copy every token

    def __setstate__(self, path_prefix: str) -> None:
        self.__init__(path_prefix)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset:offset+length`` of sequence ``i`` (to its end when length is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.path_prefix} with {n} sequences")
        i %= n
        seq_len = int(self.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"{self.path_prefix}: slice [{offset}, {offset + length}) outside sequence {i} of length {seq_len}")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._bin[start : start + length]

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))
