"""The decoder's Hugging Face export: which architecture a decoder's config is (GPT-2, Llama,
Mixtral, Qwen, OLMoE, DeepSeek-V2 and V3), its ``config.json`` and its tensors under that architecture's
names. ``decoder_hf_export`` is the decoder family's ``hf_export`` hook; ``hf.py`` runs it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from meshtron.config import Config, ModelConfig
from meshtron.data.tokenizers import saved_tokenizer
from meshtron.errors import CheckpointError
from meshtron.layers.attention import num_kv_heads
from meshtron.layers.mlp import ffn_hidden_size
from meshtron.models.hf_common import export_llama_decoder, llama_hf_config, split_qkv
from meshtron.models.hf_deepseek import deepseek_export, deepseek_hf_config, is_deepseek
from meshtron.models.hf_deepseek_v3 import deepseek_v3_export, deepseek_v3_hf_config, is_deepseek_v3
from meshtron.models.hf_mixtral import mixtral_export, mixtral_hf_config
from meshtron.models.hf_olmoe import is_olmoe, olmoe_export, olmoe_hf_config
from meshtron.models.hf_qwen import QWEN_TYPES, qwen_export, qwen_family, qwen_hf_config


def _is_llama(m: ModelConfig) -> bool:
    return (m.normalization, m.activation, m.position_embedding_type, m.add_bias_linear) == ("RMSNorm", "swiglu", "rope", False)


def _is_gpt2(m: ModelConfig) -> bool:
    shape = (m.normalization, m.activation, m.position_embedding_type, m.add_bias_linear, m.tie_embeddings)
    return shape[0] == "LayerNorm" and shape[1] in ("gelu", "gelu_tanh") and shape[2:] == ("learned_absolute", True, True) and num_kv_heads(m) == m.num_attention_heads


def hf_config_from_model(m: ModelConfig, vocab_size: int, max_positions: int, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for ``LlamaForCausalLM`` / ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` /
    ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``OlmoeForCausalLM`` /
    ``GPT2LMHeadModel`` / ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (transformers 4 and 5 read it)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if m.apply_residual_connection_post_layernorm:
        raise CheckpointError("hf-export: Hugging Face's GPT-2 and Llama are pre-norm; a post-LN decoder "
                              "(--apply-residual-connection-post-layernorm) has no equivalent there")  # fmt: skip
    if m.num_experts and m.moe_router_load_balancing_type == "sinkhorn":
        raise CheckpointError("hf-export: sinkhorn routing (--moe-router-load-balancing-type sinkhorn) is not mapped to a Hugging Face "
                              "router; its inference weights (sigmoid at top-1, the softmax over all experts above) would change")  # fmt: skip
    if m.clip_qkv and not is_olmoe(m):
        raise CheckpointError("hf-export: model.clip_qkv is OLMoE's (with --qk-layernorm and model.qk_layernorm_span full); "
                              "no other Hugging Face family here clamps q, k and v")  # fmt: skip
    if is_deepseek_v3(m):
        return deepseek_v3_hf_config(m, vocab_size, max_positions, dtype_name)
    if is_deepseek(m):
        return deepseek_hf_config(m, vocab_size, max_positions, dtype_name)
    if _is_gpt2(m):
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": m.hidden_size, "n_layer": m.num_layers,
            "n_head": m.num_attention_heads, "n_inner": ffn_hidden_size(m), "n_positions": max_positions,
            "layer_norm_epsilon": m.norm_epsilon, "vocab_size": vocab_size,
            "activation_function": "gelu_new" if m.activation == "gelu_tanh" else "gelu",
            "tie_word_embeddings": True, "torch_dtype": dtype_name,
        }  # fmt: skip
    if not _is_llama(m):
        raise CheckpointError("hf-export writes Llama-style (RMSNorm, SwiGLU, RoPE, no biases) or GPT-2 models only")
    if is_olmoe(m):
        return olmoe_hf_config(m, vocab_size, max_positions, dtype_name)
    if qwen_family(m):
        return qwen_hf_config(m, vocab_size, max_positions, dtype_name)
    if m.num_experts:
        return mixtral_hf_config(m, vocab_size, max_positions, dtype_name)
    if m.add_qkv_bias:
        raise CheckpointError("hf-export: a dense model with --add-qkv-bias (Qwen2) is not implemented; Llama has no q/k/v-only biases")
    return llama_hf_config(m, vocab_size, max_positions, dtype_name)


def gpt2_pairs(m: ModelConfig) -> list[tuple[str, str, bool]]:
    """(HF name, meshtron name, Conv1D-transposed) for every GPT-2 tensor but ``c_attn``'s."""
    pairs = [("wte.weight", "embedding.weight", False), ("wpe.weight", "position_embedding.weight", False),
             ("ln_f.weight", "final_norm.weight", False), ("ln_f.bias", "final_norm.bias", False)]  # fmt: skip
    for i in range(m.num_layers):
        for hf, mt, transposed in (
            ("ln_1", "input_layernorm", False), ("ln_2", "pre_mlp_layernorm", False),
            ("attn.c_proj", "self_attention.linear_proj", True), ("mlp.c_fc", "mlp.linear_fc1", True),
            ("mlp.c_proj", "mlp.linear_fc2", True),
        ):  # fmt: skip
            pairs += [(f"h.{i}.{hf}.weight", f"layers.{i}.{mt}.weight", transposed), (f"h.{i}.{hf}.bias", f"layers.{i}.{mt}.bias", False)]
    return pairs


def _gpt2_export(state: Mapping[str, torch.Tensor], m: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for hf, mt, transposed in gpt2_pairs(m):
        yield f"transformer.{hf}", state[mt].T.contiguous() if transposed else state[mt]
    for i in range(m.num_layers):
        for kind in ("weight", "bias"):
            q, k, v = split_qkv(state[f"layers.{i}.self_attention.linear_qkv.{kind}"], m.num_attention_heads, m.num_attention_heads)
            fused = torch.cat([q, k, v])
            yield f"transformer.h.{i}.attn.c_attn.{kind}", fused.T.contiguous() if kind == "weight" else fused


_EXPORTERS = {"gpt2": _gpt2_export, "llama": export_llama_decoder, "deepseek_v2": deepseek_export, "deepseek_v3": deepseek_v3_export,
              "mixtral": mixtral_export,
              "olmoe": olmoe_export, **dict.fromkeys(QWEN_TYPES, qwen_export)}  # fmt: skip


def _special_ids(load_dir: Path, meta: dict[str, Any], cfg: Config, vocab: int, hf_type: str) -> dict[str, int | None]:
    """``bos_token_id``/``eos_token_id`` of the checkpoint's tokenizer, below ``vocab``, else null:
    left out, transformers would fill in its class defaults (GPT-2's 50256, beyond a smaller
    vocabulary; Llama's 1 and 2, some other tokens). GPT-2 begins and ends with its end of text."""
    saved = meta.get("tokenizer") or {}
    ids: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None}
    if not saved.get("tokenizer_type"):
        return ids
    try:
        tokenizer = saved_tokenizer(load_dir, saved, cfg.data.vocab_extra_ids)
    except (ValueError, OSError) as exc:
        print(f"hf-export: bos_token_id and eos_token_id left null: the checkpoint's tokenizer does not load ({exc})")
        return ids
    bos = tokenizer.bos_id if tokenizer.bos_id is not None or hf_type != "gpt2" else tokenizer.eod
    found = {"bos_token_id": bos, "eos_token_id": tokenizer.eod}
    return {key: i if i is not None and 0 <= i < vocab else None for key, i in found.items()}


def decoder_hf_export(weights: Mapping[str, torch.Tensor], cfg: Config, meta: dict[str, Any], load_dir: Path, dtype: torch.dtype,
                      max_positions: int) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:  # fmt: skip
    """The decoder family's ``hf_export``: its architecture's config.json and tensors. The
    vocabulary keeps every row the checkpoint has (a padded one included: HF models may have more
    rows than their tokenizer, as Llama's do), so the logits are those meshtron computes.
    Multi-token prediction depths go where the architecture has them (DeepSeek-V3); elsewhere
    they are left out, which inference never reads, and the export says so."""
    hf_config = hf_config_from_model(cfg.model, meta["vocab_size"], max_positions, dtype)
    hf_config.update(_special_ids(load_dir, meta, cfg, meta["vocab_size"], hf_config["model_type"]))
    if cfg.model.mtp_num_layers and "num_nextn_predict_layers" not in hf_config:
        print(f"hf-export: {hf_config['architectures'][0]} has no multi-token prediction; its "
              f"{cfg.model.mtp_num_layers} depth(s) (--mtp-num-layers) are left out")  # fmt: skip
    return hf_config, _EXPORTERS[hf_config["model_type"]](weights, cfg.model)
