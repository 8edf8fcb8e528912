"""Every check of a config that needs no tensor, in one place: values, and the model against the
parallel layout. Run before any process group exists or a GPU is touched; each message names the
flag to change."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from meshtron.checkpoint.checkpoint import checkpoint_config_errors
from meshtron.config import KEPT_MODULES, RECOMPUTED_MODULES, Config, ModelConfig, TrainConfig, virtual_stages, world_size_from_env
from meshtron.data.chat_template import TEMPLATE_CHOICES, conversation_template
from meshtron.data.data_sources import SPLIT_FLAGS, names_data, split_blends
from meshtron.data.masked_lm import masked_data_config_errors
from meshtron.errors import ConfigError
from meshtron.flags import noted_flag_errors
from meshtron.kernels.fp8_scaling import AMAX_COMPUTE_ALGOS, FP8_RECIPES, PER_TENSOR_RECIPES, recipe_formats
from meshtron.layers.attention import attention_config_errors
from meshtron.layers.mla import mla_config_errors
from meshtron.layers.moe import moe_config_errors
from meshtron.layers.moe.experts import expert_ffn_hidden_size
from meshtron.models import family_error, model_config_errors, model_layout_errors, num_blocks, pipeline_costs, spec_for
from meshtron.kernels import triton_available
from meshtron.optim.muon import muon_settings_errors
from meshtron.optim.optimizer import MOMENT_DTYPES, OPTIMIZER_IMPLS, muon_settings
from meshtron.optim.update_rules import OPTIMIZERS
from meshtron.parallel.pipeline_balance import pipeline_split
from meshtron.parallel.pipeline_schedules import KINDS, SPLIT_BACKWARD
from meshtron.training.batch_schedule import batch_schedule_errors
from meshtron.training.garbage import release_errors
from meshtron.training.stop import stop_config_errors


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Every check that needs no tensor. Raises ConfigError naming the fix."""
    world_size = world_size_from_env() if world_size is None else world_size
    m, d, t, p, c = cfg.model, cfg.data, cfg.train, cfg.parallel, cfg.checkpoint
    unknown = family_error(m.model_type)
    if unknown:  # every later check asks the family
        raise ConfigError(f"invalid config:\n  - {unknown}")
    errors: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errors.append(msg)

    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        need(getattr(m, name) > 0, f"model.{name} must be positive, got {getattr(m, name)}")
    if m.hidden_size > 0 and m.num_attention_heads > 0 and not m.kv_channels:
        need(
            m.hidden_size % m.num_attention_heads == 0,
            f"--num-attention-heads {m.num_attention_heads} does not divide --hidden-size {m.hidden_size}; "
            f"pick heads that divide it (e.g. {_divisor_near(m.hidden_size, m.num_attention_heads)}) or set --kv-channels",
        )
    groups = m.num_query_groups or m.num_attention_heads
    need(
        m.num_attention_heads % groups == 0 if groups > 0 else False,
        f"--num-query-groups {groups} must divide --num-attention-heads {m.num_attention_heads}",
    )
    need(m.normalization in ("LayerNorm", "RMSNorm"), f"--normalization must be LayerNorm or RMSNorm, got '{m.normalization}'")
    need(m.activation in ("gelu", "gelu_tanh", "swiglu"), f"model.activation must be gelu, gelu_tanh or swiglu, got '{m.activation}'")
    need(
        m.position_embedding_type in ("learned_absolute", "rope", "relative"),
        f"--position-embedding-type must be learned_absolute, rope or relative (T5), got '{m.position_embedding_type}'",
    )
    need(m.rotary_percent == 1.0, f"--rotary-percent {m.rotary_percent}: partial rotary embeddings are not implemented; "
         "meshtron rotates whole heads (--rotary-percent 1.0)")  # fmt: skip
    need(not (m.add_qkv_bias and m.multi_latent_attention),
         "--add-qkv-bias applies to the fused query/key/value projection; multi-head latent attention has none, drop it")  # fmt: skip
    need(m.rope_scaling in ("", "llama3", "yarn"), f"model.rope_scaling must be '', 'llama3' or 'yarn', got '{m.rope_scaling}'")
    errors.extend(moe_config_errors(m) + attention_config_errors(m) + mla_config_errors(m))
    errors.extend(masked_data_config_errors(d) + checkpoint_config_errors(cfg))
    errors.extend(model_config_errors(cfg))  # the family's own rules (its spec in models/)
    need(m.mtp_num_layers == 0 or spec_for(m).mtp, f"--mtp-num-layers: --model-type {m.model_type} has no multi-token prediction; drop it")
    need(m.attention_backend in ("auto", "sdpa", "cudnn", "flash", "efficient", "math"),
         f"--attention-backend must be auto, sdpa, cudnn, flash, efficient or math, got '{m.attention_backend}'")  # fmt: skip
    need(m.fused_kernels in ("auto", "on", "off"), f"model.fused_kernels must be auto, on or off, got '{m.fused_kernels}'")
    need(m.recompute_granularity in ("", "selective", "full"),
         f"--recompute-granularity must be selective or full (or empty for none), got '{m.recompute_granularity}'")  # fmt: skip
    need(m.recompute_method in ("uniform", "block"), f"--recompute-method must be uniform or block, got '{m.recompute_method}'")
    unknown = [name for name in m.recompute_modules if name not in RECOMPUTED_MODULES + KEPT_MODULES]
    need(not unknown, f"--recompute-modules: unknown {', '.join(unknown)}; Megatron-Core's are {', '.join(RECOMPUTED_MODULES + KEPT_MODULES)}")
    need(m.recompute_modules == ["core_attn"] or m.recompute_granularity == "selective",
         "--recompute-modules needs --recompute-granularity selective")  # fmt: skip
    need(m.fp8_format in ("", "hybrid", "e4m3"), f"--fp8-format must be hybrid or e4m3 (or empty for off), got '{m.fp8_format}'")
    need(m.fp8_backend in ("auto", "torchao", "meshtron"), f"--fp8-backend must be auto, torchao or meshtron, got '{m.fp8_backend}'")
    unbuilt = {"mxfp8": "MXFP8 (1 x 32 scales, Blackwell's) is not implemented"}
    need(m.fp8_recipe in FP8_RECIPES,
         f"--fp8-recipe {m.fp8_recipe}: {unbuilt.get(m.fp8_recipe, 'unknown recipe')}; use delayed, tensorwise, rowwise or blockwise")  # fmt: skip
    need(not m.fp8_format or m.fp8_format in recipe_formats(m.fp8_recipe),
         f"--fp8-recipe {m.fp8_recipe} runs every operand in e4m3 (DeepSeek-V3's recipe; e5m2 gradients with 1 x 128 "
         f"scales are not built): use --fp8-format e4m3, not {m.fp8_format}")  # fmt: skip
    need(m.fp8_amax_history_len >= 1, f"--fp8-amax-history-len must be at least 1, got {m.fp8_amax_history_len}")
    need(m.fp8_amax_compute_algo in AMAX_COMPUTE_ALGOS,
         f"--fp8-amax-compute-algo must be most_recent or max, got '{m.fp8_amax_compute_algo}'")  # fmt: skip
    need(m.fp8_margin >= 0, f"--fp8-margin must be 0 or more, got {m.fp8_margin}")
    need(not (m.fp8_format and m.fp8_backend == "torchao" and (m.fp8_recipe != "tensorwise" or m.fp8_format != "hybrid")),
         "--fp8-backend torchao runs only --fp8-format hybrid --fp8-recipe tensorwise; use --fp8-backend meshtron")  # fmt: skip
    need(not m.fp8_output_layer or m.fp8_format, "--fp8-output-layer needs --fp8-format (hybrid or e4m3): the blocks' FP8 settings are its own")
    need(not (m.fp8_output_layer and m.fp8_recipe not in PER_TENSOR_RECIPES),
         f"--fp8-output-layer takes one scale per tensor: use --fp8-recipe delayed or tensorwise (not {m.fp8_recipe}), or drop it")  # fmt: skip
    need(not (m.fp8_output_layer and (m.fused_kernels == "off" or not m.cross_entropy_loss_fusion)),
         "--fp8-output-layer runs inside the fused masked-sum loss: it needs --cross-entropy-loss-fusion and fused kernels "
         "(drop --no-fused-kernels / model.cross_entropy_loss_fusion false, or the flag)")  # fmt: skip
    need(not (t.device == "cpu" and (m.fp8_format or t.gemm_tuning)), "--fp8-format and --gemm-tuning need a GPU; drop them for --device cpu")
    need(not (m.fp8_format and m.num_experts and m.moe_fp8 == "rowwise" and t.precision in ("fp32", "fp16")),
         f"FP8 experts (--fp8-format with --num-experts) write bf16 outputs (torch._scaled_grouped_mm): train in bf16 "
         f"(not {t.precision}), or set model.moe_fp8 off to keep the experts in {t.precision}")  # fmt: skip
    need(t.optimizer_impl in OPTIMIZER_IMPLS, f"--optimizer-impl must be one of {', '.join(OPTIMIZER_IMPLS)}, got '{t.optimizer_impl}'")
    need(not (t.optimizer_impl == "fused" and t.device == "cpu"), "--optimizer-impl fused needs a GPU (a Triton kernel); use auto or reference")
    for flag, dtype in (("--exp-avg-dtype", t.exp_avg_dtype), ("--exp-avg-sq-dtype", t.exp_avg_sq_dtype)):
        need(dtype in MOMENT_DTYPES, f"{flag} must be one of {', '.join(MOMENT_DTYPES)}, got '{dtype}'")
        need(dtype == "fp32" or t.use_precision_aware_optimizer, f"{flag} {dtype} takes effect with --use-precision-aware-optimizer; add it")
        need(dtype == "fp32" or (t.optimizer_impl != "reference" and t.device != "cpu" and triton_available()),
             f"{flag} {dtype} needs the fused optimizer step (a GPU with Triton, --optimizer-impl auto or fused)")  # fmt: skip
    need(m.recompute_num_layers >= 1, f"--recompute-num-layers must be at least 1, got {m.recompute_num_layers}")
    max_pos = m.max_position_embeddings or d.seq_length
    need(d.seq_length > 0, f"--seq-length must be positive, got {d.seq_length}")
    if m.position_embedding_type in ("learned_absolute", "rope"):  # RoPE's cos/sin tables have max_pos rows too
        need(
            d.seq_length <= max_pos,
            f"--seq-length {d.seq_length} exceeds --max-position-embeddings {max_pos}; raise it or shorten the sequence",
        )

    need(t.micro_batch_size > 0, f"--micro-batch-size must be positive, got {t.micro_batch_size}")
    need(p.cp_comm_type in ("p2p", "all_gather"), f"--cp-comm-type must be p2p or all_gather, got '{p.cp_comm_type}'")
    need(p.tp_comm_overlap_backend in ("p2p", "bulk", "symm_mem"),
         f"--tp-comm-overlap-backend must be p2p, bulk or symm_mem, got '{p.tp_comm_overlap_backend}'")  # fmt: skip
    if p.tp_comm_overlap:
        need(p.tensor_parallel > 1 and p.sequence_parallel,
             "--tp-comm-overlap overlaps sequence parallelism's gathers and reduce-scatters: it needs "
             "--tensor-model-parallel-size > 1 and --sequence-parallel; add them or drop --tp-comm-overlap")  # fmt: skip
        need(not m.fp8_format, "--tp-comm-overlap does not cover FP8 linears (--fp8-format); drop one of the two")
    if p.overlap_param_gather:
        need(not p.fsdp, "--overlap-param-gather is for the distributed optimizer; FSDP2 gathers each layer's parameters "
             "in its forward already, the next layer's prefetched: drop --overlap-param-gather")
        need(p.use_distributed_optimizer, "--overlap-param-gather overlaps the distributed optimizer's parameter all-gather "
             "with the next forward: add --use-distributed-optimizer")
        need(not t.compile, "--overlap-param-gather waits for each bucket in forward pre-hooks, which --compile would trace "
             "into the compiled blocks: drop one of the two")  # fmt: skip
    if p.fsdp:
        need(p.pipeline_parallel == 1, "--fsdp does not combine with pipeline parallelism; use the distributed optimizer")
        need(p.tensor_parallel == 1, f"--fsdp needs --tensor-model-parallel-size 1 (got {p.tensor_parallel}); use the distributed optimizer with tp")
        need(not p.use_distributed_optimizer, "--fsdp and --use-distributed-optimizer both shard optimizer state; pick one")
        need(t.optimizer_impl != "fused", "--optimizer-impl fused needs meshtron's flat gradient buffer, which --fsdp replaces; use auto or reference")
        need(t.exp_avg_dtype == t.exp_avg_sq_dtype == "fp32", "--fsdp keeps fp32 Adam moments (the fused step that stores them narrower "
             "needs meshtron's flat gradient buffer); drop --exp-avg-dtype / --exp-avg-sq-dtype")  # fmt: skip
    model_parallel = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
    for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel", "expert_tensor_parallel"):
        need(getattr(p, name) >= 1, f"parallel.{name} must be at least 1")
    if model_parallel >= 1:
        need(
            world_size % model_parallel == 0,
            f"world size {world_size} is not a multiple of tp {p.tensor_parallel} x pp {p.pipeline_parallel} x "
            f"cp {p.context_parallel} = {model_parallel}; change the parallel sizes or the number of processes",
        )
    dp = max(1, world_size // max(1, model_parallel))
    need(p.pipeline_split in ("cost", "uniform"), f"--pipeline-split must be cost or uniform, got '{p.pipeline_split}'")
    need(p.pipeline_schedule in ("auto", *KINDS), f"--pipeline-schedule must be auto, {', '.join(KINDS)}, got '{p.pipeline_schedule}'")
    if p.num_layers_per_virtual_pipeline_stage and p.pipeline_parallel > 0:
        blocks = num_blocks(m)  # T5: encoder and decoder blocks
        per_rank = blocks // max(1, p.pipeline_parallel)
        need(
            blocks % p.pipeline_parallel == 0 and per_rank % p.num_layers_per_virtual_pipeline_stage == 0,
            f"--num-layers-per-virtual-pipeline-stage {p.num_layers_per_virtual_pipeline_stage} must divide the "
            f"{blocks} layers / pp {p.pipeline_parallel} of each pipeline rank",
        )
    virtual = virtual_stages(p, num_blocks(m))
    need(virtual == 1 or p.pipeline_parallel > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
    if p.pipeline_parallel > 1:
        errors.extend(zero_bubble_errors(cfg, virtual))
    interleaved = p.pipeline_parallel > 1 and p.pipeline_schedule != "zbv" and (virtual > 1 or p.pipeline_schedule == "interleaved")
    if interleaved and t.micro_batch_size > 0:
        micro = t.global_batch_size // max(1, t.micro_batch_size * dp)
        need(
            micro % p.pipeline_parallel == 0,
            f"the interleaved schedule needs the {micro} micro batches per step to be a multiple of pp "
            f"{p.pipeline_parallel}; change --global-batch-size or --micro-batch-size",
        )
    if t.micro_batch_size > 0:
        need(
            t.global_batch_size % (t.micro_batch_size * dp) == 0 and t.global_batch_size > 0,
            f"--global-batch-size {t.global_batch_size} is not a multiple of --micro-batch-size {t.micro_batch_size} "
            f"x data-parallel size {dp} = {t.micro_batch_size * dp}; use e.g. "
            f"{max(1, round(t.global_batch_size / (t.micro_batch_size * dp))) * t.micro_batch_size * dp}",
        )
    errors.extend(batch_schedule_errors(t, dp, p.pipeline_parallel if interleaved else 0))
    need(t.train_iters > 0, f"--train-iters must be positive, got {t.train_iters}")
    errors.extend(stop_config_errors(t) + release_errors(t))
    need(t.lr >= 0 and t.min_lr >= 0, "--lr and --min-lr must not be negative")
    need(t.min_lr <= t.lr, f"--min-lr {t.min_lr} is above --lr {t.lr}")
    need(t.lr_decay_style in ("constant", "linear", "cosine", "wsd"), f"--lr-decay-style must be constant, linear, cosine or wsd, got '{t.lr_decay_style}'")
    need(t.precision in ("auto", "fp32", "bf16", "fp16"), f"train.precision must be auto, fp32, bf16 or fp16, got '{t.precision}'")
    need(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, got '{t.device}'")
    need(t.clip_grad >= 0, f"--clip-grad must not be negative, got {t.clip_grad}")

    if d.mock and d.data_path:
        errors.append("--mock-data and --data-path are both set; keep one")
    if d.sft:
        errors.extend(sft_errors(cfg))
    elif names_data(d):
        for flag, blend in [("--data-path", d.data_path), *zip(SPLIT_FLAGS.values(), split_blends(d))]:
            errors.extend(_check_data_path(blend, flag) if blend else [])
        if not d.tokenizer_type:
            errors.append("--data-path is set but --tokenizer-type is not; name the tokenizer the data was made with")
    try:
        parts = [float(x) for x in d.split.replace("/", ",").split(",")]
        need(len(parts) <= 3 and sum(parts) > 0 and min(parts) >= 0, f"--split '{d.split}' must be up to 3 non-negative weights like 969,30,1")
    except ValueError:
        errors.append(f"--split '{d.split}' must be comma-separated numbers like 969,30,1")
    if c.load and not Path(c.load).exists() and Path(c.load) != Path(c.save):  # --load = --save: the first start of a resumable job
        errors.append(f"--load {c.load} does not exist; point it at a checkpoint directory written by --save")
    errors.extend(layout_errors(cfg) + expert_parallel_errors(cfg, dp) + dropin_errors(cfg))
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))




def zero_bubble_errors(cfg: Config, virtual: int) -> list[str]:
    """What the zero-bubble schedules (``--pipeline-schedule zb-h1 | zbv``) need. Their weight-gradient
    pass runs the GEMMs the eager linears kept from backward (``kernels.deferred_wgrad``), which
    compiled blocks and FP8 linears do not keep: the schedule would run, exactly, with nothing to
    fill its bubbles. zbv places two model chunks per rank in a V (rank r: chunks r and 2 pp - 1 - r),
    which per-rank layer counts, written for the ring of the other schedules, do not describe."""
    p, kind, errors = cfg.parallel, cfg.parallel.pipeline_schedule, []
    if kind not in SPLIT_BACKWARD:
        return errors
    if cfg.train.compile:
        errors.append(f"--pipeline-schedule {kind} defers each linear's weight gradient out of backward, which a "
                      f"compiled block's traced backward cannot; drop --compile or use --pipeline-schedule 1f1b")  # fmt: skip
    if cfg.model.fp8_format:
        errors.append(f"--pipeline-schedule {kind} defers the weight gradients of the linears that write into main_grad, "
                      f"which FP8 linears do not; drop --fp8-format or use --pipeline-schedule 1f1b or interleaved")  # fmt: skip
    if kind == "zb-h1" and virtual != 1:
        errors.append(f"--pipeline-schedule zb-h1 runs one model chunk per rank; drop the virtual pipeline size ({virtual}) "
                      f"or use --pipeline-schedule zbv (2 chunks per rank) or interleaved")  # fmt: skip
    if kind == "zbv":
        if virtual != 2:
            errors.append(f"--pipeline-schedule zbv runs two model chunks per rank in a V; set "
                          f"--virtual-pipeline-model-parallel-size 2 (got {virtual} chunks per rank)")  # fmt: skip
        if p.first_pipeline_stage_layers or p.last_pipeline_stage_layers:
            errors.append("--decoder-first/last-pipeline-num-layers count layers per rank in the ring placement; under "
                          "--pipeline-schedule zbv rank 0 holds the first and the last chunk: use --pipeline-split cost "
                          "or --account-for-embedding/loss-in-pipeline-split")  # fmt: skip
    return errors


def dropin_errors(cfg: Config) -> list[str]:
    """The flags of Megatron launch scripts that meshtron accepts but cannot honour with these
    values, and the fields they set (optimizer, W&B, profiler, timeouts)."""
    m, d, p, log = cfg.model, cfg.data, cfg.parallel, cfg.logging
    errors = noted_flag_errors(log.noted_flags)
    if "--no-position-embedding" in log.noted_flags and m.position_embedding_type != "rope":
        errors.append("--no-position-embedding: a model without any position information is not implemented; "
                      "add --position-embedding-type rope")  # fmt: skip
    errors.extend(optimizer_choice_errors(cfg) + decoupled_lr_errors(cfg.train))
    if d.tokenizer_model and not d.tokenizer_type:
        errors.append("--tokenizer-model is set but --tokenizer-type is not; name its type (e.g. HuggingFaceTokenizer)")
    if m.extra_vocab_size < 0 or m.moe_num_shared_experts < 0:
        errors.append("--extra-vocab-size and --num-shared-experts must not be negative")
    if m.moe_num_shared_experts and not m.num_experts:
        errors.append("--num-shared-experts needs a mixture-of-experts model (--num-experts)")
    if m.moe_layer_recompute and not m.num_experts:
        errors.append("--moe-layer-recompute (or --recompute-modules moe) recomputes mixture-of-experts layers, and this model has "
                      "none; drop it, or use --recompute-granularity full or selective for a dense model")
    if p.distributed_timeout_minutes < 1:
        errors.append(f"--distributed-timeout-minutes must be at least 1, got {p.distributed_timeout_minutes}")
    if log.tensorboard_queue_size < 1:
        errors.append(f"--tensorboard-queue-size must be at least 1, got {log.tensorboard_queue_size}")
    if log.profile and not 0 <= log.profile_step_start < log.profile_step_end:
        errors.append(f"--profile-step-start {log.profile_step_start} must be >= 0 and below --profile-step-end {log.profile_step_end}")
    if log.profile and not (log.tensorboard_dir or cfg.checkpoint.save):
        errors.append("--profile writes its trace under the run directory: set --tensorboard-dir or --save")
    if log.wandb_project and importlib.util.find_spec("wandb") is None:
        errors.append("--wandb-project needs the wandb package, which is not installed: `pip install wandb` "
                      "(WANDB_MODE=offline logs without an account), or drop --wandb-project")  # fmt: skip
    return errors


def optimizer_choice_errors(cfg: Config) -> list[str]:
    """``--optimizer`` and the SGD / Muon flags, and the layouts each rule runs under."""
    t, p = cfg.train, cfg.parallel
    if t.optimizer == "dist_muon":
        return ["--optimizer dist_muon is Megatron's deprecated spelling: use --optimizer muon --use-distributed-optimizer"]
    if t.optimizer not in OPTIMIZERS:
        return [f"--optimizer {t.optimizer}: one of {' | '.join(OPTIMIZERS)}"]
    if t.optimizer == "adam":
        return []
    errors, flag = [], f"--optimizer {t.optimizer}"
    if t.optimizer_impl == "fused":
        errors.append(f"{flag}: --optimizer-impl fused is AdamW's kernel; use --optimizer-impl auto or reference")
    if t.exp_avg_dtype != "fp32" or t.exp_avg_sq_dtype != "fp32":
        errors.append(f"{flag}: --exp-avg-dtype / --exp-avg-sq-dtype narrow AdamW's moments in its fused step; drop them")
    if p.overlap_param_gather:
        errors.append(f"{flag}: --overlap-param-gather overlaps the flat-range (AdamW) distributed optimizer's gathers; drop it")
    if t.optimizer == "sgd" and not 0.0 <= t.sgd_momentum < 1.0:
        errors.append(f"--sgd-momentum {t.sgd_momentum}: must be in [0, 1)")
    if t.optimizer == "muon":
        errors.extend(muon_settings_errors(muon_settings(t)))
        if p.expert_tensor_parallel > 1:
            errors.append("--optimizer muon orthogonalizes each expert's matrix whole, which --expert-tensor-parallel-size > 1 "
                          "splits (not gathered yet): set it to 1")  # fmt: skip
    return errors


def decoupled_lr_errors(t: TrainConfig) -> list[str]:
    """``--decoupled-lr`` / ``--decoupled-min-lr``: rates that make a schedule, and the reference
    AdamW step they run on (the fused kernel takes one learning rate)."""
    if not t.decoupled_lr:
        return ["--decoupled-min-lr takes effect only with --decoupled-lr; add it or drop --decoupled-min-lr"] if t.decoupled_min_lr else []
    if not 0 <= t.decoupled_min_lr <= t.decoupled_lr:
        return [f"need 0 <= --decoupled-min-lr <= --decoupled-lr, got {t.decoupled_min_lr} and {t.decoupled_lr}"]
    errors = []
    if t.optimizer_impl == "fused":
        errors.append("--decoupled-lr: the fused AdamW step takes one learning rate; use --optimizer-impl auto or reference")
    if t.exp_avg_dtype != "fp32" or t.exp_avg_sq_dtype != "fp32":
        errors.append("--decoupled-lr runs the reference AdamW step, whose moments are fp32; drop --exp-avg-dtype / --exp-avg-sq-dtype")
    return errors


def sft_errors(cfg: Config) -> list[str]:
    """``--sft``: one readable jsonl of conversations for a decoder, and a layout that exists."""
    d = cfg.data
    errors = []
    if d.mock or len(d.data_path) != 1:
        errors.append("--sft needs --data-path FILE.jsonl (one file, one conversation per line), without --mock-data")
    elif not Path(d.data_path[0]).is_file():
        errors.append(f"--sft --data-path {d.data_path[0]}: no such file (a jsonl of 'messages' or 'prompt'/'response' records)")
    if d.eod_mask_loss:
        errors.append("--eod-mask-loss: with --sft the loss covers exactly the assistant's tokens (a reply's end included); drop it")
    if not spec_for(cfg.model).sft:
        errors.append(f"--sft fine-tunes decoders; --model-type {cfg.model.model_type} is not one")
    if d.sft_chat_template not in TEMPLATE_CHOICES:
        errors.append(f"--sft-chat-template must be one of {', '.join(TEMPLATE_CHOICES)}, got '{d.sft_chat_template}'")
    elif d.sft_chat_template == "tokenizer":
        try:
            conversation_template(d.sft_chat_template, d.tokenizer_type, d.tokenizer_model)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def _divisor_near(n: int, k: int) -> int:
    divisors = [x for x in range(1, n + 1) if n % x == 0]
    return min(divisors, key=lambda x: abs(x - k))


def _check_data_path(tokens: list[str], flag: str) -> list[str]:
    """``prefix`` or ``w1 prefix1 w2 prefix2 ...`` given to ``flag``: each prefix must have .bin and .idx."""
    errors = []
    prefixes = tokens
    if len(tokens) > 1:
        if len(tokens) % 2:
            return [f"{flag} with several entries must be weight/prefix pairs, got {tokens}"]
        try:
            [float(w) for w in tokens[0::2]]
        except ValueError:
            return [f"{flag} with several entries must be weight/prefix pairs, got {tokens}"]
        prefixes = tokens[1::2]
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).is_file():
                errors.append(f"{flag}: '{prefix}{ext}' not found (give the prefix without extension, as written by `meshtron preprocess`)")
        if prefix.endswith((".jsonl", ".json")):
            errors.append(f"{flag} {prefix} is a jsonl: add --sft to fine-tune on its conversations, or `meshtron preprocess` its text")
    return errors


def expert_parallel_errors(cfg: Config, dp: int) -> list[str]:
    """Expert parallelism against the model and the layout (``dp`` data-parallel ranks): experts
    to split, evenly, over the expert grid etp x ep x edp that folds each pipeline stage's
    tp x cp x dp ranks, and their FFNs over etp; what is not implemented for it."""
    m, p = cfg.model, cfg.parallel
    ep, etp, errors = p.expert_parallel, p.expert_tensor_parallel, []
    stage = p.tensor_parallel * p.context_parallel * dp  # the ranks of one pipeline stage
    if etp >= 1 and stage % etp:  # below 1: reported with the sizes
        errors.append(f"--expert-tensor-parallel-size {etp} must divide the {stage} ranks of a pipeline stage (tp "
                      f"{p.tensor_parallel} x cp {p.context_parallel} x dp {dp}); change it or the number of processes")  # fmt: skip
    elif etp > 1 and m.num_experts <= 0:
        errors.append(f"--expert-tensor-parallel-size {etp} needs a mixture-of-experts model (--num-experts); set it to 1")
    elif etp > 1 and expert_ffn_hidden_size(m) % etp:
        errors.append(f"--expert-tensor-parallel-size {etp} must divide the experts' FFN width {expert_ffn_hidden_size(m)} "
                      "(--moe-ffn-hidden-size); change either")  # fmt: skip
    if m.num_experts > 0 and m.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        errors.append(f"--moe-token-dispatcher-type must be alltoall or allgather, got '{m.moe_token_dispatcher_type}'")
    if m.overlap_moe_expert_parallel_comm:
        errors.extend(expert_overlap_errors(m, ep))
    if ep <= 1:
        return errors
    if m.num_experts <= 0:
        return errors + [f"--expert-model-parallel-size {ep} needs a mixture-of-experts model, and this model is dense "
                         "(no --num-experts); set --expert-model-parallel-size 1"]  # fmt: skip
    if m.num_experts % ep:
        errors.append(f"--expert-model-parallel-size {ep} must divide --num-experts {m.num_experts} (each rank holds "
                      "an equal share of the experts); change either")  # fmt: skip
    if etp >= 1 and stage % etp == 0 and stage % (ep * etp):  # an etp not dividing is reported above
        errors.append(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = {ep * etp} must divide the "
                      f"{stage} ranks of a pipeline stage (tp {p.tensor_parallel} x cp {p.context_parallel} x dp {dp}; the "
                      "expert grid folds them); change either or the number of processes")  # fmt: skip
    return errors


def expert_overlap_errors(m: ModelConfig, ep: int) -> list[str]:
    """``--overlap-moe-expert-parallel-comm`` against the model and ``ep``: an all-to-all to hide
    (ep > 1, the alltoall dispatcher) and at least one local expert per chunk."""
    flag = "--overlap-moe-expert-parallel-comm"
    if m.num_experts <= 0 or ep <= 1:
        return [(f"{flag} overlaps the expert-parallel all-to-all, and with --expert-model-parallel-size {ep} "
                 f"{'(a dense model) ' if m.num_experts <= 0 else ''}there is none; drop the flag or set ep > 1")]  # fmt: skip
    if m.moe_token_dispatcher_type != "alltoall":
        return [(f"{flag} pipelines the alltoall dispatcher, not --moe-token-dispatcher-type {m.moe_token_dispatcher_type}; "
                 "use alltoall or drop the flag")]  # fmt: skip
    local = m.num_experts // ep
    if not 2 <= m.moe_ep_overlap_chunks <= local:
        return [(f"--model.moe_ep_overlap_chunks {m.moe_ep_overlap_chunks} must be between 2 and the {local} experts per "
                 f"ep rank (--num-experts {m.num_experts} / ep {ep}): each chunk is a run of local experts")]  # fmt: skip
    return []


def layout_errors(cfg: Config) -> list[str]:
    """Why the model cannot be split over the layout: its family's own rules for tp (heads,
    groups, widths), then the sequence for sp and cp, the pipeline stage split, expert parallelism,
    and what cannot follow training in a sharded run."""
    m, d, p, log = cfg.model, cfg.data, cfg.parallel, cfg.logging
    tp, cp, pp = p.tensor_parallel, p.context_parallel, p.pipeline_parallel
    if min(tp, cp, pp) < 1:
        return []  # reported with the sizes above
    errors = model_layout_errors(m, tp) if tp > 1 else []
    if p.sequence_parallel and tp > 1 and d.seq_length % tp:
        errors.append(f"--sequence-parallel splits --seq-length {d.seq_length} over {tp} ranks; use a sequence length "
                      f"that is a multiple of {tp} or drop --sequence-parallel")  # fmt: skip
    if cp > 1:
        if d.seq_length % (2 * cp):
            errors.append(f"--seq-length {d.seq_length} must be a multiple of 2 x --context-parallel-size = {2 * cp} "
                          f"(each sequence is cut into {2 * cp} equal chunks for load balance); change either")  # fmt: skip
        if m.attention_dropout > 0:
            errors.append("attention dropout is not supported with context parallelism; set --attention-dropout 0")
    try:
        # The vocabulary and the micro batches change which split is best, not whether one exists.
        blocks = num_blocks(m)
        pipeline_split(p, blocks, virtual_stages(p, blocks), pipeline_costs(m, 0, d.seq_length))
    except ValueError as exc:
        errors.append(f"the pipeline stage split does not work: {exc}")
    if log.generate_prompt and (tp > 1 or cp > 1 or pp > 1):
        errors.append("--generate-prompt samples after training from the whole model on each rank, which tensor, context "
                      "and pipeline parallelism split; drop it and sample from the saved checkpoint with "
                      "`meshtron generate --load DIR --prompt ...` (one process)")  # fmt: skip
    return errors
