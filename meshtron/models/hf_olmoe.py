"""OLMoE (``OlmoeForCausalLM``, model_type ``olmoe``; allenai/OLMoE-1B-7B-0924) to and from Hugging Face.

OLMoE is Llama (``hf_common``: GQA attention, RMSNorm, RoPE, untied output) whose every MLP is a
mixture of ``num_experts`` SwiGLU experts of width ``intermediate_size``, plus:

* q and k RMSNorms over the whole projections, before the head split and RoPE:
  ``self_attn.q_norm`` [heads x d] and ``k_norm`` [kv heads x d] -> ``--qk-layernorm`` with
  ``model.qk_layernorm_span full``. Its config has no ``head_dim`` (d = hidden / heads): export
  refuses another ``--kv-channels``.
* ``clip_qkv`` (None in the released model) -> ``model.clip_qkv``: q, k and v clamped after the norms.
* Router ``mlp.gate``: softmax over all experts, top-k, divided by their sum only with
  ``norm_topk_prob`` (meshtron's default routing; without it, the released model's,
  ``--moe-router-pre-softmax``). Experts ``mlp.experts.{e}.{gate,up,down}_proj`` (transformers 5
  fuses them in memory; both read). ``router_aux_loss_coef`` maps to ``--moe-loss-weight`` as
  Mixtral's does (``hf_mixtral.py``); OLMoE's training-time router z-loss is not in its config.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from meshtron.config import ModelConfig
from meshtron.layers.attention import head_dim
from meshtron.layers.moe import moe_layer_pattern
from meshtron.layers.moe.experts import expert_ffn_hidden_size
from meshtron.models.hf_common import (
    TensorSource, export_llama_decoder, import_llama_decoder, llama_hf_config, llama_model_config, moe_loss_weight,
    refuse_unexpressible, router_aux_loss_coef, unmapped_routing,
)  # fmt: skip


def is_olmoe(m: ModelConfig) -> bool:
    """Whether a Llama-shaped ``m`` needs OLMoE's attention: q and k normed over their whole width."""
    return m.qk_layernorm and m.qk_layernorm_span == "full"


def olmoe_model_config(hf: dict[str, Any], source: str) -> ModelConfig:
    """meshtron's shape of an ``olmoe`` config.json; what it cannot run raises, naming ``source``."""
    cfg = llama_model_config(hf, source, {}, "OLMoE (silu, no biases)")
    cfg.qk_layernorm, cfg.qk_layernorm_span, cfg.clip_qkv = True, "full", float(hf.get("clip_qkv") or 0.0)
    cfg.num_experts = hf.get("num_experts") or hf["num_local_experts"]
    cfg.moe_router_topk, cfg.moe_ffn_hidden_size = hf["num_experts_per_tok"], hf["intermediate_size"]
    cfg.moe_router_pre_softmax = not hf.get("norm_topk_prob", False)
    cfg.moe_loss_weight = moe_loss_weight(hf)
    return cfg


def olmoe_hf_config(m: ModelConfig, vocab_size: int, max_positions: int, dtype_name: str) -> dict[str, Any]:
    """config.json for ``OlmoeForCausalLM``; refuses what its attention, router and blocks cannot express."""
    problems = {
        "dense layers (every MLP is a mixture of experts: --num-experts, --moe-layer-freq 1)": not m.num_experts or not all(moe_layer_pattern(m)),
        "shared experts": bool(m.moe_shared_expert_intermediate_size),
        "a sigmoid router, expert bias, top-k scaling or group-limited routing": unmapped_routing(m),
        f"a head dim other than hidden / heads (--kv-channels {m.kv_channels}; its q norm is hidden_size wide)":
            head_dim(m) * m.num_attention_heads != m.hidden_size,
    }  # fmt: skip
    refuse_unexpressible("OlmoeForCausalLM", problems)
    cfg = llama_hf_config(m, vocab_size, max_positions, dtype_name)
    for key in ("mlp_bias", "head_dim"):  # not OLMoE config keys
        del cfg[key]
    return {
        **cfg, "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "intermediate_size": expert_ffn_hidden_size(m),
        "num_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk, "norm_topk_prob": not m.moe_router_pre_softmax,
        "router_aux_loss_coef": router_aux_loss_coef(m), "clip_qkv": m.clip_qkv or None,
    }  # fmt: skip


def olmoe_import(t: TensorSource, m: ModelConfig, vocab: int) -> dict[str, torch.Tensor]:
    """meshtron's state dict from the tensors of an ``olmoe`` folder (either expert form)."""
    return import_llama_decoder(t, m, vocab)


def olmoe_export(state: Mapping[str, torch.Tensor], m: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``olmoe_import``, one module per expert (the Hub's form), one layer at a time."""
    return export_llama_decoder(state, m)
