"""Sizes from the model itself: every count of parameters is read off the family's model built on
the meta device (shapes only, no storage, no random draws), never worked out by a formula beside it.

``model_sizes(cfg, vocab_size, max_seq_length)`` builds ``build_model(...)`` on the meta device
once per config (cached) and keeps one ``ParamSize`` per parameter: its name, global shape and
dtype, where the pipeline puts it (the first stage's embedding pieces, a block, or the last
stage's head) and, for a routed expert (a module the plan marks ``ExpertParallel``), the part a
token passes: ``moe_router_topk / num_experts`` of it. The totals (the trainer's log, MFU), the
active counts (FLOPs per token) and the per-block counts (the pipeline's cost model) are sums over
these records; ``parallel/sizes.py`` applies the plan to the same meta model for one rank's shards
(``meshtron estimate``).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch

from meshtron.config import ModelConfig
from meshtron.models import contract as mc
from meshtron.models.registry import spec_for

HEAD, BLOCK, TAIL = "head", "block", "tail"  # the first stage's pieces, one of the blocks, the last stage's


@dataclass(frozen=True)
class ParamSize:
    """One parameter of the whole model: ``place`` (``HEAD``, ``BLOCK`` number ``block``, ``TAIL``)
    and ``active``, its elements a token multiplies (all, or a routed expert's top-k share)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    place: str
    block: int
    expert: bool
    active: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSizes:
    """Every parameter of one model, in ``named_parameters`` order (a tied weight once)."""

    params: tuple[ParamSize, ...]
    num_blocks: int

    def total(self, active: bool = False) -> int:
        """All elements; with ``active`` a routed expert counts the share a token passes."""
        return sum(p.active if active else p.numel for p in self.params)

    def block_counts(self, active: bool = False) -> list[int]:
        """Each block's elements in model order (``active`` as in ``total``)."""
        out = [0] * self.num_blocks
        for p in self.params:
            if p.place == BLOCK:
                out[p.block] += p.active if active else p.numel
        return out


def meta_model(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0, padded_vocab_size: int = 0) -> mc.ModelFamily:
    """``build_model(...)`` on the meta device: shapes only, built in well under a second for the
    largest presets, drawing nothing from the caller's random state."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return spec_for(cfg).build(cfg, vocab_size, max_seq_length, padded_vocab_size)


def styled_modules(model: torch.nn.Module, plan: mc.Plan) -> dict[str, mc.Style]:
    """Module name -> the style of the first plan entry whose pattern matches it."""
    out = {}
    for name, _ in model.named_modules():
        style = next((s for pattern, s in plan if fnmatch.fnmatchcase(name, pattern)), None)
        if style is not None:
            out[name] = style
    return out


def places(model: mc.ModelFamily) -> dict[str, tuple[str, int]]:
    """``{parameter name: (place, block)}``: in block ``i`` of ``model.blocks()``, else with the
    first stage's pieces (``pipeline_pieces().embed``), else the last stage's. Read from the
    model's modules, so it holds after the plan replaced some of them."""
    names = {id(module): name for name, module in model.named_modules()}
    prefixes = [names[id(block)] + "." for block in model.blocks()]
    embed = set(model.pipeline_pieces().embed)
    out = {}
    for name, _ in model.named_parameters():
        block = next((i for i, prefix in enumerate(prefixes) if name.startswith(prefix)), -1)
        out[name] = (BLOCK, block) if block >= 0 else ((HEAD if name.split(".")[0] in embed else TAIL), -1)
    return out


def expert_parameters(model: mc.ModelFamily) -> set[str]:
    """Names of the routed experts' parameters: those of modules the plan marks ``ExpertParallel``."""
    out = set()
    for name, style in styled_modules(model, model.parallel_plan()).items():
        if isinstance(style, mc.ExpertParallel):
            out |= {f"{name}.{pname}" for pname, _ in model.get_submodule(name).named_parameters()}
    return out


def config_key(cfg: ModelConfig) -> str:
    """A hashable stand-in for a (mutable) config: every field's value."""
    return repr(cfg)


_CACHE: dict[tuple[str, int, int], ModelSizes] = {}


def model_sizes(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0) -> ModelSizes:
    """The parameters of ``build_model(cfg, vocab_size, max_seq_length)``, read off its meta build
    (once per config: the estimator and the pipeline's cost model ask many times)."""
    key = (config_key(cfg), vocab_size, max_seq_length)
    if key not in _CACHE:
        if len(_CACHE) >= 64:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = _measure(cfg, vocab_size, max_seq_length)
    return _CACHE[key]


def _measure(cfg: ModelConfig, vocab_size: int, max_seq_length: int) -> ModelSizes:
    model = meta_model(cfg, vocab_size, max_seq_length)
    where, experts = places(model), expert_parameters(model)
    share = (cfg.moe_router_topk, cfg.num_experts) if cfg.num_experts else (1, 1)
    params = []
    for name, p in model.named_parameters():
        place, block = where[name]
        expert = name in experts
        active = p.numel() * share[0] // share[1] if expert else p.numel()
        params.append(ParamSize(name, tuple(p.shape), p.dtype, place, block, expert, active))
    return ModelSizes(tuple(params), len(model.blocks()))
