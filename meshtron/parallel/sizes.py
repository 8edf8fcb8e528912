"""One rank's parameters under a layout, read from the plan's records (``meshtron estimate``).

The family's model is built on the meta device (``models.sizes.meta_model``) and ``parallelize``d
over a ``ShapeMesh``: the sizes of a tp / ep / etp layout and rank 0's place in it, no process
group. The ``ParamMeta`` each parameter gets says what this rank holds of it (its ``tp_dim`` cut
to ``local_index``, a routed expert's dim 0 to ``1 / ep_size``), exactly what a built runner
holds, so the estimate is exact for every family and every plan style without a formula per
family. Parameters come in pipeline order (``models.sizes.places``): ``head`` (what the first
stage adds: embeddings), one count per block, ``tail`` (what the last stage adds: final norms,
heads, output layer). The *dense* part reduces (and shards) over dp x cp; the routed experts
(``grad_group`` "edp") over the expert-data-parallel group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtron.config import ModelConfig
from meshtron.models import contract as mc
from meshtron.models.sizes import BLOCK, HEAD, config_key, meta_model, places
from meshtron.parallel.mesh import ShapeMesh
from meshtron.parallel.plan import parallelize


@dataclass(frozen=True)
class BlockParameters:
    """One block's parameters on one rank: ``dense`` (split by tp) and ``expert`` (routed experts);
    ``*_matrix``: how many of them are matrices (``ParamMeta.matrix``: Muon's, AdamW's the rest)."""

    dense: int
    expert: int = 0
    dense_matrix: int = 0
    expert_matrix: int = 0


@dataclass(frozen=True)
class RankParameters:
    """``head`` + ``blocks`` + ``tail`` of one tp/ep/etp rank (all of them when pp is 1)."""

    head: int
    blocks: list[BlockParameters]
    tail: int
    head_matrix: int = 0  # of ``head`` and ``tail``, the matrices (``ParamMeta.matrix``)
    tail_matrix: int = 0

    @property
    def total(self) -> int:
        return self.head + self.tail + sum(b.dense + b.expert for b in self.blocks)


def local_numel(meta: mc.ParamMeta) -> int:
    """Elements of this rank's shard of the parameter ``meta`` records."""
    shape = list(meta.global_shape)
    index = meta.local_index()
    if index is not None:
        shape[meta.tp_dim] = len(index)
    if meta.ep_size > 1:
        shape[0] //= meta.ep_size
    return math.prod(shape)


def shape_mesh(tp: int = 1, ep: int = 1, etp: int = 1) -> ShapeMesh:
    """The smallest mesh of these sizes: data-parallel ranks only as many as ep x etp needs."""
    experts = ep * etp
    return ShapeMesh(tp=tp, dp=experts // math.gcd(tp, experts), ep=ep, etp=etp)


_CACHE: dict[tuple, RankParameters] = {}


def rank_parameters(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0, tp: int = 1, ep: int = 1, etp: int = 1) -> RankParameters:
    """This rank's parameters of the model ``build_model(cfg, vocab_size, max_seq_length)`` under
    tensor parallelism ``tp``, expert parallelism ``ep`` and expert tensor parallelism ``etp``
    (once per config and layout: the meta model is built and planned anew for each)."""
    key = (config_key(cfg), vocab_size, max_seq_length, tp, ep, etp)
    if key not in _CACHE:
        if len(_CACHE) >= 64:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = _measure(cfg, vocab_size, max_seq_length, shape_mesh(tp, ep, etp))
    return _CACHE[key]


def _measure(cfg: ModelConfig, vocab_size: int, max_seq_length: int, mesh: ShapeMesh) -> RankParameters:
    model = meta_model(cfg, vocab_size, max_seq_length)
    metas = parallelize(model, mesh)
    counts = {key: [0, 0] for key in (HEAD, "tail")}  # [all, matrices]
    blocks = [{"dense": [0, 0], "expert": [0, 0]} for _ in model.blocks()]
    for name, (place, block) in places(model).items():
        meta = metas[name]
        if place == BLOCK:
            count = blocks[block]["expert" if meta.grad_group == "edp" else "dense"]
        else:
            count = counts[HEAD if place == HEAD else "tail"]
        count[0] += local_numel(meta)
        count[1] += local_numel(meta) if meta.matrix else 0
    per_block = [BlockParameters(b["dense"][0], b["expert"][0], b["dense"][1], b["expert"][1]) for b in blocks]
    return RankParameters(counts[HEAD][0], per_block, counts["tail"][0], counts[HEAD][1], counts["tail"][1])
