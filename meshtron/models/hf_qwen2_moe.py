"""Qwen2-MoE (``Qwen2MoeForCausalLM``, model_type ``qwen2_moe``; Qwen1.5-MoE, Qwen2-57B-A14B) to
and from Hugging Face.

Llama (``hf_common``) with biases on q, k and v (``--add-qkv-bias``; ``qkv_bias`` in transformers
5, always on in the Hub's configs) and mixture-of-experts MLPs:

* Layer ``i`` is MoE unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step`` is not
  0: written as a ``--moe-layer-freq`` list; dense layers are SwiGLU MLPs of ``intermediate_size``.
* Router ``mlp.gate``: softmax over all experts, top-k, divided by their sum only with
  ``norm_topk_prob`` (meshtron's default routing; without it ``--moe-router-pre-softmax``).
* Experts ``mlp.experts.{e}.{gate,up,down}_proj`` (transformers 5 fuses them in memory; both read)
  of ``moe_intermediate_size``; one shared expert ``mlp.shared_expert`` of
  ``shared_expert_intermediate_size`` whose output is scaled by ``sigmoid(mlp.shared_expert_gate(x))``
  (``--moe-shared-expert-gate``).
* ``router_aux_loss_coef`` maps to ``--moe-loss-weight`` as Mixtral's does (``hf_mixtral.py``).
* Sliding-window attention (``use_sliding_window``) is refused: meshtron's attention is full causal.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from meshtron.checkpoint.checkpoint import CheckpointError
from meshtron.config import ModelConfig
from meshtron.layers.mlp import ffn_hidden_size
from meshtron.layers.moe import moe_layer_pattern
from meshtron.layers.moe.balancing import aux_loss_coeff
from meshtron.layers.moe.experts import expert_ffn_hidden_size
from meshtron.models.hf_common import (
    TensorSource, export_body, export_llama_attention, export_moe_mlp, export_swiglu, import_body, import_llama_attention,
    import_moe_mlp, import_swiglu, llama_hf_config, llama_model_config,
)  # fmt: skip

SHARED = "shared_expert"


def is_qwen2_moe(m: ModelConfig) -> bool:
    """A Llama-shaped MoE that only Qwen2-MoE expresses: q/k/v biases or a shared expert."""
    return bool(m.num_experts) and (m.add_qkv_bias or bool(m.moe_shared_expert_intermediate_size))


def qwen2_moe_model_config(hf: dict[str, Any], source: str) -> ModelConfig:
    """meshtron's shape of a ``qwen2_moe`` config.json; what it cannot run raises, naming ``source``."""
    cfg = llama_model_config(hf, source, {"use_sliding_window": bool}, "Qwen2-MoE (silu, no sliding window)")
    cfg.add_qkv_bias = bool(hf.get("qkv_bias", True))
    layers, step, dense = cfg.num_layers, hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    pattern = [i not in dense and (i + 1) % step == 0 for i in range(layers)] if hf.get("num_experts") else []
    if not any(pattern):
        return cfg
    k, shared = hf["num_experts_per_tok"], hf.get("shared_expert_intermediate_size") or 0
    cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size = hf["num_experts"], k, hf["moe_intermediate_size"]
    cfg.moe_layer_freq = "1" if all(pattern) else "[" + ",".join(str(int(p)) for p in pattern) + "]"
    cfg.moe_shared_expert_intermediate_size, cfg.moe_shared_expert_gate = shared, bool(shared)
    cfg.moe_router_pre_softmax = not hf.get("norm_topk_prob", False)
    cfg.moe_loss_weight = float(hf.get("router_aux_loss_coef", 0.0)) * k
    return cfg


def qwen2_moe_hf_config(m: ModelConfig, vocab_size: int, max_positions: int, dtype_name: str) -> dict[str, Any]:
    """config.json for ``Qwen2MoeForCausalLM``; refuses what its router and blocks cannot express."""
    shared = m.moe_shared_expert_intermediate_size
    problems = {
        "routed experts without a sigmoid-gated shared expert (it always has one)": not (shared and m.moe_shared_expert_gate),
        "a sigmoid router, expert bias, top-k scaling or group-limited routing": m.moe_router_score_function != "softmax"
        or m.moe_router_enable_expert_bias or m.moe_router_topk_scaling_factor != 1.0 or bool(m.moe_router_group_topk),
    }  # fmt: skip
    for what, bad in problems.items():
        if bad:
            raise CheckpointError(f"hf-export: Qwen2MoeForCausalLM cannot express {what}")
    cfg = llama_hf_config(m, vocab_size, max_positions, dtype_name)
    for key in ("attention_bias", "mlp_bias"):  # not Qwen2-MoE config keys
        del cfg[key]
    pattern = moe_layer_pattern(m)
    return {
        **cfg, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "qkv_bias": m.add_qkv_bias,
        "num_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk, "moe_intermediate_size": expert_ffn_hidden_size(m),
        "shared_expert_intermediate_size": shared, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, moe in enumerate(pattern) if not moe], "norm_topk_prob": not m.moe_router_pre_softmax,
        "router_aux_loss_coef": aux_loss_coeff(m, sum(pattern)) * sum(pattern) / m.moe_router_topk, "use_sliding_window": False,
    }  # fmt: skip


def qwen2_moe_import(t: TensorSource, m: ModelConfig, vocab: int) -> dict[str, torch.Tensor]:
    """meshtron's state dict from the tensors of a ``qwen2_moe`` folder (either expert form)."""
    state, pattern = import_body(t, m, vocab), moe_layer_pattern(m)
    for i in range(m.num_layers):
        hf, mt = f"model.layers.{i}.", f"layers.{i}."
        state.update(import_llama_attention(t, hf, mt, m))
        if pattern[i]:
            state.update(import_moe_mlp(t, hf + "mlp.", mt + "mlp.", m, shared=SHARED))
        else:
            state.update(import_swiglu(t, hf + "mlp.", mt + "mlp.", ffn_hidden_size(m), m.hidden_size))
    return state


def qwen2_moe_export(state: Mapping[str, torch.Tensor], m: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``qwen2_moe_import``, one module per expert (the Hub's form), one layer at a time."""
    pattern = moe_layer_pattern(m)
    yield from export_body(state, m)
    for i in range(m.num_layers):
        hf, mt = f"model.layers.{i}.", f"layers.{i}."
        yield from export_llama_attention(state, mt, hf, m).items()
        if pattern[i]:
            yield from export_moe_mlp(state, mt + "mlp.", hf + "mlp.", m, shared=SHARED).items()
        else:
            yield from export_swiglu(state, mt + "mlp.", hf + "mlp.").items()
