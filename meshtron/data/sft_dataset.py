"""Supervised fine-tuning samples: conversations from a jsonl, packed into sequences.

Each line of ``--data-path FILE.jsonl`` is one conversation, either
``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}``
or ``{"prompt": "...", "response": "..."}`` (an optional ``"system"`` string too). A conversation
is laid out by ``meshtron.data.chat_template`` and tokenized once; the ids, a per-token
"assistant" flag and the conversation offsets are cached as ``.npy`` (like the GPT indices) and
reused while the file, the tokenizer and the template are unchanged.

A conversation of n tokens is a document of n - 1 positions (inputs ``ids[:-1]``, labels
``ids[1:]``, loss only where the label is an assistant token). Documents are packed whole, in an
order shuffled with the seed (a new order each epoch), into sequences of ``--seq-length``
positions: the next document goes into the current sequence while it fits, else starts a new
one, and the rest is padding with no loss. Every document has its own ``document_ids`` and
positions from 0, so attention stays inside it and the loss of a packed sequence is the sum of
the losses each document would have alone. A document longer than ``--seq-length`` is truncated.
Sample ``i`` depends only on the seed and ``i``, so resuming at a consumed-sample count continues
exactly.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import torch

from meshtron.data.chat_template import ChatTemplate, plain_pieces
from meshtron.data.gpt_dataset import cached_indices, split_document_ranges
from meshtron.progress import CHUNK, progress

_TOKEN_ARRAYS = ("tokens", "assistant", "offsets")
_PACKING_ARRAYS = ("document_order", "sample_starts")


def record_messages(record, where: str) -> list[dict]:
    """The messages of one jsonl record, or a ValueError naming ``where`` (file:line)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object with 'messages' or 'prompt' and 'response'")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': ..., 'content': ...}}")
        for j, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: message {j} must be an object with string 'role' and 'content', got {json.dumps(m)[:120]}")
    elif "prompt" in record or "response" in record:
        fields = {k: record.get(k) for k in ("prompt", "response")}
        bad = [k for k, v in fields.items() if not isinstance(v, str)]
        if bad or not isinstance(record.get("system", ""), str):
            raise ValueError(f"{where}: 'prompt' and 'response' (and 'system', when given) must be strings; {', '.join(bad) or 'system'} is not")
        messages = [{"role": "user", "content": fields["prompt"]}, {"role": "assistant", "content": fields["response"]}]
        if record.get("system"):
            messages.insert(0, {"role": "system", "content": record["system"]})
    else:
        raise ValueError(f"{where}: no 'messages' and no 'prompt'/'response' keys (found {sorted(record)[:8]})")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message, so nothing to train on")
    return messages


def read_conversations(path: str) -> list[tuple[int, list[dict]]]:
    """``(line number, messages)`` of every non-blank line of the jsonl at ``path``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            out.append((line_no, record_messages(record, f"{path}:{line_no}")))
    if not out:
        raise ValueError(f"{path}: no conversations (the file is empty)")
    return out


def tokenize_conversation(messages: list[dict], tokenizer, template: ChatTemplate | None) -> tuple[list[int], list[bool]]:
    """Token ids of one conversation and, per token, whether it is the assistant's."""
    pieces = template.pieces(messages) if template is not None else plain_pieces(messages, tokenizer.eod)
    ids: list[int] = []
    assistant: list[bool] = []
    for piece, trained in pieces:
        piece_ids = piece if isinstance(piece, list) else tokenizer.encode_text(piece)
        ids += piece_ids
        assistant += [trained] * len(piece_ids)
    return ids, assistant


def tokenize_file(path: str, tokenizer, template: ChatTemplate | None) -> dict[str, np.ndarray]:
    """Every conversation of ``path``: flat ``tokens`` and ``assistant`` flags, and ``offsets`` of each conversation."""
    tokens, assistant, offsets = [], [], [0]
    conversations = read_conversations(path)
    with progress(len(conversations), "tokenizing conversations", unit="conv") as bar:
        for k, (line_no, messages) in enumerate(conversations, 1):
            try:
                ids, flags = tokenize_conversation(messages, tokenizer, template)
            except ValueError as exc:
                raise ValueError(f"{path}:{line_no}: {exc}") from None
            tokens += ids
            assistant += flags
            offsets.append(len(tokens))
            if k % CHUNK == 0:
                bar.update(CHUNK)
        bar.update(len(conversations) % CHUNK)
    return {
        "tokens": np.asarray(tokens, dtype=np.int32),
        "assistant": np.asarray(assistant, dtype=np.bool_),
        "offsets": np.asarray(offsets, dtype=np.int64),
    }


def pack_documents(positions: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int) -> dict[str, np.ndarray]:
    """Next-fit packing of ``documents`` (``positions[d]`` each, at most ``seq_length``), epoch after
    epoch in a fresh shuffled order, until ``num_samples`` sequences are full: the documents of
    sample i are ``document_order[sample_starts[i]:sample_starts[i + 1]]``."""
    rng = np.random.RandomState(seed)
    order, starts, used = [], [0], 0
    with progress(num_samples, "packing conversations", unit="sample") as bar:
        while len(starts) <= num_samples:
            epoch = documents.copy()
            rng.shuffle(epoch)
            for d in epoch.tolist():
                if used + positions[d] > seq_length:
                    starts.append(len(order))
                    used = 0
                    if (len(starts) - 1) % CHUNK == 0:  # len(starts) - 1 samples are complete
                        bar.update(CHUNK)
                    if len(starts) > num_samples:
                        break
                order.append(d)
                used += positions[d]
        bar.update(len(starts) - 1 - bar.n)
    return {"document_order": np.asarray(order, dtype=np.int64), "sample_starts": np.asarray(starts, dtype=np.int64)}


def _file_description(path: str, tokenizer, template: ChatTemplate | None) -> dict:
    stat = os.stat(path)
    layout = "plain" if template is None else f"{template.source}:{hashlib.md5(template.text.encode()).hexdigest()}"
    return {
        "class": "SFTTokens",
        "path": os.path.abspath(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "tokenizer": f"{tokenizer.name} vocab {tokenizer.vocab_size} eod {tokenizer.eod}",
        "layout": layout,
        "format": 1,
    }


class SFTDataset(torch.utils.data.Dataset):
    """``num_samples`` packed sequences of ``seq_length`` positions from conversations
    ``document_range`` of the tokenized file ``arrays`` (``tokenize_file``'s)."""

    def __init__(self, arrays: dict, file_description: dict, document_range: tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, cache_dir: str, pad_id: int, name: str = "train"):  # fmt: skip
        self.tokens, self.assistant, self.offsets = (arrays[k] for k in _TOKEN_ARRAYS)
        self.seq_length, self.num_samples, self.pad_id, self.name = seq_length, num_samples, pad_id, name
        start, end = document_range
        lengths = np.diff(self.offsets)
        self.positions = np.minimum(np.maximum(lengths - 1, 0), seq_length)
        assistant_before = np.concatenate(([0], np.cumsum(self.assistant, dtype=np.int64)))  # assistant tokens before each index
        ends = self.offsets[start + 1 : end + 1]
        trained_labels = assistant_before[ends] - assistant_before[np.minimum(self.offsets[start:end] + 1, ends)]  # labels skip token 0
        documents = np.arange(start, end, dtype=np.int64)[trained_labels > 0]
        if len(documents) == 0:
            raise ValueError(f"{name} split of {file_description['path']} has no conversation with an assistant token to train on; check --split")
        self.num_documents = len(documents)
        self.num_truncated = int((lengths[documents] - 1 > seq_length).sum())
        description = {**file_description, "class": "SFTPacking", "document_range": [start, end], "num_samples": num_samples,
                       "seq_length": seq_length, "seed": seed}  # fmt: skip
        packing, self.cache_hit = cached_indices(description, cache_dir, name, _PACKING_ARRAYS,
                                                 lambda: pack_documents(self.positions, documents, num_samples, seq_length, seed))  # fmt: skip
        self.document_order, self.sample_starts = (packing[k] for k in _PACKING_ARRAYS)

    def __len__(self) -> int:
        return self.num_samples

    def documents(self, i: int) -> np.ndarray:
        """The conversations packed into sample ``i``."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name} sample {i} out of range [0, {self.num_samples})")
        return self.document_order[self.sample_starts[i] : self.sample_starts[i + 1]]

    def document_tensors(self, d: int) -> dict[str, torch.Tensor]:
        """Conversation ``d`` alone as one document: inputs, labels, loss mask (truncated to ``seq_length``)."""
        a = int(self.offsets[d])
        n = int(self.positions[d])
        ids = torch.from_numpy(np.asarray(self.tokens[a : a + n + 1], dtype=np.int64))
        trained = torch.from_numpy(np.asarray(self.assistant[a + 1 : a + n + 1], dtype=np.float32))
        return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": trained}

    def __getitem__(self, i: int) -> dict:
        docs = [self.document_tensors(int(d)) for d in self.documents(i)]
        pad = self.seq_length - sum(doc["tokens"].numel() for doc in docs)
        out = {k: torch.cat([doc[k] for doc in docs] + [torch.full((pad,), self.pad_id if k != "loss_mask" else 0, dtype=docs[0][k].dtype)])
               for k in ("tokens", "labels", "loss_mask")}  # fmt: skip
        lengths = [doc["tokens"].numel() for doc in docs] + [pad]
        out["position_ids"] = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
        out["document_ids"] = torch.cat([torch.full((n,), k, dtype=torch.int64) for k, n in enumerate(lengths)])
        return out

    def describe(self) -> str:
        filled = self.positions[self.document_order[: self.sample_starts[-1]]].sum() / (self.num_samples * self.seq_length)
        return (f"{self.name}: {self.num_documents} conversations packed into {self.num_samples} sequences of {self.seq_length}, "
                f"{filled:.0%} of positions filled, {self.num_truncated} truncated to --seq-length")  # fmt: skip


def build_sft_datasets(data_cfg, tokenizer, num_samples: tuple[int, int, int], seed: int, template: ChatTemplate | None) -> tuple:
    """(train, valid, test) of ``SFTDataset`` from the jsonl in ``--data-path`` (a split with no
    samples or no conversations is None); ``--split`` divides the conversations in file order."""
    path = data_cfg.data_path[0]
    cache_dir = data_cfg.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(path)), "cache")
    description = _file_description(path, tokenizer, template)
    arrays, _ = cached_indices(description, cache_dir, "sft", _TOKEN_ARRAYS, lambda: tokenize_file(path, tokenizer, template))
    ranges = split_document_ranges(data_cfg.split, len(arrays["offsets"]) - 1)
    names = ("train", "valid", "test")
    return tuple(
        SFTDataset(arrays, description, ranges[k], n, data_cfg.seq_length, seed, cache_dir, tokenizer.eod, names[k])
        if n > 0 and ranges[k][1] > ranges[k][0] else None
        for k, n in enumerate(num_samples)
    )  # fmt: skip
