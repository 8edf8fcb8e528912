"""Build the model of one rank and its optimizer for a layout: the one place the training loop
asks for parallelism, so a reader can see every transformation in order."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from meshtron.config import Config, ParallelConfig, TrainConfig, virtual_stages
from meshtron.kernels import triton_runs_on
from meshtron.kernels.fp8 import apply_fp8, check_fp8_device
from meshtron.kernels.fp8_scaling import Fp8Recipe, Fp8Scaling
from meshtron.kernels.grad_accum_fusion import apply_gradient_accumulation_fusion
from meshtron.layers.mlp import enable_bias_gelu_fusion
from meshtron.layers.output import OutputLayer
from meshtron.models import build_model, padded_vocab_size, pipeline_costs
from meshtron.models.contract import ModelFamily
from meshtron.models.init import materialize, materialize_fully_sharded
from meshtron.optim.build import build_optimizer
from meshtron.parallel.fsdp import apply_fsdp, build_fsdp_optimizer
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.pipeline import build_stages
from meshtron.parallel.pipeline_balance import PipelineCosts, pipeline_split
from meshtron.parallel.pipeline_schedules import SPLIT_BACKWARD
from meshtron.parallel.plan import parallelize
from meshtron.parallel.runner import Runner
from meshtron.parallel.tensor_parallel import VocabParallelOutputLayer


def build_runner(cfg: Config, mesh: Mesh, vocab_size: int, device: torch.device, dtype: torch.dtype) -> Runner:
    """The model of ``cfg`` over ``vocab_size`` tokens (padded here for the layout's tp), built on
    the meta device (shapes only), made ready to train on ``mesh`` by ``runner_for``, which gives this rank's shards storage and their values from the
    seed (layout-invariant init: every layout starts from the one-process weights), with the
    kernel options of the config (FP8 linears, gradient-accumulation fusion, torch.compile per
    block) applied to this rank's blocks. No rank ever holds the whole model, unless it runs alone.
    Shapes were checked against the layout by ``meshtron.validation`` before any process group existed."""
    m = cfg.model
    if m.fp8_format:
        check_fp8_device(device)  # before anything is allocated
    if cfg.train.gemm_tuning:
        enable_gemm_tuning(cfg, device)
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta"):
        rows = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, cfg.parallel.tensor_parallel)
        model = build_model(m, vocab_size, cfg.data.seq_length, rows)

    def prepare_blocks(blocks: nn.Module) -> None:
        # FP8 first (on the sharded layers), fusion on the linears FP8 left, compile last so it
        # traces the final modules (compilation itself waits for the first call).
        if m.fp8_format:
            recipe = Fp8Recipe(m.fp8_format, m.fp8_recipe, m.fp8_amax_history_len, m.fp8_amax_compute_algo, m.fp8_margin,
                               m.fused_kernels)  # fmt: skip
            apply_fp8(blocks, recipe, m.fp8_backend)
            if m.fp8_output_layer:
                apply_fp8_output_layer(model, recipe, device)
        # Not under compile: it would trace the fused backward, which reports to the gradient buffer from Python.
        if cfg.train.gradient_accumulation_fusion and not cfg.train.compile:
            heads = [m for m in model.modules() if isinstance(m, (OutputLayer, VocabParallelOutputLayer))]
            apply_gradient_accumulation_fusion(blocks, heads)
        # Eager only (inductor fuses the bias and GELU itself), and where the kernel runs.
        if m.bias_gelu_fusion and not cfg.train.compile and triton_runs_on(m.fused_kernels, device):
            enable_bias_gelu_fusion(blocks)
        if cfg.train.compile:
            compile_blocks(blocks)

    # The ring's per-block kernel follows --attention-backend where it names one of its kernels.
    block_kernel = m.attention_backend if m.attention_backend in ("math", "flash", "cudnn") else "auto"
    costs = pipeline_costs(m, vocab_size, cfg.data.seq_length)
    return runner_for(model, mesh, cfg.parallel, cfg.train, dtype, block_kernel, prepare_blocks, costs, device, cfg.train.seed)


def runner_for(model: ModelFamily, mesh: Mesh, parallel: ParallelConfig, train: TrainConfig, dtype: torch.dtype,
               cp_block_kernel: str = "auto", prepare_blocks: Callable[[nn.Module], None] | None = None,
               costs: PipelineCosts | None = None, device: torch.device | None = None, seed: int = 0) -> Runner:  # fmt: skip
    """Make ``model`` (any model family, the same full model on every rank: built whole, or on
    the meta device) train on ``mesh``, in order: its parallel plan over tp (and sp) and cp, the
    pipeline split (this rank's stages; the model keeps only their parameters), storage on
    ``device`` for what is still on the meta device (drawn from ``seed``: ``models.init``),
    ``prepare_blocks`` on the blocks this rank kept, and either FSDP2 or the (distributed)
    optimizer with data-parallel gradient buckets. ``costs``: the pieces' modeled costs the split
    balances (``pipeline_balance``); None splits evenly unless ``parallel`` gives counts."""
    sequence_parallel = parallel.sequence_parallel and mesh.tp > 1
    overlap = parallel.tp_comm_overlap_backend if parallel.tp_comm_overlap else ""
    metas = parallelize(model, mesh, sequence_parallel, parallel.cp_comm_type, cp_block_kernel, overlap)
    virtual = virtual_stages(parallel, len(model.blocks()))
    kind, micro_batches = schedule_kind(parallel, virtual), train.global_batch_size // max(1, train.micro_batch_size * mesh.dp)
    split = pipeline_split(parallel, len(model.blocks()), virtual, costs, kind, micro_batches if mesh.pp > 1 else 0)
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and device is None:
        raise ValueError("runner_for: a model on the meta device needs the device its shards go to")
    stages = build_stages(model, metas, mesh, split, device, kind)
    fsdp = parallel.fsdp and mesh.dp_cp > 1
    if on_meta and not fsdp:
        materialize(model, metas, model.weight_init, device, seed)
    if prepare_blocks is not None:
        prepare_blocks(model.blocks())
    if kind in SPLIT_BACKWARD and mesh.pp > 1:
        # The zero-bubble schedules defer the weight-gradient GEMMs of the linears that write
        # into main_grad (kernels.deferred_wgrad): as --gradient-accumulation-fusion does (idempotent).
        apply_gradient_accumulation_fusion(model.blocks())
    reduce_dtype = torch.bfloat16 if parallel.grad_reduce_in_bf16 else torch.float32  # --grad-reduce-in-bf16
    if fsdp:
        # FSDP2 keeps fp32 sharded parameters as the master weights and casts to ``dtype`` to compute.
        # A meta model is sharded first; each rank then draws only its FSDP shards.
        model = apply_fsdp(model, mesh, param_dtype=dtype, reduce_dtype=reduce_dtype, metas=metas,
                           device_type=device.type if device is not None else "")  # fmt: skip
        if on_meta:
            materialize_fully_sharded(model, metas, model.weight_init, device, seed)
        optimizer = build_fsdp_optimizer(model, train, dtype, metas, expert_group=mesh.etp_ep_group if mesh.size("etp_ep") > 1 else None)
    else:
        model.to(dtype=dtype)
        groups = {dim: mesh.group(dim) if mesh.size(dim) > 1 else None for dim in ("dp_cp", "tp", "pp", "etp_ep", "edp")}
        optimizer = build_optimizer(model, train, dtype, metas=metas, dp_group=groups["dp_cp"], tp_group=groups["tp"],
                                    pp_group=groups["pp"], expert_group=groups["etp_ep"], edp_group=groups["edp"],
                                    distributed=parallel.use_distributed_optimizer, bucket_size=parallel.ddp_bucket_size, reduce_dtype=reduce_dtype,
                                    overlap_param_gather=parallel.overlap_param_gather)  # fmt: skip
    return Runner(model, metas, stages, optimizer, mesh, dtype, kind, sequence_parallel, split, costs)


def apply_fp8_output_layer(model: nn.Module, recipe: Fp8Recipe, device: torch.device | None) -> list[nn.Module]:
    """``--fp8-output-layer``: give each output layer of ``model`` without a bias an FP8 scaling
    state, so its fused loss runs its three GEMMs in FP8 (``kernels/fp8_output.py``); a head with a
    bias (BERT's LM head) stays bf16. Meshtron's own code whatever ``--fp8-backend`` the blocks use.
    Returns the layers that took it."""
    heads = [m for m in model.modules() if isinstance(m, (OutputLayer, VocabParallelOutputLayer)) and m.bias is None]
    for head in heads:
        head.fp8 = Fp8Scaling(recipe, device)
    return heads


def schedule_kind(parallel: ParallelConfig, virtual: int) -> str:
    """The schedule ``auto`` means: interleaved 1F1B with virtual stages, else 1F1B. Without
    pipeline parallelism every schedule is one forward then one backward per micro batch."""
    kind = parallel.pipeline_schedule
    if kind == "auto" or parallel.pipeline_parallel == 1:
        return "interleaved" if virtual > 1 else "1f1b"
    return kind


def compile_blocks(blocks: nn.Module, backend: str = "inductor") -> None:
    """``torch.compile`` each transformer block in place (``nn.Module.compile``: names, state dict
    and checkpoints unchanged). Per block rather than whole model: the blocks are identical, so one
    compiled graph serves all of them, compile time does not grow with depth, and activation
    recompute and the pipeline schedules keep calling blocks one by one."""
    for block in blocks.children():  # a ModuleList, or a ModuleDict after the pipeline split
        # Static shapes: a new shape (evaluation's batch, another model in the process) compiles
        # again rather than turning sizes symbolic, which the Triton launches inside the blocks
        # (norms, FP8 casts) cannot take ("'SymNodeVariable' object has no attribute 'value'").
        block.compile(backend=backend, dynamic=False)


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
