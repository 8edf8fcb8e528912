"""Mixtral (``MixtralForCausalLM``, model_type ``mixtral``) to and from Hugging Face.

Mixtral is Llama (GQA attention, RMSNorm, RoPE; ``hf_common`` maps those) whose every MLP is a
mixture of ``num_local_experts`` SwiGLU experts of width ``intermediate_size``:

* Router: HF's ``block_sparse_moe.gate.weight`` [E, h] is ``mlp.router.weight``. HF takes the
  softmax over all experts, keeps the top k and divides them by their sum; that is the softmax over
  the k chosen logits, meshtron's default routing (top-k, then softmax), so nothing is set.
* Experts: the Hub's files (and what ``save_pretrained`` writes) hold
  ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down); transformers 5 renames
  them in memory to ``mlp.experts.gate_up_proj`` [E, 2 ffn, h] / ``mlp.experts.down_proj``.
  Import reads either; export writes the Hub's.
* Balancing: HF's ``router_aux_loss_coef`` scales ``E * sum_i f_i * P_i`` with f_i = tokens
  choosing expert i / tokens (the f_i sum to k), both factors pooled over all layers; meshtron's
  layer-averaged ``--moe-loss-weight`` divides f_i by tokens x k (Megatron's), so it is the
  coefficient times k. Pooling before or after the product differs only where layers route
  unalike; this is training only, logits never depend on it.
* ``router_jitter_noise`` is ``--moe-jitter-eps``. A ``sliding_window`` is refused: meshtron's
  attention is full causal (Mixtral 8x7B's config has none).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from meshtron.config import ModelConfig
from meshtron.layers.moe import moe_layer_pattern
from meshtron.layers.moe.experts import expert_ffn_hidden_size
from meshtron.models.hf_common import (
    W1_W3_W2, TensorSource, export_body, export_llama_attention, export_moe_mlp, import_body, import_llama_attention,
    import_moe_mlp, llama_hf_config, llama_model_config, moe_loss_weight, refuse_unexpressible, router_aux_loss_coef,
)  # fmt: skip


def mixtral_model_config(hf: dict[str, Any], source: str) -> ModelConfig:
    """meshtron's shape of a ``mixtral`` config.json; what it cannot run raises, naming ``source``."""
    cfg = llama_model_config(hf, source, {"sliding_window": lambda v: v is not None}, "Mixtral (silu, no biases, no sliding window)")
    cfg.num_experts, cfg.moe_router_topk = hf["num_local_experts"], hf["num_experts_per_tok"]
    cfg.moe_ffn_hidden_size = hf["intermediate_size"]
    cfg.moe_loss_weight = moe_loss_weight(hf)
    cfg.moe_jitter_eps = float(hf.get("router_jitter_noise") or 0.0)
    return cfg


def mixtral_hf_config(m: ModelConfig, vocab_size: int, max_positions: int, dtype_name: str) -> dict[str, Any]:
    """config.json for ``MixtralForCausalLM`` (a Llama-shaped ``m`` with experts); refuses what
    Mixtral's router and blocks cannot express."""
    problems = {
        "dense layers (--moe-layer-freq other than every layer)": not all(moe_layer_pattern(m)),
        "routing other than softmax over the top-k logits (--moe-router-pre-softmax, sigmoid, expert bias)":
            m.moe_router_pre_softmax or m.moe_router_score_function != "softmax" or m.moe_router_enable_expert_bias,
        "a top-k scaling factor": m.moe_router_topk_scaling_factor != 1.0,
        "group-limited routing": bool(m.moe_router_group_topk),
    }  # fmt: skip
    refuse_unexpressible("MixtralForCausalLM", problems)
    cfg = llama_hf_config(m, vocab_size, max_positions, dtype_name)
    for key in ("attention_bias", "mlp_bias"):  # not Mixtral config keys
        del cfg[key]
    return {
        **cfg, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": expert_ffn_hidden_size(m),
        "num_local_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk, "sliding_window": None,
        "router_aux_loss_coef": router_aux_loss_coef(m), "router_jitter_noise": m.moe_jitter_eps,
    }  # fmt: skip


def mixtral_import(t: TensorSource, m: ModelConfig, vocab: int) -> dict[str, torch.Tensor]:
    """meshtron's state dict from the tensors of a ``mixtral`` folder (either expert form)."""
    state = import_body(t, m, vocab)
    for i in range(m.num_layers):
        hf, mt = f"model.layers.{i}.", f"layers.{i}."
        state.update(import_llama_attention(t, hf, mt, m))
        moe = hf + ("mlp." if hf + "mlp.gate.weight" in t.tensors else "block_sparse_moe.")
        state.update(import_moe_mlp(t, moe, mt + "mlp.", m, W1_W3_W2))
    return state


def mixtral_export(state: Mapping[str, torch.Tensor], m: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``mixtral_import``, in the Hub's names, one layer at a time."""
    yield from export_body(state, m)
    for i in range(m.num_layers):
        hf, mt = f"model.layers.{i}.", f"layers.{i}."
        yield from export_llama_attention(state, mt, hf, m).items()
        yield from export_moe_mlp(state, mt + "mlp.", hf + "block_sparse_moe.", m, W1_W3_W2).items()
