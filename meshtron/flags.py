"""Megatron-LM's command-line flag names, accepted as aliases of meshtron's config fields.

A value is the dotted field a flag sets, or ``(field, constant)`` for a flag that takes no
argument and sets that constant (``--bf16`` sets ``train.precision = "bf16"``).
"""

from __future__ import annotations

from typing import Any

# Megatron-LM's flag names (and a few of their environment-script spellings) -> our field.
# A value of ``(field, constant)`` means the flag takes no argument and sets that constant.
MEGATRON_ALIASES: dict[str, Any] = {
    "num-layers": "model.num_layers",
    "hidden-size": "model.hidden_size",
    "ffn-hidden-size": "model.ffn_hidden_size",
    "num-attention-heads": "model.num_attention_heads",
    "num-query-groups": "model.num_query_groups",
    "group-query-attention": ("model.num_query_groups", None),  # Megatron's switch; groups come from --num-query-groups
    "kv-channels": "model.kv_channels",
    "max-position-embeddings": "model.max_position_embeddings",
    "vocab-size": "model.vocab_size",
    "make-vocab-size-divisible-by": "model.make_vocab_size_divisible_by",
    "normalization": "model.normalization",
    "norm-epsilon": "model.norm_epsilon",
    "layernorm-epsilon": "model.norm_epsilon",
    "swiglu": ("model.activation", "swiglu"),
    "openai-gelu": ("model.activation", "gelu_tanh"),
    "position-embedding-type": "model.position_embedding_type",
    "relative-attention-num-buckets": "model.relative_attention_num_buckets",
    "relative-attention-max-distance": "model.relative_attention_max_distance",
    "rotary-base": "model.rotary_base",
    "rotary-percent": "model.rotary_percent",
    "use-rope-scaling": ("model.rope_scaling", "llama3"),
    "rope-scaling-factor": "model.rope_scaling_factor",
    "untie-embeddings-and-output-weights": ("model.tie_embeddings", False),
    "disable-bias-linear": ("model.add_bias_linear", False),
    "add-qkv-bias": ("model.add_qkv_bias", True),
    "attention-dropout": "model.attention_dropout",
    "hidden-dropout": "model.hidden_dropout",
    "init-method-std": "model.init_method_std",
    "attention-backend": "model.attention_backend",
    "no-fused-kernels": ("model.fused_kernels", "off"),
    "recompute-granularity": "model.recompute_granularity",
    "recompute-method": "model.recompute_method",
    "recompute-num-layers": "model.recompute_num_layers",
    "recompute-modules": "model.recompute_modules",
    "fp8-format": "model.fp8_format",
    "compile": "train.compile",
    "use-precision-aware-optimizer": ("train.use_precision_aware_optimizer", True),
    "exp-avg-dtype": "train.exp_avg_dtype",
    "exp-avg-sq-dtype": "train.exp_avg_sq_dtype",
    "gemm-tuning": "train.gemm_tuning",
    "gradient-accumulation-fusion": ("train.gradient_accumulation_fusion", True),
    "no-gradient-accumulation-fusion": ("train.gradient_accumulation_fusion", False),  # Megatron's spelling (on there by default)
    "seq-length": "data.seq_length",
    "data-path": "data.data_path",
    "train-data-path": "data.train_data_path",
    "valid-data-path": "data.valid_data_path",
    "test-data-path": "data.test_data_path",
    "data-args-path": "data.data_args_path",
    "per-split-data-args-path": "data.per_split_data_args_path",
    "split": "data.split",
    "mock-data": ("data.mock", True),
    "tokenizer-type": "data.tokenizer_type",
    "tokenizer-model": "data.tokenizer_model",
    "vocab-file": "data.vocab_file",
    "merge-file": "data.merge_file",
    "data-cache-path": "data.data_cache_path",
    "reset-position-ids": ("data.reset_position_ids", True),
    "reset-attention-mask": ("data.reset_attention_mask", True),
    "eod-mask-loss": ("data.eod_mask_loss", True),
    "num-workers": "data.num_workers",
    "micro-batch-size": "train.micro_batch_size",
    "global-batch-size": "train.global_batch_size",
    "train-iters": "train.train_iters",
    "train-samples": "train.train_samples",
    "rampup-batch-size": "train.rampup_batch_size",
    "exit-interval": "train.exit_interval",
    "exit-duration-in-mins": "train.exit_duration_in_mins",
    "exit-signal": "train.exit_signal",
    "log-straggler": ("train.log_straggler", True),
    "straggler-minmax-count": "train.straggler_minmax_count",
    "manual-gc": ("train.manual_gc", True),
    "manual-gc-interval": "train.manual_gc_interval",
    "no-manual-gc-eval": ("train.manual_gc_eval", False),
    "empty-unused-memory-level": "train.empty_unused_memory_level",
    "seed": "train.seed",
    "lr": "train.lr",
    "min-lr": "train.min_lr",
    "lr-decay-style": "train.lr_decay_style",
    "lr-warmup-iters": "train.lr_warmup_iters",
    "lr-warmup-fraction": "train.lr_warmup_fraction",
    "decoupled-lr": "train.decoupled_lr",
    "decoupled-min-lr": "train.decoupled_min_lr",
    "lr-decay-iters": "train.lr_decay_iters",
    "lr-wsd-decay-iters": "train.lr_wsd_decay_iters",
    "lr-warmup-samples": "train.lr_warmup_samples",
    "lr-decay-samples": "train.lr_decay_samples",
    "lr-wsd-decay-samples": "train.lr_wsd_decay_samples",
    "weight-decay": "train.weight_decay",
    "adam-beta1": "train.adam_beta1",
    "adam-beta2": "train.adam_beta2",
    "adam-eps": "train.adam_eps",
    "clip-grad": "train.clip_grad",
    "bf16": ("train.precision", "bf16"),
    "fp16": ("train.precision", "fp16"),
    "fp32": ("train.precision", "fp32"),
    "initial-loss-scale": "train.initial_loss_scale",
    "min-loss-scale": "train.min_loss_scale",
    "loss-scale-window": "train.loss_scale_window",
    "hysteresis": "train.hysteresis",
    "tensor-model-parallel-size": "parallel.tensor_parallel",
    "tp": "parallel.tensor_parallel",
    "pipeline-model-parallel-size": "parallel.pipeline_parallel",
    "pp": "parallel.pipeline_parallel",
    "context-parallel-size": "parallel.context_parallel",
    "cp": "parallel.context_parallel",
    "expert-model-parallel-size": "parallel.expert_parallel",
    "ep": "parallel.expert_parallel",
    "sequence-parallel": ("parallel.sequence_parallel", True),
    "tp-comm-overlap": ("parallel.tp_comm_overlap", True),
    "use-distributed-optimizer": ("parallel.use_distributed_optimizer", True),
    "overlap-param-gather": ("parallel.overlap_param_gather", True),
    "use-torch-fsdp2": ("parallel.fsdp", True),
    "virtual-pipeline-model-parallel-size": "parallel.virtual_pipeline_parallel",
    "num-layers-per-virtual-pipeline-stage": "parallel.num_layers_per_virtual_pipeline_stage",
    "decoder-first-pipeline-num-layers": "parallel.first_pipeline_stage_layers",
    "decoder-last-pipeline-num-layers": "parallel.last_pipeline_stage_layers",
    "account-for-embedding-in-pipeline-split": ("parallel.account_for_embedding_in_pipeline_split", True),
    "account-for-loss-in-pipeline-split": ("parallel.account_for_loss_in_pipeline_split", True),
    "ddp-bucket-size": "parallel.ddp_bucket_size",
    "cp-comm-type": "parallel.cp_comm_type",
    "save": "checkpoint.save",
    "load": "checkpoint.load",
    "save-interval": "checkpoint.save_interval",
    "no-save-optim": ("checkpoint.no_save_optim", True),
    "no-load-optim": ("checkpoint.no_load_optim", True),
    "no-load-rng": ("checkpoint.no_load_rng", True),
    "log-interval": "logging.log_interval",
    "eval-interval": "logging.eval_interval",
    "eval-iters": "logging.eval_iters",
    "tensorboard-dir": "logging.tensorboard_dir",
    # Mixture of experts: Megatron-Core's names ...
    "num-experts": "model.num_experts",
    "moe-router-topk": "model.moe_router_topk",
    "moe-ffn-hidden-size": "model.moe_ffn_hidden_size",
    "moe-router-load-balancing-type": "model.moe_router_load_balancing_type",
    "moe-aux-loss-coeff": "model.moe_aux_loss_coeff",
    "moe-z-loss-coeff": "model.moe_z_loss_coeff",
    "moe-router-score-function": "model.moe_router_score_function",
    "moe-router-pre-softmax": ("model.moe_router_pre_softmax", True),
    "moe-router-topk-scaling-factor": "model.moe_router_topk_scaling_factor",
    "moe-router-num-groups": "model.moe_router_num_groups",
    "moe-router-group-topk": "model.moe_router_group_topk",
    "moe-router-dtype": "model.moe_router_dtype",
    "moe-router-enable-expert-bias": ("model.moe_router_enable_expert_bias", True),
    "moe-router-bias-update-rate": "model.moe_router_bias_update_rate",
    "moe-input-jitter-eps": "model.moe_jitter_eps",
    "moe-expert-capacity-factor": "model.moe_expert_capacity_factor",
    "moe-token-drop-policy": "model.moe_token_drop_policy",
    "moe-pad-expert-input-to-capacity": ("model.moe_pad_expert_input_to_capacity", True),
    "moe-shared-expert-intermediate-size": "model.moe_shared_expert_intermediate_size",
    "moe-shared-expert-gate": ("model.moe_shared_expert_gate", True),
    "moe-layer-freq": "model.moe_layer_freq",
    "moe-layer-recompute": ("model.moe_layer_recompute", True),
    "moe-router-force-load-balancing": ("model.moe_router_force_load_balancing", True),
    "moe-router-topk-limited-devices": "model.moe_router_topk_limited_devices",
    "moe-grouped-gemm": ("model.moe_grouped_gemm", "auto"),  # a switch there; --model.moe_grouped_gemm loop|torch|triton picks here
    # ... and the Stanford/MegaBlocks fork's (its --moe-capacity-factor 0 is dropless, as 0 is here;
    # its --moe-loss-weight is the layer-averaged coefficient, a field of its own).
    "moe-num-experts": "model.num_experts",
    "moe-top-k": "model.moe_router_topk",
    "moe-capacity-factor": "model.moe_expert_capacity_factor",
    "moe-loss-weight": "model.moe_loss_weight",
    "moe-jitter-eps": "model.moe_jitter_eps",
    # DeepSeek-V2 multi-head latent attention and YaRN (meshtron/layers/mla.py). --qk-layernorm
    # norms MLA's q and kv latents (Megatron's meaning under MLA; DeepSeek's checkpoints have both),
    # and each head's q and k in standard attention (Megatron-Core's meaning there; Qwen3's norms).
    # Megatron's --qk-head-dim is the no-RoPE part; PAI-Megatron-Patch (the ROCm DeepSeek script)
    # spells it --qk-nope-head-dim and the RoPE part --qk-rope-head-dim, like HF.
    "multi-latent-attention": ("model.multi_latent_attention", True),
    "q-lora-rank": "model.q_lora_rank",
    "kv-lora-rank": "model.kv_lora_rank",
    "qk-head-dim": "model.qk_head_dim",
    "qk-nope-head-dim": "model.qk_head_dim",
    "qk-pos-emb-head-dim": "model.qk_pos_emb_head_dim",
    "qk-rope-head-dim": "model.qk_pos_emb_head_dim",
    "v-head-dim": "model.v_head_dim",
    "qk-layernorm": ("model.qk_layernorm", True),
    "rotary-scaling-factor": "model.rope_scaling_factor",
    "yarn-original-max-position-embeddings": "model.rope_original_max_position_embeddings",
    "yarn-beta-fast": "model.rope_beta_fast",
    "yarn-beta-slow": "model.rope_beta_slow",
    "mscale": "model.rope_mscale",
    "mscale-all-dim": "model.rope_mscale_all_dim",
    # BERT / T5 / ICT data
    "mask-prob": "data.mask_prob",
    "short-seq-prob": "data.short_seq_prob",
    "vocab-extra-ids": "data.vocab_extra_ids",
    "encoder-seq-length": "data.encoder_seq_length",
    "decoder-seq-length": "data.decoder_seq_length",
    "titles-data-path": "data.titles_data_path",
    "query-in-block-prob": "data.query_in_block_prob",
    "use-one-sent-docs": ("data.use_one_sent_docs", True),
    # Checkpoint trust and divergence (issue 9), with Megatron's meanings.
    "ckpt-step": "checkpoint.ckpt_step",
    "finetune": ("checkpoint.finetune", True),
    "no-save-rng": ("checkpoint.no_save_rng", True),
    "ckpt-format": "checkpoint.ckpt_format",
    "dist-ckpt-strictness": "checkpoint.dist_ckpt_strictness",
    "check-for-nan-in-loss-and-grad": ("train.check_for_nan_in_loss_and_grad", True),  # --no-... turns it off
    # Accepted and ignored: they ask for what meshtron always does (every rank writes its own
    # shards and reads the boxes it needs itself); no flag changes that.
    "ckpt-fully-parallel-save": ("checkpoint.ckpt_format", None),
    "no-ckpt-fully-parallel-save": ("checkpoint.ckpt_format", None),
    "ckpt-fully-parallel-load": ("checkpoint.ckpt_format", None),
    # Model families: BERT and T5 (pretrain_bert.py's, pretrain_t5.py's flags); --model-type picks what Megatron's script does.
    "model-type": "model.model_type",
    "bert-no-binary-head": ("model.bert_binary_head", False),
    "encoder-num-layers": "model.encoder_num_layers",
    "decoder-num-layers": "model.decoder_num_layers",
    "apply-residual-connection-post-layernorm": ("model.apply_residual_connection_post_layernorm", True),
    # ICT: pretrain_ict.py's flags are the fields' own names; these are their older spellings.
    "ict-head-size": "model.biencoder_projection_dim",
    "report-topk-accuracies": "model.retriever_report_topk_accuracies",
    # Expert parallelism (issue 10), Megatron-Core's names; --expert-model-parallel-size is above.
    "moe-token-dispatcher-type": "model.moe_token_dispatcher_type",
    "expert-tensor-parallel-size": "parallel.expert_tensor_parallel",
    "overlap-moe-expert-parallel-comm": ("model.overlap_moe_expert_parallel_comm", True),
    # The ROCm fork's launch scripts (train_llama2.sh, train_llama3.sh, train_deepseekv2.sh, issue 14).
    # Model: older spellings of what the fields above set.
    "use-rotary-position-embeddings": ("model.position_embedding_type", "rope"),
    "recompute-activations": ("model.recompute_granularity", "selective"),
    "use-flash-attn": ("model.attention_backend", "flash"),
    "extra-vocab-size": "model.extra_vocab_size",
    "num-shared-experts": "model.moe_num_shared_experts",
    # Parallelism, data, checkpoints, logging, profiling.
    "optimizer": "train.optimizer",
    # The rules beside AdamW (issue 32), Megatron-Core's names and defaults.
    "sgd-momentum": "train.sgd_momentum",
    "muon-momentum": "train.muon_momentum",
    "muon-nesterov": ("train.muon_nesterov", True),
    "muon-no-split-qkv": ("train.muon_split_qkv", False),
    "muon-num-ns-steps": "train.muon_num_ns_steps",
    "muon-coefficient-type": "train.muon_coefficient_type",
    "muon-scale-mode": "train.muon_scale_mode",
    "muon-extra-scale-factor": "train.muon_extra_scale_factor",
    "muon-fp32-matmul-prec": "train.muon_fp32_matmul_prec",
    "muon-tp-mode": "train.muon_tp_mode",
    "optimizer-impl": "train.optimizer_impl",
    "grad-reduce-in-bf16": ("parallel.grad_reduce_in_bf16", True),
    "distributed-timeout-minutes": "parallel.distributed_timeout_minutes",
    "exit-on-missing-checkpoint": ("checkpoint.exit_on_missing_checkpoint", True),
    "tensorboard-queue-size": "logging.tensorboard_queue_size",
    "wandb-project": "logging.wandb_project",
    "wandb-exp-name": "logging.wandb_exp_name",
    "wandb-save-dir": "logging.wandb_save_dir",
    "profile": ("logging.profile", True),
    "profile-step-start": "logging.profile_step_start",
    "profile-step-end": "logging.profile_step_end",
    # Asynchronous save (sharded checkpoints): the saving step returns after a copy to host.
    "async-save": ("checkpoint.async_save", True),
}

# Megatron's values of a flag -> meshtron's, with what the translation means (said once at start-up).
VALUE_ALIASES: dict[str, dict[str, tuple[str, str]]] = {
    "model.attention_backend": {
        "fused": ("auto", "the fastest fused SDPA kernel the GPU has (cuDNN, then flash; ROCm starts at flash)"),
        "unfused": ("math", "PyTorch's reference attention (softmax of the full score matrix)"),
        "local": ("math", "PyTorch's reference attention (softmax of the full score matrix)"),
    },
    "checkpoint.ckpt_format": {
        "torch": ("torch_dist", "checkpoints are written as torch_dist (DCP); a Megatron-LM checkpoint of either format "
                  "loads after `meshtron convert megatron-import --load MEGATRON_DIR --save OUT`"),
    },
    "model.moe_token_dispatcher_type": {
        "flex": ("alltoall", "NCCL's variable-size all-to-all (counts first); DeepEP and HybridEP kernels are not used"),
    },
    "data.tokenizer_type": {
        "DeepSeekV2Tokenizer": ("HuggingFaceTokenizer", "the tokenizer.json in --tokenizer-model (a local directory or file)"),
        "DeepSeekV3Tokenizer": ("HuggingFaceTokenizer", "the tokenizer.json in --tokenizer-model (a local directory or file)"),
        "NullTokenizer": ("", "no tokenizer: --mock-data's vocabulary is --vocab-size (--data-path needs the tokenizer the data was made with)"),
    },
}

# Megatron flags for what meshtron always does, never does, or does its own way. They are accepted,
# recorded in ``logging.noted_flags``, and the start-up log says once what meshtron does for each.
# A value: (the flag takes a value, what meshtron does). Grouped by what the flags are about.
_MODEL_AND_FUSION_NOTES = {
    "no-position-embedding": (False, "no learned position table: positions come from --position-embedding-type rope"),
    "use-te-activation-func": (False, "meshtron's own activation kernels (Triton on a GPU per --fused-kernels); Transformer Engine is not used"),
    "no-bias-swiglu-fusion": (False, "SwiGLU fusion follows --fused-kernels (turn it off with --no-fused-kernels)"),
    "no-masked-softmax-fusion": (False, "never fused: attention runs in PyTorch SDPA (--attention-backend), which has no separate masked softmax"),
    "no-rope-fusion": (False, "RoPE fusion follows --fused-kernels (turn it off with --no-fused-kernels)"),
    "no-persist-layer-norm": (False, "LayerNorm runs meshtron's one Triton kernel per --fused-kernels (Apex's persistent variant is not used)"),
    "fused-single-qkv-rope": (False, "always: one QKV projection, RoPE applied to q and k (fused per --fused-kernels)"),
    "cross-entropy-fusion-impl": (True, "meshtron's chunked cross-entropy (--cross-entropy-loss-fusion: gradients taken in its forward), whichever implementation is named"),
    "use-mcore-models": (False, "always: meshtron has one model implementation, built like Megatron-Core's"),
    "use-legacy-models": (False, "meshtron has one model implementation, built like Megatron-Core's"),
    "attention-softmax-in-fp32": (False, "always: SDPA's fused kernels accumulate the softmax in fp32"),
    "enable-shared-expert": (False, "shared experts are on when --num-shared-experts or --moe-shared-expert-intermediate-size is set"),
    "moe-use-legacy-grouped-gemm": (False, "meshtron's grouped GEMM per --moe-grouped-gemm; there is no legacy one"),
    "apply-query-key-layer-scaling": (False, "not needed for fp16: SDPA's fused kernels scale the scores and take the softmax in fp32"),
    "apply-layernorm-1p": (False, ""),
    "enable-experimental": (False, "no experimental switch: each feature has its own flag (RoPE fusion follows --fused-kernels)"),
    "fused-padded-mla-attention": (False, "MLA pads v to the qk head dim where the attention kernel needs equal dims (flash, or auto on ROCm)"),
    # Refused for any value but the one in ACCEPTED_ONLY_VALUE (the ROCm fork's attention variants).
    "attention-sink-k": (True, "no attention-sink keys"),
    "window-size": (True, ""),
    "moe-shared-expert-overlap": (False, "no side stream for the shared experts (one measured no gain: DeepSeek-V2-Lite, 1 and 2 H200, "
                                         "ep2); under --overlap-moe-expert-parallel-comm they run while the first chunk's rows travel"),
}
_FP8_EXPERTS_NEED_NO_PADDING = "not needed: the FP8 experts' grouped GEMMs (model.moe_fp8 rowwise) take any rows per expert"
_NO_DEEPEP = "DeepEP is not used: tokens travel by NCCL's all-to-all (--moe-token-dispatcher-type alltoall)"
_MOE_NOTES = {
    "moe-permute-fusion": (False, "always where Triton runs (--fused-kernels): gather kernels permute the tokens and combine the experts' outputs"),
    "moe-router-fusion": (False, "always where it applies (--fused-kernels): one Triton kernel for the scores, the top-k and the balancing statistics"),
    "moe-per-layer-logging": (False, "always: each MoE layer's balancing losses go to TensorBoard, and the expert loads to the log"),
    "moe-lbl-in-fp32": (False, "always: the balancing and z-losses are computed in fp32"),
    "moe-router-padding-for-fp8": (False, _FP8_EXPERTS_NEED_NO_PADDING),
    "moe-router-padding-for-quantization": (False, _FP8_EXPERTS_NEED_NO_PADDING),
    "delay-wgrad-compute": (False, "never: weight gradients are computed in backward order"),
    "moe-enable-deepep": (False, _NO_DEEPEP),
    "moe-flex-dispatcher-backend": (True, _NO_DEEPEP),
    "moe-deepep-num-sms": (True, _NO_DEEPEP),
    # Refused with what to do instead (REFUSED_NOTED_VALUES), rather than "unknown flag".
    "moe-use-upcycling": (False, ""),
    "moe-extended-tp": (False, ""),
    "moe-apply-probs-on-input": (False, ""),
}
_PARALLELISM_NOTES = {
    "overlap-grad-reduce": (False, "always on (gradient buckets are reduced during backward)"),
    "ddp-average-in-collective": (False, "nothing to fold: losses are divided by the global batch's token count, so gradients are summed, never averaged"),
    "distributed-backend": (True, "chosen by device: nccl (rccl on ROCm) on GPUs, gloo on the CPU"),
    "no-async-tensor-model-parallel-allreduce": (False, "always: tensor-parallel linears do not overlap their input-gradient all-reduce with the weight-gradient GEMM"),
    "use-contiguous-parameters-in-local-ddp": (False, "always: gradients live in one contiguous fp32 buffer"),
}
# Transformer Engine's userbuffers knobs around --tp-comm-overlap (a real switch above): meshtron's overlap
# (parallel/tp_overlap.py) needs no buffers or config, and overlaps every gather and reduce-scatter of the
# sequence-parallel linears, forward and backward, or none.
_WHOLE_OVERLAP = "not switchable apart: --tp-comm-overlap overlaps every sequence-parallel gather and reduce-scatter, forward and backward"
_TP_OVERLAP_NOTES = {
    "tp-comm-overlap-cfg": (True, "no userbuffers config: --tp-comm-overlap cuts each collective into the tp sequence chunks"),
    "tp-comm-bootstrap-backend": (True, "no userbuffers to bootstrap: --tp-comm-overlap sends through the tensor-parallel process group"),
    **{flag: (False, _WHOLE_OVERLAP) for flag in (
        "disable-tp-comm-overlap-ag", "disable-tp-comm-overlap-rs", "disable-tp-comm-split-ag", "disable-tp-comm-split-rs",
        "disable-tp-comm-bulk-dgrad", "disable-tp-comm-bulk-wgrad", "tp-comm-overlap-rs-dgrad")},
}
_FP8_WEIGHT_CACHE = ("always: with several micro batches a step, each FP8 weight is cast once a step and its row-major and "
                     "transposed copies kept until the step ends (linears in --compile'd blocks: once per micro batch); "
                     "activations and gradients are cast per GEMM")
_PRECISION_NOTES = {
    "transformer-impl": (True, "always meshtron's own layers (Megatron's 'local': PyTorch modules, Triton kernels per --fused-kernels); "
                               "Transformer Engine is never used, FP8 comes from --fp8-format (torchao or meshtron's kernels)"),
    "fp8-interval": (True, "deprecated and ignored by Megatron too: delayed scaling updates its amax history every call"),
    "fp8-param-gather": (False, "never: parameters are gathered in the compute dtype"),
    "keep-fp8-transpose-cache": (False, _FP8_WEIGHT_CACHE),
    "keep-fp8-weight-transpose-cache-te": (False, _FP8_WEIGHT_CACHE),
    "reuse-grad-buf-for-mxfp8-param-ag": (False, "not applicable: meshtron has no MXFP8"),
    "main-grads-dtype": (True, "fp32: gradients accumulate in the fp32 gradient buffer"),
    "main-params-dtype": (True, "fp32: the optimizer's master weights"),
}
_DATA_NOTES = {
    "dataloader-type": (True, "samples come in the dataset's own shuffled order, each once per epoch, resumed at the consumed-sample count"),
    "dataset": (True, "meshtron reads --data-path .bin/.idx files (PAI's idxmap), a chat jsonl with --sft, or --mock-data"),
    "max-padding-length": (True, "documents are packed into --seq-length tokens; only --sft pads a row's end, with no loss"),
    "train-mode": (True, "pretraining"),
    "legacy-tokenizer": (False, "one tokenizer loader: --tokenizer-type picks it"),
    "no-create-attention-mask-in-dataloader": (False, "always: the data loader builds no attention mask; attention is causal in "
                                               "its kernel, within documents under --reset-attention-mask"),
    "no-mmap-bin-files": (False, "the .bin and .idx files are memory-mapped all the same: the OS reads the pages a batch touches"),
    "tiktoken-pattern": (True, "--tokenizer-type TikTokenizer reads a tiktoken rank file and splits with Llama 3's pattern; "
                         "Megatron's v1 and v2 patterns are not used"),
}
_LOGGING_NOTES = {
    "log-throughput": (False, "always: every log line has tokens/s and TFLOP/s per device"),
    "log-timers-to-tensorboard": (False, "always: the step time goes to TensorBoard as perf/ms_per_iter"),
    "log-batch-size-to-tensorboard": (False, "always: the global batch size goes to TensorBoard as train/batch_size"),
    "log-validation-ppl-to-tensorboard": (False, "always: validation perplexity goes to TensorBoard as valid/ppl"),
    "use-pytorch-profiler": (False, "always: --profile uses the PyTorch profiler"),
    "log-params-norm": (False, "not computed: the log line and TensorBoard carry the gradient norm (train/grad_norm)"),
    "log-num-zeros-in-grad": (False, "not counted: the log line and TensorBoard carry the gradient norm (train/grad_norm)"),
    "profile-ranks": (True, "global rank 0 records the trace"),
}
_OTHER_NOTES = {
    "muon-scalar-optimizer": (True, "AdamW takes Muon's non-matrix parameters (embeddings, output layer, routers, norms, biases)"),
    "muon-use-syrk": (False, "never: the Newton-Schulz Gram matrices are plain matmuls"),
    "exit-signal-handler": (False, "always: --exit-signal (SIGTERM by default) and SIGINT save and stop at an iteration all ranks agree on"),
    "rerun-mode": (True, "no re-run engine: --check-for-nan-in-loss-and-grad stops on a non-finite loss and the divergence check re-runs a step"),
    "use-checkpoint-args": (False, "never: the model comes from this run's flags; a checkpoint of another shape is refused at load"),
    "calculate-per-token-loss": (False, "always: the loss is the global batch's sum over its unmasked tokens divided by their count, "
                                 "across micro batches and data-parallel ranks"),
}
NOTED_FLAGS: dict[str, tuple[bool, str]] = {
    **_MODEL_AND_FUSION_NOTES, **_MOE_NOTES, **_PARALLELISM_NOTES, **_TP_OVERLAP_NOTES, **_PRECISION_NOTES, **_DATA_NOTES, **_LOGGING_NOTES, **_OTHER_NOTES,
}

# Megatron's allowed values of the noted flags that take one from a fixed set; another value is
# refused as Megatron's argument parser refuses it (a typo must not pass as "noted").
NOTED_VALUE_CHOICES: dict[str, tuple[str, ...]] = {
    "rerun-mode": ("disabled", "validate_results", "report_stats"),
    "transformer-impl": ("local", "transformer_engine", "inference_optimized"),
    "dataloader-type": ("single", "cyclic", "external"),
    "distributed-backend": ("nccl", "gloo"),
    "cross-entropy-fusion-impl": ("native", "te"),
    "main-grads-dtype": ("fp32", "bf16"),
    "main-params-dtype": ("fp32", "fp16"),
    "train-mode": ("pretrain", "finetune"),
    "moe-flex-dispatcher-backend": ("deepep", "hybridep"),
    "tiktoken-pattern": ("v1", "v2"),
}

# Values of a noted flag that meshtron cannot honour: refused with what to do instead.
REFUSED_NOTED_VALUES: dict[tuple[str, str], str] = {
    ("dataloader-type", "external"): "meshtron builds its own loader from --data-path (or --mock-data); drop --dataloader-type external",
    ("train-mode", "finetune"): "fine-tuning reads a chat jsonl with --sft (messages, or prompt/response records); drop --train-mode",
    ("transformer-impl", "inference_optimized"): "there is no inference-optimized implementation; drop --transformer-impl",
    ("main-grads-dtype", "bf16"): "gradients accumulate in the fp32 buffer; drop --main-grads-dtype bf16 (--grad-reduce-in-bf16 reduces them in bf16)",
    ("main-params-dtype", "fp16"): "master weights stay fp32; drop --main-params-dtype fp16",
    ("moe-use-upcycling", ""): "no upcycling of a dense checkpoint into experts; train the MoE model from scratch or import one (meshtron convert hf-import)",
    ("moe-extended-tp", ""): "Megatron deprecated it for --expert-tensor-parallel-size; give --expert-tensor-parallel-size <tp x ep> "
                             "--expert-model-parallel-size 1",
    ("moe-apply-probs-on-input", ""): "the routing weights scale the experts' outputs (unpermute), never their inputs; drop the flag",
    ("apply-layernorm-1p", ""): "norm gains are stored as they apply (centred on 1, not 0); drop the flag: with the gains' weight decay "
                                "off (the default), training is the same up to the rounding of the gains' bf16 copy (a Megatron "
                                "checkpoint saved with it imports as it applies)",
}

# Noted flags meshtron honours at one value only (Megatron's default; None: at none): any other is refused with what to do.
ACCEPTED_ONLY_VALUE: dict[str, tuple[str | None, str]] = {
    "attention-sink-k": ("0", "meshtron's attention has no sink keys; drop --attention-sink-k or give 0"),
    "window-size": (None, "meshtron's attention sees the whole causal context (no sliding window); drop --window-size"),
    "profile-ranks": ("0", "only global rank 0 records a trace; drop --profile-ranks or give 0"),
    "muon-scalar-optimizer": ("adam", "AdamW is the only rule for Muon's non-matrix parameters; drop --muon-scalar-optimizer or give adam"),
}


def noted_flag_lines(noted: list[str]) -> list[str]:
    """One start-up line per noted flag (the first time it was given): ``--flag [value]: what meshtron does``."""
    lines, seen = [], set()
    for given in noted:
        name = given.split()[0].removeprefix("--")
        if name in seen:
            continue
        seen.add(name)
        if name in NOTED_FLAGS:
            lines.append(f"{given}: {NOTED_FLAGS[name][1]}")
        else:  # a translated value: "--flag value -> ours: meaning"
            lines.append(given)
    return lines


def noted_flag_errors(noted: list[str]) -> list[str]:
    """The noted flags whose value meshtron cannot honour, each with what to do."""
    errors = []
    for given in noted:
        name, _, value = given.removeprefix("--").partition(" ")
        if name in NOTED_VALUE_CHOICES and value not in NOTED_VALUE_CHOICES[name]:
            errors.append(f"--{name} {value}: not one of Megatron's values ({' | '.join(NOTED_VALUE_CHOICES[name])})")
        elif (name, value) in REFUSED_NOTED_VALUES:
            errors.append(f"{given}: {REFUSED_NOTED_VALUES[name, value]}")
        elif name in ACCEPTED_ONLY_VALUE and value != ACCEPTED_ONLY_VALUE[name][0]:
            errors.append(f"--{name} {value}: {ACCEPTED_ONLY_VALUE[name][1]}")
    return errors
