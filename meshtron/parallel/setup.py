"""Build the model of one rank and its optimizer for a layout: the one place the training loop
asks for parallelism, so a reader can see every transformation in order."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from meshtron.config import Config, pipeline_virtual_size
from meshtron.kernels.fp8 import apply_fp8, check_fp8_device
from meshtron.kernels.grad_accum_fusion import apply_gradient_accumulation_fusion
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
    sequence) parallelism, FP8 linears (on the sharded layers), gradient-accumulation fusion (the
    linears FP8 left), context parallelism, the pipeline split (this rank's stages; the model
    keeps only their parameters), torch.compile of each block (last, so it traces the final
    modules; compilation itself waits for the first call), and
    either FSDP2 or the (distributed) optimizer with data-parallel gradient buckets. Returns
    (model, optimizer, stages or None without pp)."""
    p = cfg.parallel
    if cfg.model.fp8_format:
        check_fp8_device(device)  # before anything is allocated
    if cfg.train.gemm_tuning:
        enable_gemm_tuning(cfg, device)
    sequence_parallel = p.sequence_parallel and mesh.tp > 1
    check_model_fits(cfg.model, mesh, seq_length=cfg.data.seq_length, sequence_parallel=sequence_parallel, vocab_size=vocab_size)
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):  # initialize where it will train: fast on a GPU
        model = build_model(cfg.model, vocab_size, cfg.data.seq_length)
    if mesh.tp > 1:
        model = apply_tensor_parallel(model, mesh, sequence_parallel)
    if cfg.model.fp8_format:
        apply_fp8(model.layers, cfg.model.fp8_format, cfg.model.fp8_backend)
    if cfg.train.gradient_accumulation_fusion:
        apply_gradient_accumulation_fusion(model.layers)
    if mesh.cp > 1:
        # The ring's per-block kernel follows --attention-backend where it names one of its kernels.
        block_kernel = cfg.model.attention_backend if cfg.model.attention_backend in ("math", "flash", "cudnn") else "auto"
        apply_context_parallel(model, mesh, p.cp_comm_type, block_kernel)
    stages = None
    if mesh.pp > 1:
        stages = build_stage_modules(
            model, mesh, pipeline_virtual_size(cfg), p.first_pipeline_stage_layers or None, p.last_pipeline_stage_layers or None,
            p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split,
        )
    if cfg.train.compile:
        compile_blocks(model)
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


def compile_blocks(model: nn.Module, backend: str = "inductor") -> None:
    """``torch.compile`` each transformer block in place (``nn.Module.compile``: names, state dict
    and checkpoints unchanged). Per block rather than whole model: the blocks are identical, so one
    compiled graph serves all of them, compile time does not grow with depth, and activation
    recompute and the pipeline schedules keep calling blocks one by one."""
    for block in model.layers.children():  # a ModuleList, or a ModuleDict after the pipeline split
        block.compile(backend=backend)


def enable_gemm_tuning(cfg: Config, device: torch.device) -> Path:
    """PyTorch TunableOp (the ROCm scripts' ``GEMM_TUNING=1``): each new GEMM shape is timed over
    the BLAS library's candidate algorithms once and the fastest kept. Results go to a file under
    ``--save`` (else ``--data-cache-path``, else ~/.cache/meshtron), one per rank, and are read
    back by later runs (TunableOp reads the file at its first GEMM and writes it at exit), so only
    the first run pays for tuning. Returns the file's path."""
    if device.type != "cuda":
        raise ValueError("--gemm-tuning needs a GPU (TunableOp tunes cuBLAS/hipBLASLt GEMMs); drop it on the CPU")
    root = Path(cfg.checkpoint.save or cfg.data.data_cache_path or Path.home() / ".cache" / "meshtron")
    root.mkdir(parents=True, exist_ok=True)
    torch.cuda.tunable.enable(True)
    torch.cuda.tunable.tuning_enable(True)
    torch.cuda.tunable.set_filename(str(root / "tunableop_results.csv"), insert_device_ordinal=True)
    return Path(torch.cuda.tunable.get_filename())  # read at the first GEMM, written at exit
