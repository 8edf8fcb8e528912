"""The family registry: one ``FamilySpec`` per model family, the one thing code outside ``models/``
asks about a family (in the spirit of torchtitan's ``TrainSpec``).

``model.model_type`` names a registered family. Training, validation, the estimator, the data
builder, generation and the tools ask its spec (``spec_for(cfg.model)``) what they need — how to
build it, check it, count it, feed it — instead of comparing ``model_type`` with names, so adding a
family is its module plus one ``register(FamilySpec(...))`` line, and nothing outside it changes.

The built-in families register in ``models/families/``. A family living elsewhere (a user's
package, ``tests/families/``) registers when its module is imported; ``--model-type
package.module:name`` imports ``package.module`` first, so a run, a spawned rank or a checkpoint's
config that names it that way finds it in a fresh process.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshtron.config import Config, DataConfig, ModelConfig

if TYPE_CHECKING:
    from meshtron.models.contract import ModelFamily
    from meshtron.parallel.pipeline_balance import PipelineCosts


@dataclass(frozen=True)
class BlockShape:
    """One block as the memory estimate sees it (``estimate.block_activations``): the tokens of a
    sample it runs on, whether its MLP is a mixture of experts, and the tokens of the other
    sequence its cross-attention reads (0: none)."""

    tokens: int
    moe: bool = False
    cross_tokens: int = 0


def no_errors(cfg: Config) -> list[str]:
    return []


def num_layers(m: ModelConfig) -> int:
    return m.num_layers


def sequence_tokens(d: DataConfig) -> int:
    return d.seq_length


def dense_blocks(cfg: Config) -> list[BlockShape]:
    """``num_layers`` dense blocks, each on the sample's sequence."""
    return [BlockShape(cfg.data.seq_length)] * cfg.model.num_layers


@dataclass(frozen=True)
class FamilySpec:
    """What the rest of meshtron needs to know about a family. Hooks take the config (or its
    sections) and return plain values.

    Parameter counts are no hook: they are read off ``build`` run on the meta device
    (``models.sizes``, and per rank ``parallel.sizes`` through the family's plan), so a family
    states no count beside its model. ``pipeline_costs`` has no default: a family states either
    its cost model or ``None``, the even split, so no family is split evenly by accident.
    """

    name: str  # the --model-type that selects it
    build: Callable[[ModelConfig, int, int, int], ModelFamily]  # (cfg, vocab_size, max_seq_length, padded_vocab_size)
    layout_errors: Callable[[ModelConfig, int], list[str]]  # why the shapes do not split over tp ranks
    # (P, L) of one token for ``flops_per_token``'s ``6 P + 6 L S h``: the parameters that multiply
    # its activations and the layers it attends through; None when one shape cannot say it
    # (``flops_per_token`` then does).
    flops_shape: Callable[[ModelConfig, int, int], tuple[int, int]] | None
    causal: bool  # a token attends only to earlier ones (halves attention FLOPs)
    pipeline_costs: Callable[[ModelConfig, int, int], PipelineCosts] | None  # (cfg, vocab, seq); None: the even split
    datasets: Callable[..., tuple]  # (cfg, tokenizer, num_samples, seed, data_prefixes, vocab_size) -> (train, valid, test)
    config_errors: Callable[[Config], list[str]] = no_errors  # what the family does not take, each naming the flag
    flops_per_token: Callable[[ModelConfig, int, int, int], float] | None = None  # (cfg, vocab, seq, decoder seq): overrides flops_shape
    num_blocks: Callable[[ModelConfig], int] = num_layers  # the blocks the pipeline splits
    sample_tokens: Callable[[DataConfig], int] = sequence_tokens  # tokens of one training sample (throughput)
    output_tokens: Callable[[DataConfig], int] = sequence_tokens  # tokens of a sample the vocabulary output sees (0: none)
    block_shapes: Callable[[Config], list[BlockShape]] = dense_blocks  # every block in model order (activation memory)
    sentence_data: bool = False  # trains on sentence-split data (the embedded corpus's WordPiece sentences)
    # (model, tokenizer, prompt, max_new_tokens, sampling kwargs) -> text; None: the family does not generate
    generate: Callable[[Any, Any, str, int, dict], str] | None = None
    # (weights, cfg, meta, load_dir, dtype, max_positions) -> (config.json dict, (name, tensor) iterator); None: no exporter
    hf_export: Callable[..., tuple[dict, Any]] | None = None
    sft: bool = False  # fine-tunes on conversations (--sft)
    mtp: bool = False  # trains multi-token prediction depths (--mtp-num-layers)
    bert_load: bool = False  # --bert-load starts its pretrained_encoders() from a BERT checkpoint


_FAMILIES: dict[str, FamilySpec] = {}


def register(spec: FamilySpec) -> FamilySpec:
    """Make ``spec`` the family ``--model-type spec.name`` selects; returns it."""
    if not spec.name or ":" in spec.name:
        raise ValueError(f"a family's name is a plain --model-type value, got '{spec.name}'")
    if spec.flops_shape is None and spec.flops_per_token is None:
        raise ValueError(f"family '{spec.name}' gives neither flops_shape nor flops_per_token")
    known = _FAMILIES.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"family '{spec.name}' is registered already (by {known.build.__module__})")
    _FAMILIES[spec.name] = spec
    return spec


def family_names() -> list[str]:
    return sorted(_FAMILIES)


def _resolve(name: str) -> tuple[FamilySpec | None, str]:
    """The spec ``name`` selects, or None and why none does."""
    if name in _FAMILIES:
        return _FAMILIES[name], ""
    hint = "a family outside meshtron: --model-type package.module:name"
    module, sep, short = name.rpartition(":")
    if not sep:
        return None, f"--model-type must be one of {family_names()}, got '{name}' ({hint})"
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return None, f"--model-type {name}: cannot import {module} ({exc})"
    if short not in _FAMILIES:
        return None, f"--model-type {name}: importing {module} registered no family '{short}' (known: {family_names()})"
    return _FAMILIES[short], ""


def family_error(name: str) -> str | None:
    """Why ``--model-type name`` selects no family (None when it selects one)."""
    spec, why = _resolve(name)
    return None if spec else why


def family(name: str) -> FamilySpec:
    """The family ``--model-type name`` selects; ValueError naming the registered ones if none."""
    spec, why = _resolve(name)
    if spec is None:
        raise ValueError(why)
    return spec


def spec_for(model_cfg: ModelConfig) -> FamilySpec:
    """The family of ``model_cfg`` (its ``model_type``)."""
    return family(model_cfg.model_type)
