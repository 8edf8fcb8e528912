"""``meshtron convert megatron-export``: a meshtron checkpoint as one Megatron-LM's ``load_checkpoint`` takes.

Two formats, as Megatron-LM writes them (``--ckpt-format``):

* ``torch_dist`` (reshardable, so Megatron loads it under any tp/pp/ep): the global tensors under
  Core's names, layers stacked along a leading axis and experts along a second, through DCP's own
  writer; beside them the ``_extra_state`` object of every linear layer, one per layer (and
  expert), each ``torch.save([None])`` under ``{key}/shard_{offsets}_{shape}`` as Megatron-Core
  stores a ShardedObject. Megatron's loader wants every object its model declares, and both its
  local linears and Transformer Engine's (no FP8 state) set ``None`` as nothing to restore. Plus
  ``common.pt`` (``args`` as an ``argparse.Namespace``, iteration, checkpoint version 3.0), which
  every Megatron-Core reads, ``metadata.json`` and the tracker;
* ``torch`` (legacy): ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` for the tp x pp x ep layout
  asked for (Megatron loads it only under that layout): each rank's shards, layers numbered per
  stage, experts per expert rank, ``_extra_state`` entries set to ``None``.

The spec decides some names (``models/megatron.py`` ``fused_norms``): ``--transformer-impl``
(default: the run the checkpoint came from, else Megatron's default, Transformer Engine). TE's
spec also gives a legacy state dict each attention's ``core_attention._extra_state``.
Weights only: Megatron loads it with ``--no-load-optim --no-load-rng``. The whole model is held
in memory once (to stack layers and to cut shards).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from meshtron.checkpoint.dcp_io import quiet_single_process
from meshtron.checkpoint.megatron_files import COMMON, LEGACY_FILE, TRACKER, rank_dir
from meshtron.checkpoint.tensor_reader import CheckpointWeights
from meshtron.config import Config, ModelConfig
from meshtron.errors import CheckpointError
from meshtron.models import build_model
from meshtron.models.megatron import args_from_model, check_exportable, dist_state, fused_norms, legacy_state

CHECKPOINT_VERSION = 3.0
FORMATS = ("torch_dist", "torch")
IMPLS = ("local", "transformer_engine")


def meshtron_weights(weights: CheckpointWeights, m: ModelConfig, vocab_size: int, seq_length: int) -> dict[str, torch.Tensor]:
    """Every weight of the checkpoint, checked against the model its config builds."""
    with torch.device("meta"):
        model = build_model(m, vocab_size, seq_length)
    weights.check_shapes({k: tuple(v.shape) for k, v in model.state_dict().items()})
    return {name: weights[name] for name in model.state_dict()}


def _check_layout(m: ModelConfig, vocab_size: int, tp: int, pp: int, ep: int) -> None:
    groups = m.num_query_groups or m.num_attention_heads
    problems = [f"{what} {n} is not divisible by {flag} {size}"
                for what, n, flag, size in (("num_layers", m.num_layers, "--pipeline-model-parallel-size", pp),
                                            ("num_query_groups", groups, "--tensor-model-parallel-size", tp),
                                            ("the vocabulary", vocab_size, "--tensor-model-parallel-size", tp),
                                            ("num_experts", m.num_experts or ep, "--expert-model-parallel-size", ep))
                if n % size]  # fmt: skip
    if ep > 1 and not m.num_experts:
        problems.append("--expert-model-parallel-size > 1 needs an MoE model")
    if problems:
        raise CheckpointError("megatron-export: " + "; ".join(problems))


def export_megatron(load_dir: str | Path, save_dir: str | Path, iteration: int | None = None, ckpt_format: str = "torch_dist",
                    layout: tuple[int, int, int] = (1, 1, 1), transformer_impl: str | None = None) -> Path:  # fmt: skip
    """Write the meshtron checkpoint of ``load_dir`` as a Megatron-LM checkpoint in ``save_dir``;
    ``layout`` (tp, pp, ep) is the legacy format's (torch_dist is written whole)."""
    if ckpt_format not in FORMATS:
        raise CheckpointError(f"megatron-export: --ckpt-format must be one of {', '.join(FORMATS)}, got '{ckpt_format}'")
    weights = CheckpointWeights(load_dir, iteration)
    meta = weights.meta
    cfg = Config.from_dict(meta["config"])
    m = cfg.model
    check_exportable(m)
    source = meta.get("megatron_args", {})
    impl = transformer_impl or source.get("transformer_impl") or "transformer_engine"
    if impl not in IMPLS:
        raise CheckpointError(f"megatron-export: --transformer-impl must be one of {', '.join(IMPLS)}, got '{impl}'")
    tp, pp, ep = layout if ckpt_format == "torch" else (1, 1, 1)
    _check_layout(m, meta["vocab_size"], tp, pp, ep)
    tensors = meshtron_weights(weights, m, meta["vocab_size"], cfg.data.seq_length)
    step = int(meta["iteration"])
    fields = {**source, **args_from_model(m, meta["vocab_size"], cfg.data.seq_length)}
    fields.update(consumed_train_samples=int(meta.get("consumed_samples", 0)), iteration=step, ckpt_format=ckpt_format,
                  use_dist_ckpt=ckpt_format == "torch_dist", transformer_impl=impl, params_dtype=next(iter(tensors.values())).dtype)  # fmt: skip
    if ckpt_format == "torch":
        fields.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                      expert_tensor_parallel_size=tp if m.num_experts else fields.get("expert_tensor_parallel_size"))  # fmt: skip
    common = {"args": argparse.Namespace(**fields), "checkpoint_version": CHECKPOINT_VERSION, "iteration": step,
              "num_floating_point_operations_so_far": 0}  # fmt: skip
    root = Path(save_dir)
    directory = root / f"iter_{step:07d}"
    directory.mkdir(parents=True, exist_ok=True)
    fused = fused_norms(ckpt_format, impl, bool(m.num_experts), m.multi_latent_attention)
    if ckpt_format == "torch_dist":
        with quiet_single_process():
            # Unflattened: DCP's planner then stores each object as torch.save(object), Megatron-Core's bytes.
            planner = DefaultSavePlanner(flatten_state_dict=False)
            dcp.save(dist_state(tensors, m, fused), storage_writer=FileSystemWriter(directory), planner=planner, no_dist=True)
        torch.save(common, directory / COMMON)
        (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    else:
        for t, p, e in itertools.product(range(tp), range(pp), range(ep)):
            path = directory / rank_dir(t, p, e, pp, ep) / LEGACY_FILE
            path.parent.mkdir(exist_ok=True)
            torch.save({**common, "model": legacy_state(tensors, m, (tp, pp, ep), (t, p, e), fused, impl)}, path)
    (root / TRACKER).write_text(str(step))
    return directory
