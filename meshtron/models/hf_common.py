"""What Hugging Face's checkpoints share, mapped once: the fused QKV rows (separate q, k, v <->
meshtron's per-group layout, ``fuse_qkv``; every family but DeepSeek's latent attention) and, for
the Llama family (Llama, Mixtral, Qwen2-MoE, DeepSeek-V2), the embedding, final norm and output
head, the two norms of each block, SwiGLU MLPs (``gate_proj``/``up_proj``/``down_proj`` <-> the
fused ``linear_fc1`` = [gate | up] and ``linear_fc2``), routed experts (stacked
``experts.weight1`` / ``weight2``), Llama's attention with the q/k norms of Qwen3 (per head) and
OLMoE (full width), a whole decoder of these (Llama, Qwen, OLMoE), the router's loss coefficient
and the rope settings and Llama shape of ``config.json``.

Importers take tensors from an object with ``take(name, shape)`` (``hf.HFTensors``: each tensor
handed out once, its shape checked). Exporters read a meshtron state dict, a mapping that may read
each tensor only when indexed (``checkpoint/tensor_reader.py``), and yield ``(HF name, tensor)``
pairs as they go, so a layer's tensors are needed only while that layer is converted; the helpers
for one layer's pieces return that layer's dict.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch

from meshtron.config import ModelConfig
from meshtron.errors import CheckpointError
from meshtron.layers.attention import head_dim, num_kv_heads, qk_norm_widths
from meshtron.layers.mlp import ffn_hidden_size
from meshtron.layers.moe import moe_layer_pattern
from meshtron.layers.moe.balancing import aux_loss_coeff
from meshtron.layers.moe.experts import expert_ffn_hidden_size


class TensorSource(Protocol):
    tensors: dict[str, torch.Tensor]

    def take(self, name: str, shape: list[int]) -> torch.Tensor: ...


def rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope theta, scaling dict) from transformers 5's ``rope_parameters`` or 4's ``rope_theta``/``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    scaling = params if params else (hf.get("rope_scaling") or {})
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), scaling


def checked_config(hf: dict[str, Any], source: str, refused: dict[str, Any], rope_types: tuple[str, ...],
                   family: str) -> tuple[float, dict[str, Any], str]:  # fmt: skip
    """Refuse a config.json meshtron cannot run as ``family``: a key whose ``refused[key](value)``
    is true, or a rope scaling not in ``rope_types``, each naming ``source``; else its rope theta,
    scaling dict (``rope_settings``) and scaling type."""
    for key, unsupported in refused.items():
        if key in hf and unsupported(hf[key]):
            raise CheckpointError(f"{source}: {key}={hf[key]!r} is not supported by meshtron's {family}")
    theta, scaling = rope_settings(hf)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in rope_types:
        raise CheckpointError(f"{source}: rope scaling '{rope_type}' is not supported for {family} (only {', '.join(rope_types)})")
    return theta, scaling, rope_type


def refuse_unexpressible(architecture: str, problems: dict[str, bool]) -> None:
    """An export's refusal: the first of ``problems`` (what -> whether the model has it) that the
    Hugging Face ``architecture`` cannot express, named in the error."""
    for what, bad in problems.items():
        if bad:
            raise CheckpointError(f"hf-export: {architecture} cannot express {what}")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Separate q [heads*d, ...], k, v [groups*d, ...] -> meshtron's per-group [q heads | k | v] rows."""
    d = k.shape[0] // groups
    parts = [q.reshape(groups, -1, d, *q.shape[1:]), k.reshape(groups, 1, d, *k.shape[1:]), v.reshape(groups, 1, d, *v.shape[1:])]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``fuse_qkv``."""
    per_group = heads // groups + 2
    grouped = qkv.reshape(groups, per_group, -1, *qkv.shape[1:])
    q, k, v = grouped[:, :-2], grouped[:, -2], grouped[:, -1]
    q, k, v = (t.reshape(-1, *qkv.shape[1:]).contiguous() for t in (q, k, v))
    return q, k, v


def import_body(t: TensorSource, m: ModelConfig, vocab: int) -> dict[str, torch.Tensor]:
    """Embedding, final norm, untied output layer and every block's two norms."""
    h = m.hidden_size
    state = {"embedding.weight": t.take("model.embed_tokens.weight", [vocab, h]), "final_norm.weight": t.take("model.norm.weight", [h])}
    if m.tie_embeddings:
        t.tensors.pop("lm_head.weight", None)  # the embedding itself, where a tied model saved it anyway
    else:
        state["output.weight"] = t.take("lm_head.weight", [vocab, h])
    for i in range(m.num_layers):
        hf, mt = f"model.layers.{i}.", f"layers.{i}."
        state[mt + "input_layernorm.weight"] = t.take(hf + "input_layernorm.weight", [h])
        state[mt + "pre_mlp_layernorm.weight"] = t.take(hf + "post_attention_layernorm.weight", [h])
    return state


def export_body(state: Mapping[str, torch.Tensor], m: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``import_body``."""
    yield "model.embed_tokens.weight", state["embedding.weight"]
    yield "model.norm.weight", state["final_norm.weight"]
    if not m.tie_embeddings:
        yield "lm_head.weight", state["output.weight"]
    for i in range(m.num_layers):
        hf, mt = f"model.layers.{i}.", f"layers.{i}."
        yield hf + "input_layernorm.weight", state[mt + "input_layernorm.weight"]
        yield hf + "post_attention_layernorm.weight", state[mt + "pre_mlp_layernorm.weight"]


def import_swiglu(t: TensorSource, hf: str, mt: str, ffn: int, h: int) -> dict[str, torch.Tensor]:
    """The MLP under HF prefix ``hf`` (``model.layers.0.mlp.``) as meshtron's under ``mt``."""
    gate, up = (t.take(hf + f"{x}_proj.weight", [ffn, h]) for x in ("gate", "up"))
    return {mt + "linear_fc1.weight": torch.cat([gate, up]), mt + "linear_fc2.weight": t.take(hf + "down_proj.weight", [h, ffn])}


def export_swiglu(state: Mapping[str, torch.Tensor], mt: str, hf: str) -> dict[str, torch.Tensor]:
    """The inverse of ``import_swiglu``."""
    gate, up = state[mt + "linear_fc1.weight"].chunk(2)
    return {hf + "gate_proj.weight": gate, hf + "up_proj.weight": up, hf + "down_proj.weight": state[mt + "linear_fc2.weight"]}


def llama_model_config(hf: dict[str, Any], source: str, refused: dict[str, Any], family: str) -> ModelConfig:
    """The Llama shape of ``config.json`` (GQA, RMSNorm, SwiGLU, RoPE with optional Llama 3.1
    scaling, no biases); ``refused`` as ``checked_config`` takes it, beside silu and biases."""
    refused = {"hidden_act": lambda v: v != "silu", "attention_bias": bool, "mlp_bias": bool, **refused}
    theta, scaling, rope_type = checked_config(hf, source, refused, ("default", "llama3"), family)
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    cfg = ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hidden, ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hidden // heads, vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=1,
        max_position_embeddings=hf.get("max_position_embeddings", 2048), normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6), activation="swiglu", position_embedding_type="rope",
        rotary_base=theta, add_bias_linear=False, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )  # fmt: skip
    if rope_type == "llama3":
        cfg.rope_scaling = "llama3"
        cfg.rope_scaling_factor = float(scaling["factor"])
        cfg.rope_low_freq_factor = float(scaling["low_freq_factor"])
        cfg.rope_high_freq_factor = float(scaling["high_freq_factor"])
        cfg.rope_original_max_position_embeddings = int(scaling["original_max_position_embeddings"])
    return cfg


def llama_hf_config(m: ModelConfig, vocab_size: int, max_positions: int, dtype_name: str) -> dict[str, Any]:
    """config.json of ``LlamaForCausalLM``; Mixtral's adds its experts to it."""
    rope: dict[str, Any] = {"rope_type": "default"}
    if m.rope_scaling == "llama3":
        rope = {
            "rope_type": "llama3", "factor": m.rope_scaling_factor, "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor, "original_max_position_embeddings": m.rope_original_max_position_embeddings,
        }  # fmt: skip
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m.hidden_size,
        "intermediate_size": ffn_hidden_size(m), "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": num_kv_heads(m), "head_dim": head_dim(m),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "rms_norm_eps": m.norm_epsilon,
        "max_position_embeddings": max_positions, "vocab_size": vocab_size, "tie_word_embeddings": m.tie_embeddings,
        "rope_theta": m.rotary_base, "rope_scaling": rope if m.rope_scaling else None,
        "rope_parameters": {**rope, "rope_theta": m.rotary_base}, "torch_dtype": dtype_name,
    }  # fmt: skip


def import_llama_attention(t: TensorSource, hf: str, mt: str, m: ModelConfig) -> dict[str, torch.Tensor]:
    """``{hf}self_attn.{q,k,v,o}_proj`` as meshtron's ``{mt}self_attention.linear_qkv`` / ``linear_proj``,
    with the q/k/v biases (Qwen2's) under ``--add-qkv-bias``."""
    h, d, heads, groups = m.hidden_size, head_dim(m), m.num_attention_heads, num_kv_heads(m)
    out = {mt + "self_attention.linear_proj.weight": t.take(hf + "self_attn.o_proj.weight", [h, heads * d])}
    for kind, extra in (("weight", [h]), ("bias", [])) if m.add_qkv_bias else (("weight", [h]),):
        q = t.take(f"{hf}self_attn.q_proj.{kind}", [heads * d, *extra])
        k, v = (t.take(f"{hf}self_attn.{x}_proj.{kind}", [groups * d, *extra]) for x in "kv")
        out[f"{mt}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, groups)
    return out


def export_llama_attention(state: Mapping[str, torch.Tensor], mt: str, hf: str, m: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of ``import_llama_attention``."""
    out = {hf + "self_attn.o_proj.weight": state[mt + "self_attention.linear_proj.weight"]}
    for kind in ("weight", "bias") if m.add_qkv_bias else ("weight",):
        q, k, v = split_qkv(state[f"{mt}self_attention.linear_qkv.{kind}"], m.num_attention_heads, num_kv_heads(m))
        out.update({f"{hf}self_attn.q_proj.{kind}": q, f"{hf}self_attn.k_proj.{kind}": k, f"{hf}self_attn.v_proj.{kind}": v})
    return out


def _qk_norms(m: ModelConfig) -> list[tuple[str, str, int]]:
    """(HF name, meshtron name, width) of a layer's q and k norms where ``m`` has them: per head
    (Qwen3's, [head_dim]) or over the whole projections (OLMoE's, [heads x d] and [kv heads x d])."""
    if not m.qk_layernorm:
        return []
    q, k = qk_norm_widths(m)
    return [("self_attn.q_norm.weight", "self_attention.q_layernorm.weight", q), ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight", k)]


def router_aux_loss_coef(m: ModelConfig) -> float:
    """HF's ``router_aux_loss_coef`` of ``m``'s balancing loss: the layer-averaged coefficient over k
    (HF's token fractions sum to k, meshtron's to 1: ``hf_mixtral.py``)."""
    moe_layers = sum(moe_layer_pattern(m))
    return aux_loss_coeff(m, moe_layers) * moe_layers / m.moe_router_topk


def moe_loss_weight(hf: dict[str, Any]) -> float:
    """The inverse of ``router_aux_loss_coef``: ``--moe-loss-weight`` from a config.json."""
    return float(hf.get("router_aux_loss_coef", 0.0)) * hf["num_experts_per_tok"]


def unmapped_routing(m: ModelConfig) -> bool:
    """Routing that HF's softmax-then-top-k routers (Qwen-MoE's, OLMoE's) cannot express."""
    return bool(m.num_experts) and (m.moe_router_score_function != "softmax" or m.moe_router_enable_expert_bias
                                    or m.moe_router_topk_scaling_factor != 1.0 or bool(m.moe_router_group_topk))  # fmt: skip


# Per-expert tensor names (gate, up, down) under ``experts.{e}.``: DeepSeek's and Qwen's, Mixtral's.
GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
W1_W3_W2 = ("w1", "w3", "w2")


def import_experts(
    t: TensorSource, hf: str, mt: str, m: ModelConfig, names: tuple[str, str, str] = GATE_UP_DOWN
) -> dict[str, torch.Tensor]:
    """Stacked ``{mt}weight1`` [E, 2 ffn, h] ([gate; up]) and ``weight2`` [E, h, ffn] from the
    experts under ``hf``: one module per expert (the Hub's files, ``{hf}{e}.{gate}.weight``) or
    transformers 5's fused in-memory form (``{hf}gate_up_proj`` [E, 2 ffn, h], ``{hf}down_proj``)."""
    e, ffn, h = m.num_experts, expert_ffn_hidden_size(m), m.hidden_size
    if hf + "gate_up_proj" in t.tensors:
        return {mt + "weight1": t.take(hf + "gate_up_proj", [e, 2 * ffn, h]), mt + "weight2": t.take(hf + "down_proj", [e, h, ffn])}
    gate, up, down = names
    fc1 = [torch.cat([t.take(f"{hf}{x}.{gate}.weight", [ffn, h]), t.take(f"{hf}{x}.{up}.weight", [ffn, h])]) for x in range(e)]
    fc2 = [t.take(f"{hf}{x}.{down}.weight", [h, ffn]) for x in range(e)]
    return {mt + "weight1": torch.stack(fc1), mt + "weight2": torch.stack(fc2)}


def export_experts(state: Mapping[str, torch.Tensor], mt: str, hf: str, names: tuple[str, str, str] = GATE_UP_DOWN) -> dict[str, torch.Tensor]:
    """The inverse of ``import_experts``, one module per expert (the form every loader reads)."""
    out, (gate, up, down) = {}, names
    for e, (fc1, fc2) in enumerate(zip(state[mt + "weight1"], state[mt + "weight2"])):
        gate_rows, up_rows = fc1.chunk(2)
        out.update({f"{hf}{e}.{gate}.weight": gate_rows, f"{hf}{e}.{up}.weight": up_rows, f"{hf}{e}.{down}.weight": fc2})
    return out


def import_moe_mlp(
    t: TensorSource, hf: str, mt: str, m: ModelConfig, names: tuple[str, str, str] = GATE_UP_DOWN, shared: str = "shared_experts"
) -> dict[str, torch.Tensor]:
    """A mixture-of-experts MLP under HF prefix ``hf`` (``model.layers.1.mlp.``) as meshtron's under
    ``mt``: the router ``{hf}gate``, the experts ``{hf}experts.``, and where ``m`` has them the
    shared experts ``{hf}{shared}.`` (an MLP) and their sigmoid gate ``{hf}{shared}_gate`` [1, h]."""
    h, width = m.hidden_size, m.moe_shared_expert_intermediate_size
    state = {mt + "router.weight": t.take(hf + "gate.weight", [m.num_experts, h])}
    state.update(import_experts(t, hf + "experts.", mt + "experts.", m, names))
    if width:
        state.update(import_swiglu(t, f"{hf}{shared}.", mt + "shared_experts.", width, h))
    if m.moe_shared_expert_gate:
        state[mt + "shared_expert_gate.weight"] = t.take(f"{hf}{shared}_gate.weight", [1, h])
    return state


def export_moe_mlp(
    state: Mapping[str, torch.Tensor], mt: str, hf: str, m: ModelConfig, names: tuple[str, str, str] = GATE_UP_DOWN,
    shared: str = "shared_experts",
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The inverse of ``import_moe_mlp``."""
    out = {hf + "gate.weight": state[mt + "router.weight"], **export_experts(state, mt + "experts.", hf + "experts.", names)}
    if m.moe_shared_expert_intermediate_size:
        out.update(export_swiglu(state, mt + "shared_experts.", f"{hf}{shared}."))
    if m.moe_shared_expert_gate:
        out[f"{hf}{shared}_gate.weight"] = state[mt + "shared_expert_gate.weight"]
    return out


def import_block_mlp(t: TensorSource, hf: str, mt: str, m: ModelConfig, is_moe: bool, shared: str = "shared_experts") -> dict[str, torch.Tensor]:
    """Block ``hf``'s MLP (``model.layers.0.mlp.``) as meshtron's under ``mt``: its mixture of
    experts where ``is_moe`` (experts named as DeepSeek and Qwen name them), else a SwiGLU MLP."""
    if is_moe:
        return import_moe_mlp(t, hf + "mlp.", mt + "mlp.", m, shared=shared)
    return import_swiglu(t, hf + "mlp.", mt + "mlp.", ffn_hidden_size(m), m.hidden_size)


def export_block_mlp(state: Mapping[str, torch.Tensor], mt: str, hf: str, m: ModelConfig, is_moe: bool,
                     shared: str = "shared_experts") -> dict[str, torch.Tensor]:  # fmt: skip
    """The inverse of ``import_block_mlp``."""
    if is_moe:
        return export_moe_mlp(state, mt + "mlp.", hf + "mlp.", m, shared=shared)
    return export_swiglu(state, mt + "mlp.", hf + "mlp.")


def import_llama_decoder(t: TensorSource, m: ModelConfig, vocab: int, shared: str = "shared_experts") -> dict[str, torch.Tensor]:
    """meshtron's state dict from a Llama-named folder: the body, each layer's attention (and q/k
    norms where ``m`` has them) and its SwiGLU MLP or mixture of experts (either expert form);
    Llama's, Qwen's and OLMoE's."""
    state, pattern = import_body(t, m, vocab), moe_layer_pattern(m)
    for i in range(m.num_layers):
        hf, mt = f"model.layers.{i}.", f"layers.{i}."
        state.update(import_llama_attention(t, hf, mt, m))
        state.update({mt + ours: t.take(hf + theirs, [width]) for theirs, ours, width in _qk_norms(m)})
        state.update(import_block_mlp(t, hf, mt, m, pattern[i], shared=shared))
    return state


def export_llama_decoder(state: Mapping[str, torch.Tensor], m: ModelConfig, shared: str = "shared_experts") -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``import_llama_decoder``, one module per expert (the Hub's form), one layer at a time."""
    pattern = moe_layer_pattern(m)
    yield from export_body(state, m)
    for i in range(m.num_layers):
        hf, mt = f"model.layers.{i}.", f"layers.{i}."
        yield from export_llama_attention(state, mt, hf, m).items()
        yield from ((hf + theirs, state[mt + ours]) for theirs, ours, _ in _qk_norms(m))
        yield from export_block_mlp(state, mt, hf, m, pattern[i], shared=shared).items()
