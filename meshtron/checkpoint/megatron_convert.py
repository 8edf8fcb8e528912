"""``meshtron convert megatron-import | megatron-export``: Megatron-LM checkpoints in and out.

Import reads a Megatron-LM ``--save`` directory in either format (``megatron_files.py``) under any
tp/pp/ep it was saved with, builds the model its ``args`` describe (``models/megatron.py``),
fills it tensor by tensor (a torch_dist tensor one layer at a time, a legacy checkpoint one
pipeline stage at a time) and saves a meshtron checkpoint carrying Megatron's iteration and
consumed samples, so ``meshtron train --load OUT --no-load-rng`` goes on where Megatron stopped.
Adam's state comes along where Megatron keeps it in model space, or position-keyed in legacy files
whose param-group order is Megatron's standard one (``megatron_optim.py``); otherwise the reason
is printed and the weights are written alone (resume with ``--no-load-optim``). BERT and T5 are
told from GPT by their layer stacks (``megatron_family``) and mapped by their ``Naming``.
The model-defining ``args`` are kept in the meta (``megatron_args``) so an export writes them back.

Export (``megatron_export.py``) writes a meshtron checkpoint as Megatron-LM's ``torch_dist`` or
legacy ``torch`` checkpoint, which Megatron-LM's own ``load_checkpoint`` takes (strict).
The import holds the model's weights in memory once (and Adam's two moments, when it brings them).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from meshtron.checkpoint.checkpoint import save_checkpoint
from meshtron.checkpoint.megatron_export import FORMATS, IMPLS, export_megatron
from meshtron.checkpoint.megatron_files import DistCheckpoint, LegacyCheckpoint, open_megatron
from meshtron.checkpoint.megatron_optim import (MASTERS, MOMENTS, PREFIX, fill_optimizer, legacy_adam, megatron_step, model_space_kinds,
                                               train_fields)
from meshtron.checkpoint.megatron_pickle import Namespace
from meshtron.config import Config, ModelConfig
from meshtron.errors import CheckpointError
from meshtron.models import build_model, num_blocks
from meshtron.models.init import norm_parameters
from meshtron.models.megatron import (Naming, dist_candidates, layer_count, legacy_pieces, megatron_family, merge_tp, model_config_from_args,
                                      naming, zero_centred_gains)
from meshtron.optim.build import build_optimizer

_PLAIN = (int, float, str, bool, type(None))


def _plain_args(fields: dict[str, Any]) -> dict[str, Any]:
    """The JSON-representable ``args`` fields (enums, dtypes and objects are dropped)."""
    keep = {}
    for key, value in fields.items():
        if isinstance(value, _PLAIN) or (isinstance(value, list) and all(isinstance(v, _PLAIN) for v in value)):
            keep[key] = value
    return keep


def _dist_tensors(ckpt: DistCheckpoint, expected: dict[str, torch.Size], names: Naming, prefix: str = "",
                  ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """Each weight of the model (or, with ``prefix``, the optimizer tensor Megatron keeps under
    ``prefix`` + the weight's key), one layer read at a time."""
    used = set(names.aliases)
    for name in expected:
        keys, layer = dist_candidates(name, names)
        keys = [prefix + k for k in keys]
        key = next((k for k in keys if k in ckpt.shapes), keys[0])
        used.add(key)
        yield name, ckpt.read(key, layer)
    left = [k for k in ckpt.shapes if k not in used and not k.startswith("optimizer.") and k != "output_layer.weight"]
    if left and not prefix:
        raise CheckpointError(f"{ckpt.directory} holds {len(left)} tensors the model its args describe has no place for, e.g. {left[:3]}")


def _legacy_tensors(ckpt: LegacyCheckpoint, m: ModelConfig, expert_tp: int, impl: str, kind: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Each weight of the model (or, with ``kind``, its optimizer tensor of that kind: ``exp_avg``,
    ...), one pipeline stage read at a time."""
    names, offset = naming(m), 0
    if len(names.stacks) > 1 and ckpt.pp > 1:
        raise CheckpointError(f"{ckpt.directory}: a legacy {m.model_type.upper()} checkpoint saved with pipeline parallelism is not "
                              "read (its stages split the encoder and decoder stacks); save it with --ckpt-format torch_dist")  # fmt: skip
    local_experts = m.num_experts // ckpt.ep if m.num_experts else 0
    select = (lambda loaded, chunk, path: legacy_adam(loaded, ckpt.chunks, path)[kind][chunk]) if kind else None
    for stage, files in ckpt.stages(select):
        dense: dict[str, dict[int, torch.Tensor]] = {}
        experts: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
        for (t, e), state in files.items():
            for key, tensor in state.items():
                for name, expert, piece in legacy_pieces(key, tensor, offset, m, local_experts, names):
                    if expert is None and e == 0:
                        dense.setdefault(name, {})[t] = piece
                    elif expert is not None:
                        experts.setdefault(name, {}).setdefault(e * local_experts + expert, {})[t] = piece
        for name, by_tp in dense.items():
            yield name, merge_tp(name, [by_tp[t] for t in sorted(by_tp)], m, impl)
        for name, by_expert in experts.items():
            if sorted(by_expert) != list(range(m.num_experts)):
                raise CheckpointError(f"{ckpt.directory}: stage {stage} holds experts {sorted(by_expert)} of {name}, not 0..{m.num_experts - 1}")
            yield name, torch.stack([merge_tp(name, [by_expert[k][t] for t in range(expert_tp)], m, impl) for k in range(m.num_experts)])
        offset += layer_count(list(files[(0, 0)]))
    if offset != num_blocks(m):
        raise CheckpointError(f"{ckpt.directory}: the pipeline stages hold {offset} layers, its args imply {num_blocks(m)}")


def import_megatron(load_dir: str | Path, save_dir: str | Path, iteration: int | None = None, log: Callable[[str], None] = print) -> Path:
    """Write the Megatron-LM checkpoint of ``load_dir`` as a meshtron checkpoint in ``save_dir``."""
    ckpt = open_megatron(load_dir, iteration)
    args = ckpt.common.get("args")
    if not isinstance(args, Namespace):
        raise CheckpointError(f"{ckpt.directory}: the common state has no args Namespace (found {type(args).__name__})")
    fields = args.fields()
    m = model_config_from_args(fields, f"{ckpt.directory} (args)", megatron_family(ckpt.names))
    names = naming(m)
    cfg = Config(model=m)
    cfg.data.seq_length = int(fields.get("seq_length") or m.max_position_embeddings)
    model = build_model(m, m.vocab_size, cfg.data.seq_length)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    kinds, reason = model_space_kinds(ckpt)
    master = next((kind for kind in MASTERS if kind in kinds), None)
    adam_step = megatron_step(ckpt) if kinds else 0
    expert_tp = int(fields.get("expert_tensor_parallel_size") or getattr(ckpt, "tp", 1)) if m.num_experts else getattr(ckpt, "tp", 1)
    impl = str(fields.get("transformer_impl") or "transformer_engine")

    def tensors(kind: str = "") -> Iterator[tuple[str, torch.Tensor]]:
        """The weights (or the optimizer's tensors of ``kind``) by meshtron's names."""
        if isinstance(ckpt, DistCheckpoint):
            return _dist_tensors(ckpt, expected, names, f"{PREFIX}{kind}." if kind else "")
        return _legacy_tensors(ckpt, m, expert_tp, impl, kind)

    state = {}
    for name, tensor in tensors():
        if name not in expected:
            if name == "output.weight" and m.tie_embeddings:
                continue  # the last stage's copy of the shared embedding
            raise CheckpointError(f"{ckpt.directory}: tensor {name} (Megatron's) has no place in the model its args describe")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointError(f"{ckpt.directory}: {name} has shape {list(tensor.shape)}, its args imply {list(expected[name])}")
        state[name] = tensor.float()
    missing = sorted(expected.keys() - state.keys())
    if missing:
        raise CheckpointError(f"{ckpt.directory} lacks {len(missing)} tensors its args imply, e.g. {missing[:3]}")
    if master is not None:  # the main params: the weights' precise values
        state.update((name, t.float()) for name, t in tensors(master) if name in expected)
    if zero_centred_gains(fields):  # --apply-layernorm-1p: stored as gain - 1; meshtron stores the gain
        norms = norm_parameters(model)
        gains = [name for name, p in model.named_parameters() if id(p) in norms and name.endswith("weight")]
        state.update((name, state[name] + 1) for name in gains)
        log(f"megatron-import: its {len(gains)} norm gains were stored centred on 0 (--apply-layernorm-1p); written as they apply (+1)")
    model.load_state_dict(state, strict=True)
    step = int(ckpt.common.get("iteration", 0) or 0)
    consumed = int(fields.get("consumed_train_samples") or 0)
    optimizer = None
    if kinds:
        cfg.train = replace(cfg.train, **train_fields(fields), optimizer="adam")  # the imported state is Adam's
        optimizer = build_optimizer(model, cfg.train, torch.float32)
        fill_optimizer(optimizer, {kind: dict(tensors(kind)) for kind in MOMENTS}, adam_step)
        log(f"megatron-import: Adam's state imported (step {adam_step}{', main params as the weights' if master else ''}); "
            f"resume with: meshtron train --load {save_dir} --no-load-rng (the model flags as in meta.json) ...")  # fmt: skip
    else:
        if reason:
            log(f"megatron-import: {ckpt.directory}'s optimizer state is not imported: {reason}; the weights are written alone")
        log(f"megatron-import: resume with a fresh optimizer: meshtron train --load {save_dir} --no-load-optim --no-load-rng "
            "(the model flags as in meta.json) ...")  # fmt: skip
    meta = {"iteration": step, "consumed_samples": consumed, "config": cfg.to_dict(), "vocab_size": m.vocab_size,
            "tokenizer": {"tokenizer_type": ""}, "megatron_source": str(ckpt.directory.resolve()), "megatron_format": ckpt.format,
            "megatron_args": _plain_args(fields)}  # fmt: skip
    return save_checkpoint(save_dir, step, model, optimizer, meta, save_optim=optimizer is not None, save_rng=False)


def main(argv: list[str]) -> int:
    """``meshtron convert megatron-import|megatron-export``."""
    parser = argparse.ArgumentParser(prog="meshtron convert", description="exchange checkpoints with Megatron-LM")
    sub = parser.add_subparsers(dest="direction", required=True)
    imp = sub.add_parser("megatron-import", help="Megatron-LM checkpoint (torch_dist or legacy torch, any tp/pp/ep) -> meshtron")
    imp.add_argument("--load", required=True, help="Megatron-LM's --save directory (holds latest_checkpointed_iteration.txt)")
    imp.add_argument("--save", required=True, help="meshtron checkpoint directory to write")
    imp.add_argument("--ckpt-step", type=int, default=None, help="iteration to import (default: the tracker's)")
    exp = sub.add_parser("megatron-export", help="meshtron checkpoint -> Megatron-LM torch_dist (or legacy torch)")
    exp.add_argument("--load", required=True, help="checkpoint directory written by meshtron's --save")
    exp.add_argument("--save", required=True, help="directory to write the Megatron checkpoint into")
    exp.add_argument("--ckpt-step", type=int, default=None, help="iteration to export (default: the newest)")
    exp.add_argument("--ckpt-format", choices=FORMATS, default="torch_dist", help="torch_dist (loads under any layout) or legacy torch")
    exp.add_argument("--transformer-impl", choices=IMPLS, default=None,
                     help="the Megatron spec that loads it (default: the imported run's, else transformer_engine)")
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size"):
        exp.add_argument(flag, type=int, default=1, help="the legacy torch format's layout (Megatron loads it under this one only)")
    args = parser.parse_args(argv)
    if args.direction == "megatron-import":
        print(f"wrote {import_megatron(args.load, args.save, args.ckpt_step)}")
    else:
        layout = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size)
        if args.ckpt_format == "torch_dist" and layout != (1, 1, 1):
            parser.error("--tensor/pipeline/expert-model-parallel-size are for --ckpt-format torch; torch_dist loads under any layout")
        final = export_megatron(args.load, args.save, args.ckpt_step, args.ckpt_format, layout, args.transformer_impl)
        print(f"wrote {final} (Megatron-LM {args.ckpt_format}, weights only); load it in Megatron-LM with --load {args.save} "
              "--no-load-optim --no-load-rng")  # fmt: skip
    return 0
