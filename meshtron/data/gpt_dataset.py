"""GPT pretraining samples from an indexed dataset, with Megatron-LM's sampling semantics.

Three numpy indices define the order: a document index (the split's documents repeated for
enough epochs, shuffled), a sample index (where each sample of ``seq_length + 1`` tokens starts:
position in the document index and offset; consecutive samples share one token), and a shuffle
index over samples. The same seed gives the same samples as Megatron for the same files, and the
indices are cached as ``.npy`` so every rank and every restart reuses them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings

import numpy as np
import torch

from meshtron.data.indexed import IndexedDataset
from meshtron.progress import progress

_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
_FINAL_EPOCH_THRESHOLD = 0.80  # a last epoch giving fewer samples than this share is shuffled on its own


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """``--split 969,30,1`` -> train/valid/test document ranges, rounded the way Megatron rounds."""
    try:
        weights = [float(x) for x in re.split(r"[,/]", split) if x.strip()]
    except ValueError:
        raise ValueError(f"--split '{split}' must be comma-separated numbers like 969,30,1") from None
    if not 0 < len(weights) <= 3 or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"--split '{split}' must be up to 3 non-negative weights with a positive sum, like 969,30,1")
    weights = weights + [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [0] + [b - diff for b in bounds[1:]]
    # Megatron stops here; rounding can push a boundary below 0 for tiny splits, so clamp it.
    bounds = np.maximum.accumulate(np.clip(bounds, 0, num_documents)).tolist()
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """Rows ``(position in document_index, offset)`` where sample k starts (token k*seq_length of the stream).

    Row k+1 is where sample k ends (inclusive), so there is one row more than samples.
    """
    lengths = sequence_lengths[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    num_samples = (total - 1) // seq_length
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - lengths[position])
    return np.stack((position, offset), axis=1)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def cached_indices(description: dict, cache_dir: str, name: str, names: tuple[str, ...], build) -> tuple[dict[str, np.ndarray], bool]:
    """Index arrays ``names`` for ``description`` from ``cache_dir``, or ``build()`` them and cache them there.

    Files are ``{md5 of description}-{class}-{name}-{array}.npy``, written atomically so ranks
    building at once never read half a file; returns the arrays and whether the cache had them.
    """
    digest = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
    stem = os.path.join(cache_dir, f"{digest}-{description['class']}-{name}")
    paths = {k: f"{stem}-{k}.npy" for k in names}
    if all(os.path.isfile(p) for p in paths.values()):
        return {k: np.load(p, mmap_mode="r") for k, p in paths.items()}, True
    arrays = build()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with open(f"{stem}-description.json", "w") as f:
            json.dump(description, f, indent=1)
        for k, p in paths.items():
            tmp = f"{p[:-4]}.tmp{os.getpid()}.npy"
            np.save(tmp, arrays[k])
            os.replace(tmp, p)
    except OSError as exc:
        warnings.warn(f"cannot cache {name} indices in {cache_dir} ({exc}); set --data-cache-path to a writable folder")
    return arrays, False


def default_cache_dir(indexed: IndexedDataset, cache_dir: str | None) -> str:
    """``--data-cache-path``, else a ``cache`` folder beside the data."""
    return cache_dir or os.path.join(os.path.dirname(os.path.abspath(indexed.path_prefix)), "cache")


def sample_dict(text: np.ndarray, eod: int | None, reset_position_ids: bool, reset_attention_mask: bool, eod_mask_loss: bool) -> dict:
    """``seq_length + 1`` tokens -> model inputs; ``document_ids`` (no dense mask) when documents must not attend across."""
    text = torch.from_numpy(np.asarray(text, dtype=np.int64))
    tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
    n = tokens.numel()
    is_eod = tokens == eod if eod is not None else torch.zeros(n, dtype=torch.bool)
    loss_mask = torch.ones(n, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
    position_ids = torch.arange(n, dtype=torch.int64)
    if reset_position_ids or reset_attention_mask:
        # a new document starts right after each eod token
        document_ids = torch.zeros(n, dtype=torch.int64)
        document_ids[1:] = torch.cumsum(is_eod[:-1].long(), 0)
        if reset_position_ids:
            doc_starts = torch.cat((torch.zeros(1, dtype=torch.int64), torch.nonzero(is_eod[:-1]).flatten() + 1))
            position_ids = position_ids - doc_starts[document_ids]
        if reset_attention_mask:
            out["document_ids"] = document_ids
    out["position_ids"] = position_ids
    return out


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of ``seq_length`` tokens from documents ``document_range`` of ``indexed``."""

    def __init__(
        self,
        indexed: IndexedDataset,
        document_range: tuple[int, int],
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str | None,
        eod: int,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
        name: str = "train",
    ):
        start, end = (int(x) for x in document_range)
        if not 0 <= start < end <= len(indexed):
            raise ValueError(f"{name} document range [{start}, {end}) is empty or outside {indexed.path_prefix} ({len(indexed)} documents); check --split")
        if num_samples < 1 or seq_length < 1:
            raise ValueError(f"{name}: num_samples ({num_samples}) and --seq-length ({seq_length}) must be positive")
        self.indexed, self.name, self.eod = indexed, name, eod
        self.num_samples, self.seq_length = num_samples, seq_length
        self.flags = (reset_position_ids, reset_attention_mask, eod_mask_loss)
        self.description = {
            "class": "GPTDataset",
            "path_prefix": os.path.abspath(indexed.path_prefix),
            "num_sequences": len(indexed),
            "document_range": [start, end],
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
            "format": 1,
        }
        self.cache_dir = default_cache_dir(indexed, cache_dir)
        arrays, self.cache_hit = cached_indices(self.description, self.cache_dir, name, _INDEX_NAMES, lambda: self._build(np.arange(start, end, dtype=np.int32), seed))
        self.document_index, self.sample_index, self.shuffle_index = (arrays[k] for k in _INDEX_NAMES)

    def _build(self, documents: np.ndarray, seed: int) -> dict[str, np.ndarray]:
        seq = self.seq_length
        tokens_per_epoch = int(self.indexed.sequence_lengths[documents].sum(dtype=np.int64))
        if tokens_per_epoch <= seq:
            raise ValueError(
                f"{self.name} split of {self.indexed.path_prefix} has {tokens_per_epoch} tokens, fewer than one sample of "
                f"--seq-length {seq} + 1; lower --seq-length, change --split or add data"
            )
        num_epochs = math.ceil((self.num_samples * seq + 1) / tokens_per_epoch)
        separate_final_epoch, before_final = False, 0
        if num_epochs > 1:
            before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq
            per_epoch = (tokens_per_epoch - 1) // seq
            separate_final_epoch = self.num_samples - before_final < int(_FINAL_EPOCH_THRESHOLD * per_epoch)
        rng = np.random.RandomState(seed)
        # Each index is one numpy pass with no Python loop to report from, so the bar counts the three.
        with progress(3, f"{self.name} indices", unit="index") as bar:
            document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
            bar.update(1)
            sample_index = build_sample_index(self.indexed.sequence_lengths, document_index, seq)
            bar.update(1)
            total = len(sample_index) - 1
            shuffle_index = build_shuffle_index(before_final if separate_final_epoch else total, total, rng)
            bar.update(1)
        return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, i: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``i``."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name} sample {i} out of range [0, {self.num_samples})")
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        doc = self.document_index
        if d0 == d1:
            return self.indexed.get(int(doc[d0]), int(o0), int(o1 - o0 + 1))
        parts = [self.indexed.get(int(doc[d0]), int(o0))]
        parts += [self.indexed.get(int(doc[k])) for k in range(d0 + 1, d1)]
        parts.append(self.indexed.get(int(doc[d1]), 0, int(o1 + 1)))
        return np.concatenate(parts)

    def __getitem__(self, i: int) -> dict:
        return sample_dict(self.sample_tokens(i), self.eod, *self.flags)


class MockGPTDataset(torch.utils.data.Dataset):
    """Random tokens, no files; sample ``i`` depends only on ``(seed, i)``."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, reset_attention_mask: bool = False):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed
        self.reset_attention_mask = reset_attention_mask

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"mock sample {i} out of range [0, {self.num_samples})")
        text = np.random.default_rng([self.seed, i]).integers(0, self.vocab_size, self.seq_length + 1)
        return sample_dict(text, None, False, self.reset_attention_mask, False)
