"""The model section of the run's config (``--model.*``): the shape and features of the network.

Its own module so that ``config.py`` (the whole config, its parsing and validation) stays readable;
``meshtron.config`` re-exports ``ModelConfig`` and every caller imports it from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """Shape of a decoder. ``preset`` fills defaults; explicit fields win."""

    preset: str = ""  # named model shape whose fields become the defaults (meshtron/presets.py)
    num_layers: int = 4  # transformer blocks
    hidden_size: int = 128  # width of the residual stream
    ffn_hidden_size: int = 0  # 0: 4*hidden (gelu) or Llama's 8/3 rule (swiglu)
    num_attention_heads: int = 4  # query heads per layer
    num_query_groups: int = 0  # kv heads; 0: same as attention heads (no GQA)
    kv_channels: int = 0  # head dim; 0: hidden / heads
    vocab_size: int = 0  # 0: taken from the tokenizer (padded, see below)
    make_vocab_size_divisible_by: int = 128  # pad the vocabulary to a multiple of this x tp
    max_position_embeddings: int = 0  # 0: seq_length
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    norm_epsilon: float = 1e-5  # epsilon of every LayerNorm/RMSNorm
    activation: str = "gelu"  # gelu | gelu_tanh | swiglu
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope | relative (T5's buckets)
    relative_attention_num_buckets: int = 32  # relative: distance buckets of each stack's table
    relative_attention_max_distance: int = 128  # relative: distances beyond this share the last bucket
    rotary_base: float = 10000.0  # RoPE theta
    rotary_percent: float = 1.0  # share of each head's dims RoPE rotates (Megatron's); only 1.0 is implemented
    rope_scaling: str = ""  # "" | llama3
    rope_scaling_factor: float = 8.0  # llama3/YaRN: context extension factor
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths above original/this are scaled fully
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original/this are kept
    rope_original_max_position_embeddings: int = 8192  # llama3/YaRN: the context the model was trained with
    add_bias_linear: bool = True  # biases in the blocks' linear layers
    add_qkv_bias: bool = False  # biases on the query/key/value projection only (Qwen2); add_bias_linear implies them
    tie_embeddings: bool = True  # the output layer shares the input embedding's weights
    attention_dropout: float = 0.0  # dropout on attention probabilities
    hidden_dropout: float = 0.0  # dropout on each block's attention and MLP outputs
    init_method_std: float = 0.02  # standard deviation of the normal weight init
    attention_backend: str = "auto"  # auto | sdpa | cudnn | flash | efficient | math
    fused_kernels: str = "auto"  # auto (Triton on a GPU where installed) | on | off (PyTorch references, unfused loss)
    # Off by default: on one H200 at BERT-large's 16384-token micro batch the Triton kernels of these
    # two fusions run slower than PyTorch's eager ops (bias + GELU 0.431 against 0.256 ms, dropout +
    # add 0.215 against 0.099 ms; B8 172 k against 186 k tokens/s, benchmarks/RESULTS.md).
    bias_gelu_fusion: bool = False  # --bias-gelu-fusion: the MLP's fc1 bias + GELU in one Triton kernel, the bias gradient summed in its backward (eager, under --fused-kernels)
    bias_dropout_fusion: bool = False  # --bias-dropout-fusion: each block's residual dropout + add in one Triton pass, its mask recomputed in backward (under --fused-kernels)
    cross_entropy_loss_fusion: bool = True  # masked-sum loss with output gradients in its forward: 3 logits GEMMs, not 4 (off under --no-fused-kernels)
    recompute_granularity: str = ""  # "" | selective (core attention) | full (whole layers)
    recompute_method: str = "uniform"  # full: uniform (groups of N layers) | block (first N layers)
    recompute_num_layers: int = 1  # full recompute: layers per group (uniform) or layers recomputed (block)
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])  # selective: core_attn, moe recomputed; other Megatron names kept
    fp8_format: str = ""  # "" (off) | hybrid (e4m3 forward, e5m2 gradients) | e4m3: the blocks' linears in FP8
    fp8_backend: str = "auto"  # auto (torchao when installed and usable) | torchao | meshtron
    fp8_recipe: str = "delayed"  # delayed (amax history) | tensorwise (current amax) | rowwise (per-row scales, all e4m3) | blockwise (1x128 / 128x128 scales, e4m3)
    fp8_amax_history_len: int = 1  # delayed: amaxes kept per tensor (Megatron's default 1)
    fp8_amax_compute_algo: str = "most_recent"  # delayed: most_recent | max of the history
    fp8_margin: int = 0  # delayed: scale = fmax / amax / 2**margin
    fp8_output_layer: bool = False  # --fp8-output-layer: the output layer's three logits GEMMs in FP8 too, inside the fused masked-sum loss (training; recipe delayed or tensorwise; a head with a bias stays bf16); opt-in: Megatron keeps it bf16
    # Mixture of experts (meshtron/layers/moe/; checks in moe_config_errors). Names are Megatron-Core's.
    num_experts: int = 0  # routed experts per MoE layer; 0: dense MLPs only
    moe_router_topk: int = 2  # experts each token is sent to
    moe_ffn_hidden_size: int = 0  # per expert; 0: ffn_hidden_size
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss (switch/GShard) | seq_aux_loss (DeepSeek) | sinkhorn (Megatron's balanced plan, no aux loss) | none
    moe_aux_loss_coeff: float = 0.0  # per MoE layer; the layers' losses add up (Megatron-Core's scale)
    moe_loss_weight: float = 0.0  # MegaBlocks' scale: the same loss averaged over the MoE layers; set one of the two
    moe_z_loss_coeff: float = 0.0  # router z-loss coefficient (0: off)
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False  # softmax over all experts, then top-k (weights not renormalized)
    moe_router_topk_scaling_factor: float = 1.0  # multiplies the top-k routing weights
    moe_router_num_groups: int = 0  # group-limited routing: experts in this many groups; 0: off
    moe_router_group_topk: int = 0  # groups a token may use
    moe_router_group_score: str = "sum_topk"  # sum_topk (group's best k/group_topk summed; Megatron) | max (its best; DeepSeek-V2)
    moe_router_dtype: str = ""  # "" (input dtype) | fp32 | fp64: router logits, weights and combine
    moe_router_enable_expert_bias: bool = False  # DeepSeek-V3 auxiliary-loss-free balancing (sigmoid)
    moe_router_bias_update_rate: float = 1e-3  # expert-bias step per iteration (with the expert bias)
    moe_jitter_eps: float = 0.0  # multiplies the router input by U(1-eps, 1+eps) in training
    moe_layer_recompute: bool = False  # keep only each MoE layer's input; rerun the layer (collectives too) in backward
    moe_router_force_load_balancing: bool = False  # benchmarks only: random router logits (gradient passed straight through)
    moe_router_topk_limited_devices: int = 0  # Megatron's older device-limited routing: groups = ep ranks, this many per token
    moe_expert_capacity_factor: float = 0.0  # 0: dropless; else tokens beyond ceil(T*k/E*factor) per expert dropped
    moe_token_drop_policy: str = "probs"  # probs (lowest weight dropped) | position (latest position dropped)
    moe_pad_expert_input_to_capacity: bool = False  # every expert computes exactly capacity rows
    moe_shared_expert_intermediate_size: int = 0  # 0: no shared experts
    moe_shared_expert_gate: bool = False  # scale the shared experts' output by sigmoid(gate(x))
    moe_layer_freq: str = "1"  # N: every N-th layer (from 0) is MoE; or a list like ([0]+[1]*26)
    moe_grouped_gemm: str = "auto"  # auto | loop (per-expert reference) | torch (torch._grouped_mm) | triton (our kernels)
    moe_fp8: str = "off"  # under --fp8-format the routed experts' grouped GEMMs: rowwise (FP8, per-row scales) | off (bf16)
    # DeepSeek-V2 multi-head latent attention (meshtron/layers/mla.py; checked by mla_config_errors there)
    # and YaRN (rope_scaling "yarn", which also reads rope_scaling_factor and
    # rope_original_max_position_embeddings). Head dims use Megatron's names; HF's in comments.
    multi_latent_attention: bool = False  # DeepSeek-V2 multi-head latent attention instead of GQA
    q_lora_rank: int = 0  # 0: full query projection (V2-Lite); else its low rank, with a norm (V2: 1536)
    kv_lora_rank: int = 512  # width of the joint key/value latent (Megatron's default is 32)
    qk_head_dim: int = 128  # per-head query/key dims without RoPE (HF qk_nope_head_dim)
    qk_pos_emb_head_dim: int = 64  # per-head query dims with RoPE, and the one shared RoPE key (HF qk_rope_head_dim)
    v_head_dim: int = 128  # MLA: per-head value dims
    qk_layernorm: bool = False  # norm each head's q and k (standard attention; Qwen3) or MLA's q and kv latents (DeepSeek)
    qk_layernorm_span: str = "head"  # standard attention's --qk-layernorm: head (one RMSNorm/LayerNorm per head's q, k; Qwen3) | full (one RMSNorm over all heads' q, one over all k; OLMoE)
    clip_qkv: float = 0.0  # standard attention: clamp q, k, v to [-clip, clip] after the q/k norms (OLMo's clip_qkv); 0: off
    rope_beta_fast: float = 32.0  # YaRN: fast-rotating boundary (rotations per context)
    rope_beta_slow: float = 1.0  # YaRN: slow-rotating boundary
    rope_mscale: float = 1.0  # YaRN: attention temperature scale
    rope_mscale_all_dim: float = 0.0  # YaRN: temperature scale applied to all dims (DeepSeek)
    # Model families: model_type names a registered family (meshtron.models.registry; Megatron users
    # pick the pretrain_*.py script, we pick the type), or package.module:name for one registered by that module.
    model_type: str = "gpt"  # gpt (the decoder: GPT, Llama, MoE) | bert | t5 | ict (the retriever of models/ict.py)
    apply_residual_connection_post_layernorm: bool = False  # residuals from the norms' outputs: post-LN (HF BERT)
    bert_binary_head: bool = True  # BERT's sentence-order head and token types (--bert-no-binary-head drops them)
    bert_tokentypes: int = 0  # BERT's token-type rows; 0: 2 with the binary head, else none (Megatron's); HF's type_vocab_size
    encoder_num_layers: int = 0  # T5's encoder blocks; 0: num_layers (Megatron's rule)
    decoder_num_layers: int = 0  # T5's decoder blocks; 0: num_layers
    biencoder_projection_dim: int = 0  # ICT: [CLS] states projected to this width (0: the hidden state itself)
    biencoder_shared_query_context_model: bool = False  # ICT: one tower encodes queries and contexts
    retriever_score_scaling: bool = False  # ICT: scores divided by sqrt(hidden size)
    retriever_report_topk_accuracies: list[int] = field(default_factory=list)  # ICT: in-batch top-k accuracies logged
    # Expert parallelism (meshtron/parallel/expert_parallel.py). alltoall is the default here, unlike
    # Megatron's allgather: both compute the same, and alltoall moves ep times fewer rows.
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather
    overlap_moe_expert_parallel_comm: bool = False  # alltoall's exchange in chunks of local experts, each chunk's all-to-all in flight while another chunk's experts compute (forward and backward)
    moe_ep_overlap_chunks: int = 2  # chunks of local experts under --overlap-moe-expert-parallel-comm (2 to the experts per ep rank)
    # Flags of the ROCm fork's launch scripts (issue 14); checks in meshtron.validation.dropin_errors.
    extra_vocab_size: int = 0  # rows added after the tokenizer's vocabulary, before padding (PAI-Megatron's)
    moe_num_shared_experts: int = 0  # PAI-Megatron's shared-expert count: the shared MLP is this x moe_ffn_hidden_size wide
    # Multi-token prediction (DeepSeek-V3; models/mtp.py), Megatron-Core's names.
    mtp_num_layers: int = 0  # depths predicted beyond the next token, one block each after the last; 0: off
    mtp_loss_scaling_factor: float = 0.1  # the depths' mean loss enters the objective times this
