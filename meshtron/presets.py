"""Named model shapes (``[model] preset = "llama3-8b"`` or ``--model.preset llama3-8b``).

A preset is a set of dotted config fields applied before the config file and the command line,
so any field can still be overridden. Shapes follow the published models; ``vocab_size`` is set
where the preset implies a tokenizer, and ``data.seq_length`` is the model's training context.
"""

from __future__ import annotations

import re
from typing import Any

from meshtron.errors import ConfigError, unknown_name


def _shape(layers: int, hidden: int, heads: int, kv_heads: int = 0, ffn: int = 0) -> dict[str, Any]:
    return {
        "model.num_layers": layers,
        "model.hidden_size": hidden,
        "model.num_attention_heads": heads,
        "model.num_query_groups": kv_heads,
        "model.ffn_hidden_size": ffn,
    }


_GPT = {
    "model.normalization": "LayerNorm",
    "model.norm_epsilon": 1e-5,
    "model.activation": "gelu",
    "model.position_embedding_type": "learned_absolute",
    "model.add_bias_linear": True,
    "model.tie_embeddings": True,
}
_GPT2 = {**_GPT, "model.vocab_size": 50257, "model.max_position_embeddings": 1024, "data.seq_length": 1024}

_LLAMA = {
    "model.normalization": "RMSNorm",
    "model.norm_epsilon": 1e-5,
    "model.activation": "swiglu",
    "model.position_embedding_type": "rope",
    "model.rope_scaling": "",
    "model.add_bias_linear": False,
    "model.tie_embeddings": False,
}
_LLAMA2 = {**_LLAMA, "model.rotary_base": 10000.0, "model.vocab_size": 32000, "data.seq_length": 4096}
_LLAMA3 = {**_LLAMA, "model.rotary_base": 500000.0, "model.vocab_size": 128256, "data.seq_length": 8192}
_LLAMA3_1 = {
    **_LLAMA3,
    "model.rope_scaling": "llama3",
    "model.rope_scaling_factor": 8.0,
    "model.rope_low_freq_factor": 1.0,
    "model.rope_high_freq_factor": 4.0,
    "model.rope_original_max_position_embeddings": 8192,
}
_LLAMA3_2 = {**_LLAMA3_1, "model.rope_scaling_factor": 32.0, "model.tie_embeddings": True}

# Megatron's BERT (pretrain_bert.py): pre-LN blocks, GELU, learned positions, tied LM head, 512
# positions; the vocabulary comes from the WordPiece vocab.txt.
_BERT = {**_GPT, "model.model_type": "bert", "model.max_position_embeddings": 512, "data.seq_length": 512}
# Megatron's T5 (pretrain_t5.py, examples/t5/train_t5_220m_distributed.sh): the same blocks, --num-layers
# encoder and as many decoder blocks, encoder 512 / decoder 128 tokens, 100 sentinels.
_T5 = {**_BERT, "model.model_type": "t5", "data.decoder_seq_length": 128, "data.vocab_extra_ids": 100}
# Megatron's ICT retriever (examples/pretrain_ict.sh, the "217M" bi-encoder): two BERT-base towers,
# 128-wide embeddings (the ORQA paper's), scaled scores, 256-token blocks.
_ICT = {**_BERT, "model.model_type": "ict", "model.biencoder_projection_dim": 128, "model.retriever_score_scaling": True,
        "model.retriever_report_topk_accuracies": [1, 5, 20], "data.seq_length": 256}  # fmt: skip
# DeepSeek-V2 (MLA + MoE). Numbers from the Hugging Face config.json of deepseek-ai/DeepSeek-V2
# (revision 3d445e7) and DeepSeek-Coder-V2-Lite-Base (the V2-Lite architecture), cross-checked with
# Megatron-LM's DeepSeek-V2-Lite example flags (../shared/research/moe.md section 1): RMSNorm 1e-6,
# rope theta 10000 with YaRN (factor 40 over 4096 positions, beta 32/1, mscale 0.707/0.707, 163840
# positions), latent norms (Megatron's --qk-layernorm), softmax over all experts then top-6 without
# renormalization (HF norm_topk_prob false = --moe-router-pre-softmax), sequence-wise balancing with
# aux_loss_alpha 0.001, layer 0 dense (first_k_dense_replace 1), shared experts n_shared x moe width.
_DEEPSEEK_V2 = {
    **_LLAMA,
    "model.norm_epsilon": 1e-6,
    "model.rotary_base": 10000.0,
    "model.vocab_size": 102400,
    "model.max_position_embeddings": 163840,
    "model.multi_latent_attention": True,
    "model.qk_layernorm": True,
    "model.kv_lora_rank": 512,
    "model.qk_head_dim": 128,
    "model.qk_pos_emb_head_dim": 64,
    "model.v_head_dim": 128,
    "model.rope_scaling": "yarn",
    "model.rope_scaling_factor": 40.0,
    "model.rope_original_max_position_embeddings": 4096,
    "model.rope_beta_fast": 32.0,
    "model.rope_beta_slow": 1.0,
    "model.rope_mscale": 0.707,
    "model.rope_mscale_all_dim": 0.707,
    "model.moe_router_topk": 6,
    "model.moe_router_score_function": "softmax",
    "model.moe_router_pre_softmax": True,
    "model.moe_router_load_balancing_type": "seq_aux_loss",
    "model.moe_aux_loss_coeff": 1e-3,
    "data.seq_length": 4096,
}


# Mixtral 8x7B (HF mistralai/Mixtral-8x7B-v0.1 config.json): Llama blocks whose every MLP is 8
# SwiGLU experts of 14336, top-2 with the two chosen weights renormalized (meshtron's default
# top-k-then-softmax routing), rope theta 1e6, 32k context; router_aux_loss_coef 0.02 becomes the
# layer-averaged --moe-loss-weight 0.02 x k (see models/hf_mixtral.py).
_MIXTRAL = {
    **_LLAMA,
    "model.rotary_base": 1e6,
    "model.vocab_size": 32000,
    "model.max_position_embeddings": 32768,
    "model.num_experts": 8,
    "model.moe_router_topk": 2,
    "model.moe_layer_freq": "1",
    "model.moe_loss_weight": 0.04,
    "data.seq_length": 32768,
}


# Qwen3-MoE (HF Qwen/Qwen3-30B-A3B config.json): Llama blocks with per-head q and k RMSNorms
# (--qk-layernorm), head_dim 128, every MLP 128 experts of 768, top-8 renormalized (meshtron's
# default routing: norm_topk_prob true), no shared expert, rope theta 1e6, 40k context (32k trained);
# router_aux_loss_coef 0.001 as the layer-averaged --moe-loss-weight 0.001 x k (see models/hf_qwen.py).
_QWEN3_MOE = {
    **_LLAMA,
    "model.norm_epsilon": 1e-6,
    "model.rotary_base": 1e6,
    "model.vocab_size": 151936,
    "model.max_position_embeddings": 40960,
    "model.kv_channels": 128,
    "model.qk_layernorm": True,
    "model.num_experts": 128,
    "model.moe_router_topk": 8,
    "model.moe_ffn_hidden_size": 768,
    "model.moe_layer_freq": "1",
    "model.moe_loss_weight": 0.008,
    "data.seq_length": 32768,
}


# OLMoE-1B-7B (HF allenai/OLMoE-1B-7B-0924 config.json; transformers' OlmoeConfig defaults): Llama
# blocks whose q and k RMSNorms span the whole projections (--qk-layernorm, span full), every MLP 64
# experts of 1024, softmax over all then top-8 not renormalized (norm_topk_prob false:
# --moe-router-pre-softmax), MHA, rope theta 10000, 4k context; router_aux_loss_coef 0.01 as the
# layer-averaged --moe-loss-weight 0.01 x k (see models/hf_olmoe.py).
_OLMOE = {
    **_LLAMA,
    "model.rotary_base": 10000.0,
    "model.vocab_size": 50304,
    "model.max_position_embeddings": 4096,
    "model.qk_layernorm": True,
    "model.qk_layernorm_span": "full",
    "model.num_experts": 64,
    "model.moe_router_topk": 8,
    "model.moe_ffn_hidden_size": 1024,
    "model.moe_layer_freq": "1",
    "model.moe_router_pre_softmax": True,
    "model.moe_loss_weight": 0.08,
    "data.seq_length": 4096,
}


def _leading_dense(dense: int, layers: int) -> str:
    """``--moe-layer-freq`` for ``dense`` dense layers, then MoE ones (DeepSeek's first_k_dense_replace)."""
    return f"([0]*{dense}+[1]*{layers - dense})"


_LEADING_DENSE = re.compile(r"\(\[0\]\*(\d+)\+\[1\]\*\d+\)")


def _deepseek(layers: int, hidden: int, heads: int, ffn: int, experts: int, expert_ffn: int, **fields: Any) -> dict[str, Any]:
    return {
        **_DEEPSEEK_V2,
        **_shape(layers, hidden, heads, ffn=ffn),
        "model.num_experts": experts,
        "model.moe_ffn_hidden_size": expert_ffn,
        "model.moe_shared_expert_intermediate_size": 2 * expert_ffn,  # n_shared_experts 2
        "model.moe_layer_freq": _leading_dense(1, layers),
        **{f"model.{k}": v for k, v in fields.items()},
    }


# DeepSeek-V3 (671 B, 37 B active): V2's blocks with one shared expert, a sigmoid router with the
# auxiliary-loss-free expert bias choosing 8 of 256 experts from the best 4 of 8 groups (HF noaux_tc:
# a group scores its best two, Megatron's sum_topk at 8 / 4), the chosen weights renormalized and
# times 2.5, the first 3 layers dense, YaRN with mscale 1 / 1, and one multi-token prediction depth.
# Numbers from the Hugging Face config.json of deepseek-ai/DeepSeek-V3; the training choices HF does
# not record are the paper's (arXiv 2412.19437): the sequence-wise balance loss at 1e-4 beside the
# bias, fp32 routing.
def _deepseek_v3(layers: int, hidden: int, heads: int, ffn: int, experts: int, expert_ffn: int, dense: int, **fields: Any) -> dict[str, Any]:
    return {
        **_deepseek(layers, hidden, heads, ffn, experts, expert_ffn),
        "model.moe_shared_expert_intermediate_size": expert_ffn,  # n_shared_experts 1
        "model.moe_layer_freq": _leading_dense(dense, layers),
        "model.rope_mscale": 1.0,
        "model.rope_mscale_all_dim": 1.0,
        "model.moe_router_score_function": "sigmoid",
        "model.moe_router_pre_softmax": False,
        "model.moe_router_enable_expert_bias": True,
        "model.moe_router_group_score": "sum_topk",
        "model.moe_router_dtype": "fp32",
        "model.moe_aux_loss_coeff": 1e-4,
        "model.mtp_num_layers": 1,
        **{f"model.{k}": v for k, v in fields.items()},
    }


PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-124m": {**_GPT2, **_shape(12, 768, 12)},
    "gpt2-355m": {**_GPT2, **_shape(24, 1024, 16)},
    "gpt2-774m": {**_GPT2, **_shape(36, 1280, 20)},
    "gpt2-1.5b": {**_GPT2, **_shape(48, 1600, 25)},
    "llama2-7b": {**_LLAMA2, **_shape(32, 4096, 32, ffn=11008)},
    "llama2-13b": {**_LLAMA2, **_shape(40, 5120, 40, ffn=13824)},
    "llama2-70b": {**_LLAMA2, **_shape(80, 8192, 64, kv_heads=8, ffn=28672)},
    "llama3-8b": {**_LLAMA3, **_shape(32, 4096, 32, kv_heads=8, ffn=14336)},
    "llama3-70b": {**_LLAMA3, **_shape(80, 8192, 64, kv_heads=8, ffn=28672)},
    "llama3.1-8b": {**_LLAMA3_1, **_shape(32, 4096, 32, kv_heads=8, ffn=14336)},
    "llama3.1-70b": {**_LLAMA3_1, **_shape(80, 8192, 64, kv_heads=8, ffn=28672)},
    "llama3.1-405b": {**_LLAMA3_1, **_shape(126, 16384, 128, kv_heads=8, ffn=53248)},
    "llama3.2-1b": {**_LLAMA3_2, **_shape(16, 2048, 32, kv_heads=8, ffn=8192)},
    "llama3.2-3b": {**_LLAMA3_2, **_shape(28, 3072, 24, kv_heads=8, ffn=8192)},
    # The shape benchmarked against peers: Llama 3.2 1B's body at a 4k context, no rope scaling.
    "llama-1.24b-bench": {
        **_LLAMA3,
        **_shape(16, 2048, 32, kv_heads=8, ffn=8192),
        "model.tie_embeddings": True,
        "data.seq_length": 4096,
    },
    "mixtral-8x7b": {**_MIXTRAL, **_shape(32, 4096, 32, kv_heads=8, ffn=14336), "model.moe_ffn_hidden_size": 14336},
    "deepseek-v2-lite": _deepseek(27, 2048, 16, 10944, 64, 1408),
    "qwen3-30b-a3b": {**_QWEN3_MOE, **_shape(48, 2048, 32, kv_heads=4, ffn=6144)},
    "olmoe-1b-7b": {**_OLMOE, **_shape(16, 2048, 16, kv_heads=16, ffn=1024)},
    # V2's router is group-limited (HF topk_method group_limited_greedy): 8 groups of 20 experts, a
    # token's top-6 from the 3 groups whose best expert scores highest, weights times
    # routed_scaling_factor 16.
    "deepseek-v2": _deepseek(60, 5120, 128, 12288, 160, 1536, q_lora_rank=1536, moe_router_num_groups=8,
                             moe_router_group_topk=3, moe_router_group_score="max", moe_router_topk_scaling_factor=16.0),  # fmt: skip
    "deepseek-v3": {
        **_deepseek_v3(61, 7168, 128, 18432, 256, 2048, dense=3, q_lora_rank=1536, moe_router_topk=8, moe_router_num_groups=8,
                       moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5),
        "model.vocab_size": 129280,
    },
    # Tiny shapes for tests and CPU smoke runs; the vocabulary comes from the tokenizer.
    "tiny-gpt": {**_GPT, **_shape(2, 64, 4), "data.seq_length": 64},
    "tiny-llama": {**_LLAMA, **_shape(2, 64, 4, kv_heads=2), "data.seq_length": 64},
    "tiny-mixtral": {
        **_MIXTRAL,
        **_shape(2, 64, 4, kv_heads=2, ffn=128),
        "model.moe_ffn_hidden_size": 128,
        "model.num_experts": 4,
        "model.max_position_embeddings": 256,
        "model.vocab_size": 0,
        "data.seq_length": 64,
    },
    "bert-base": {**_BERT, **_shape(12, 768, 12)},
    "bert-large": {**_BERT, **_shape(24, 1024, 16)},
    "tiny-bert": {**_BERT, **_shape(2, 64, 4), "model.max_position_embeddings": 64, "data.seq_length": 64},
    "t5-base": {**_T5, **_shape(12, 768, 12, ffn=3072), "model.kv_channels": 64},  # 220M
    "t5-large": {**_T5, **_shape(24, 1024, 16, ffn=4096), "model.kv_channels": 64},
    "tiny-t5": {**_T5, **_shape(2, 64, 4), "model.max_position_embeddings": 64, "data.seq_length": 64, "data.decoder_seq_length": 32},
    "ict-base": {**_ICT, **_shape(12, 768, 12)},
    "tiny-ict": {**_ICT, **_shape(2, 64, 4), "model.biencoder_projection_dim": 32, "model.max_position_embeddings": 64, "data.seq_length": 64},
    "tiny-deepseek": {
        **_deepseek(4, 64, 4, 128, 4, 32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                    moe_router_topk=2, rope_original_max_position_embeddings=16, max_position_embeddings=256),
        "model.vocab_size": 0,
        "data.seq_length": 64,
    },
    # DeepSeek-V3's routing at a tiny size: 8 experts in 4 groups, top-4 from the best 2 groups (two per group, as V3's 8 / 4).
    "tiny-deepseek-v3": {
        **_deepseek_v3(4, 64, 4, 128, 8, 32, dense=1, q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
                       v_head_dim=16, moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                       moe_router_topk_scaling_factor=2.5, rope_original_max_position_embeddings=16, max_position_embeddings=256),
        "model.vocab_size": 0,
        "data.seq_length": 64,
    },
}


def preset_fields(name: str, num_layers: int | None = None) -> dict[str, Any]:
    """The dotted config fields of preset ``name`` (a copy, safe to modify). ``num_layers``: the
    user's layer count, where given without a pattern of their own: a preset whose first layers are
    dense keeps that many dense layers and makes the rest MoE (``--num-layers 4`` of DeepSeek-V2-Lite
    runs one dense and three MoE layers; its 27-layer pattern would be refused)."""
    if name not in PRESETS:
        raise ConfigError(unknown_name("model preset", name, list(PRESETS)))
    fields = dict(PRESETS[name])
    leading = _LEADING_DENSE.fullmatch(str(fields.get("model.moe_layer_freq", "")))
    if num_layers and leading:
        dense = int(leading.group(1))
        if num_layers <= dense:
            raise ConfigError(f"--num-layers {num_layers} leaves no MoE layer after preset {name}'s {dense} dense layers: "
                              f"give more than {dense} layers, or your own --moe-layer-freq")  # fmt: skip
        fields["model.moe_layer_freq"] = _leading_dense(dense, num_layers)
    return fields
