"""Build the model of one rank and its optimizer for a layout: the one place the training loop
asks for parallelism, so a reader can see every transformation in order."""

from __future__ import annotations

import torch
from torch import nn

from meshtron.config import Config, pipeline_virtual_size
from meshtron.models import build_model
from meshtron.optim.optimizer import build_optimizer
from meshtron.parallel.apply import apply_tensor_parallel, check_model_fits
from meshtron.parallel.context_parallel import apply_context_parallel
from meshtron.parallel.fsdp import apply_fsdp, build_fsdp_optimizer
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.pipeline import PipelineStage, build_stage_modules


def build_parallel_model_and_optimizer(
    cfg: Config, mesh: Mesh, vocab_size: int, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, object, list[PipelineStage] | None]:
    """Full model from the seed on every rank (layout-invariant init), then in order: tensor (and
    sequence) parallelism, context parallelism, the pipeline split (this rank's stages; the model
    keeps only their parameters), and either FSDP2 or the (distributed) optimizer with
    data-parallel gradient buckets. Returns (model, optimizer, stages or None without pp)."""
    p = cfg.parallel
    sequence_parallel = p.sequence_parallel and mesh.tp > 1
    check_model_fits(cfg.model, mesh, seq_length=cfg.data.seq_length, sequence_parallel=sequence_parallel, vocab_size=vocab_size)
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):  # initialize where it will train: fast on a GPU
        model = build_model(cfg.model, vocab_size, cfg.data.seq_length)
    if mesh.tp > 1:
        model = apply_tensor_parallel(model, mesh, sequence_parallel)
    if mesh.cp > 1:
        apply_context_parallel(model, mesh)
    stages = None
    if mesh.pp > 1:
        stages = build_stage_modules(
            model, mesh, pipeline_virtual_size(cfg), p.first_pipeline_stage_layers or None, p.last_pipeline_stage_layers or None
        )
    if p.fsdp and mesh.dp_cp_size > 1:
        # FSDP2 keeps fp32 sharded parameters as the master weights and casts to ``dtype`` to compute.
        model = apply_fsdp(model, mesh, param_dtype=dtype)
        return model, build_fsdp_optimizer(model, cfg.train, dtype), stages
    model.to(dtype=dtype)
    optimizer = build_optimizer(model, cfg.train, dtype, mesh=mesh, distributed=p.use_distributed_optimizer, bucket_size=p.ddp_bucket_size)
    return model, optimizer, stages


def pipeline_schedule_kind(cfg: Config) -> str:
    """The schedule ``auto`` means: interleaved 1F1B with virtual stages, else 1F1B."""
    kind = cfg.parallel.pipeline_schedule
    if kind == "auto":
        return "interleaved" if pipeline_virtual_size(cfg) > 1 else "1f1b"
    return kind
