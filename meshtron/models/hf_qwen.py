"""Qwen to and from Hugging Face: Qwen2-MoE (``Qwen2MoeForCausalLM``, model_type ``qwen2_moe``;
Qwen1.5-MoE, Qwen2-57B-A14B), Qwen3 (``Qwen3ForCausalLM``, ``qwen3``) and Qwen3-MoE
(``Qwen3MoeForCausalLM``, ``qwen3_moe``; Qwen3-30B-A3B, Qwen3-235B-A22B).

Each is Llama (``hf_common``) plus:

* Qwen2-MoE: biases on q, k and v (``--add-qkv-bias``; ``qkv_bias`` in transformers 5, always on in
  the Hub's configs) and one shared expert ``mlp.shared_expert`` of ``shared_expert_intermediate_size``
  whose output is scaled by ``sigmoid(mlp.shared_expert_gate(x))`` (``--moe-shared-expert-gate``).
* Qwen3 and Qwen3-MoE: an RMSNorm over each head's q and k before RoPE (``self_attn.q_norm`` /
  ``k_norm`` [head_dim], ``--qk-layernorm``), a ``head_dim`` of its own, no biases; no shared expert.
* The MoE families' layer ``i`` is MoE unless it is in ``mlp_only_layers`` or ``(i + 1) %
  decoder_sparse_step`` is not 0: written as a ``--moe-layer-freq`` list; dense layers are SwiGLU
  MLPs of ``intermediate_size``. Router ``mlp.gate``: softmax over all experts, top-k, divided by
  their sum only with ``norm_topk_prob`` (meshtron's default routing; without it
  ``--moe-router-pre-softmax``). Experts ``mlp.experts.{e}.{gate,up,down}_proj`` (transformers 5
  fuses them in memory; both read) of ``moe_intermediate_size``. ``router_aux_loss_coef`` maps to
  ``--moe-loss-weight`` as Mixtral's does (``hf_mixtral.py``).
* Sliding-window attention (``use_sliding_window``) is refused: meshtron's attention is full causal.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from meshtron.config import ModelConfig
from meshtron.layers.moe import moe_layer_pattern
from meshtron.layers.moe.experts import expert_ffn_hidden_size
from meshtron.models.hf_common import (
    TensorSource, export_llama_decoder, import_llama_decoder, llama_hf_config, llama_model_config, moe_loss_weight,
    refuse_unexpressible, router_aux_loss_coef, unmapped_routing,
)  # fmt: skip

QWEN_TYPES = {"qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2-MoE"), "qwen3": ("Qwen3ForCausalLM", "Qwen3"),
              "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3-MoE")}  # fmt: skip
SHARED = "shared_expert"


def qwen_family(m: ModelConfig) -> str | None:
    """The Qwen model_type a Llama-shaped ``m`` needs, if only Qwen expresses it: per-head q/k norms
    (Qwen3, with experts Qwen3-MoE), or routed experts with q/k/v biases or a shared expert
    (Qwen2-MoE); None for a plain Llama or Mixtral."""
    if m.qk_layernorm:
        return "qwen3_moe" if m.num_experts else "qwen3"
    if m.num_experts and (m.add_qkv_bias or m.moe_shared_expert_intermediate_size):
        return "qwen2_moe"
    return None


def qwen_model_config(hf: dict[str, Any], source: str) -> ModelConfig:
    """meshtron's shape of a Qwen config.json; what it cannot run raises, naming ``source``."""
    kind = hf["model_type"]
    cfg = llama_model_config(hf, source, {"use_sliding_window": bool}, f"{QWEN_TYPES[kind][1]} (silu, no sliding window)")
    if kind == "qwen2_moe":
        cfg.add_qkv_bias = bool(hf.get("qkv_bias", True))
    else:
        cfg.qk_layernorm = True
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0  # the Hub's name; transformers 5 saves the other
    layers, step, dense = cfg.num_layers, hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    pattern = [i not in dense and (i + 1) % step == 0 for i in range(layers)] if experts and kind != "qwen3" else []
    if not any(pattern):
        return cfg
    k, shared = hf["num_experts_per_tok"], hf.get("shared_expert_intermediate_size") or 0
    cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size = experts, k, hf["moe_intermediate_size"]
    cfg.moe_layer_freq = "1" if all(pattern) else "[" + ",".join(str(int(p)) for p in pattern) + "]"
    cfg.moe_shared_expert_intermediate_size, cfg.moe_shared_expert_gate = shared, bool(shared)
    cfg.moe_router_pre_softmax = not hf.get("norm_topk_prob", False)
    cfg.moe_loss_weight = moe_loss_weight(hf)
    return cfg


def qwen_hf_config(m: ModelConfig, vocab_size: int, max_positions: int, dtype_name: str) -> dict[str, Any]:
    """config.json for ``qwen_family(m)``; refuses what its attention, router and blocks cannot express."""
    kind, shared = qwen_family(m), m.moe_shared_expert_intermediate_size
    architecture, family = QWEN_TYPES[kind]
    problems = {
        "q/k/v-only biases (its attention_bias puts one on the output projection too)": kind != "qwen2_moe" and m.add_qkv_bias,
        "routed experts without a sigmoid-gated shared expert (it always has one)": kind == "qwen2_moe" and not (shared and m.moe_shared_expert_gate),
        "shared experts": kind == "qwen3_moe" and bool(shared),
        "a sigmoid router, expert bias, top-k scaling or group-limited routing": unmapped_routing(m),
    }  # fmt: skip
    refuse_unexpressible(architecture, problems)
    cfg = llama_hf_config(m, vocab_size, max_positions, dtype_name)
    del cfg["mlp_bias"]  # not a Qwen config key
    if kind == "qwen2_moe":
        del cfg["attention_bias"]
    cfg.update({"architectures": [architecture], "model_type": kind, "use_sliding_window": False})
    if kind == "qwen2_moe":
        cfg["qkv_bias"] = m.add_qkv_bias
    if not m.num_experts:
        return cfg
    pattern = moe_layer_pattern(m)
    return {
        **cfg, "num_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk, "moe_intermediate_size": expert_ffn_hidden_size(m),
        **({"shared_expert_intermediate_size": shared} if kind == "qwen2_moe" else {}), "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, moe in enumerate(pattern) if not moe], "norm_topk_prob": not m.moe_router_pre_softmax,
        "router_aux_loss_coef": router_aux_loss_coef(m),
    }  # fmt: skip


def qwen_import(t: TensorSource, m: ModelConfig, vocab: int) -> dict[str, torch.Tensor]:
    """meshtron's state dict from the tensors of a Qwen folder (either expert form)."""
    return import_llama_decoder(t, m, vocab, shared=SHARED)


def qwen_export(state: Mapping[str, torch.Tensor], m: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``qwen_import``, one module per expert (the Hub's form), one layer at a time."""
    return export_llama_decoder(state, m, shared=SHARED)
