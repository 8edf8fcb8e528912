"""Safetensors shards written while the tensors arrive: ``hf-export``'s output with memory bounded.

The exporters yield ``(name, tensor)`` pairs one layer at a time; ``write_shards`` keeps them until
the next would push the shard past ``max_shard_size`` bytes, writes that shard and lets its tensors
go, so the export holds at most one shard plus the tensors a layer is being converted from. This is
``save_pretrained``'s layout: one ``model.safetensors`` when everything fits one shard, else
``model-00001-of-0000N.safetensors``... with ``model.safetensors.index.json`` (``metadata.total_size``,
``weight_map`` from each name to its file), which transformers and ``hf-import`` read. A tensor
larger than the limit gets a shard of its own, as in transformers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # transformers' "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_STALE = re.compile(r"model(-\d{5}(-of-\d{5})?)?\.safetensors(\.index\.json|\.partial)?")  # ours, finished or not


def parse_size(text: str) -> int:
    """Bytes of ``"5GB"``, ``"500MB"``, ``"100KiB"`` or a plain number (transformers' units: KB = 1000)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not found or found.group(2).upper() not in _UNITS or float(found.group(1)) <= 0:
        raise ValueError(f"not a size: {text!r} (write e.g. 5GB, 500MB or a number of bytes)")
    return int(float(found.group(1)) * _UNITS[found.group(2).upper()])


def write_shards(tensors: Iterable[tuple[str, torch.Tensor]], hf_dir: Path, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> list[Path]:
    """Write ``tensors`` into ``hf_dir`` as shards of at most ``max_shard_size`` bytes (plus the
    index when there are several); returns the shard files. Weight files of an earlier export in
    ``hf_dir`` are removed first, so transformers never finds a stale one beside the new."""
    from safetensors.torch import save_file

    for old in hf_dir.iterdir():
        if _STALE.fullmatch(old.name):
            old.unlink()
    shards: list[Path] = []
    where: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            path = hf_dir / f"model-{len(shards) + 1:05d}.safetensors.partial"
            save_file(shard, str(path), metadata={"format": "pt"})
            shards.append(path)
        shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        if name in where:
            raise ValueError(f"hf-export: the exporter wrote {name} twice")
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_size:
            flush()
        shard[name], shard_bytes, total = tensor.contiguous(), shard_bytes + size, total + size
        where[name] = len(shards)
    flush()
    names = [WEIGHTS] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    final = [path.rename(hf_dir / name) for path, name in zip(shards, names)]
    mask = os.umask(0)  # safetensors writes 0600 files; give them the mode any new file gets here
    os.umask(mask)
    for path in final:
        path.chmod(0o666 & ~mask)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {name: names[i] for name, i in sorted(where.items())}}
        (hf_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return final
