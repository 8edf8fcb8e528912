"""DeepSeek-V2 (``DeepseekV2ForCausalLM``, model_type ``deepseek_v2``) to and from Hugging Face.

What ``hf.py`` reads and writes for Llama (embedding, norms, head, SwiGLU MLPs) is shared through
``hf_common``; this module adds the config and what only DeepSeek has:

* Multi-head latent attention: HF's ``q_proj`` (or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``),
  ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` map one to one onto
  ``layers/mla.py``'s modules (its docstring has the table). The rope rows keep the checkpoint's
  interleaved order; MLA reorders them at run time.
* YaRN from ``rope_scaling`` (transformers 4, DeepSeek's own code: ``"type": "yarn"``) or
  ``rope_parameters`` (transformers 5); both are written on export.
* Experts. The files on the Hub and what ``save_pretrained`` writes hold one module per expert,
  ``mlp.experts.{e}.{gate,up,down}_proj.weight``; transformers 5.x fuses them in memory into
  ``mlp.experts.gate_up_proj`` [E, 2 ffn, h] ([gate; up] per expert) and ``mlp.experts.down_proj``
  [E, h, ffn], exactly meshtron's stacked ``experts.weight1`` / ``weight2``. Import reads either
  form; export writes the per-expert one, which transformers 4 and 5 and DeepSeek's code all load.
  The router ``mlp.gate.weight`` is ``mlp.router.weight``; ``shared_experts`` is an MLP of width
  n_shared_experts x moe_intermediate_size.

Routing: softmax over all experts, top-k, renormalized only with ``norm_topk_prob``
(``--moe-router-pre-softmax`` when not), times ``routed_scaling_factor``. ``topk_method``
``greedy`` (V2-Lite) is plain top-k; ``group_limited_greedy`` (full V2) keeps a token's top-k
within the ``topk_group`` of ``n_group`` expert groups whose best expert scores highest:
meshtron's group-limited routing with ``moe_router_group_score = "max"``. Export writes
``group_limited_greedy`` for that rule, and for Megatron's ``sum_topk`` only where it is the same
rule (k / group_topk = 1). (transformers 5 ignores ``norm_topk_prob``, never renormalizing;
DeepSeek's own code honours it, as meshtron does.)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from meshtron.config import ModelConfig
from meshtron.errors import CheckpointError
from meshtron.layers.mlp import ffn_hidden_size
from meshtron.layers.moe import moe_layer_pattern
from meshtron.layers.moe.experts import expert_ffn_hidden_size
from meshtron.models.hf_common import (
    TensorSource, checked_config, export_block_mlp, export_body, import_block_mlp, import_body, refuse_unexpressible,
)  # fmt: skip

YARN_KEYS = {"factor": "rope_scaling_factor", "original_max_position_embeddings": "rope_original_max_position_embeddings",
              "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "mscale": "rope_mscale",
              "mscale_all_dim": "rope_mscale_all_dim"}  # fmt: skip


def is_deepseek(m: ModelConfig) -> bool:
    return m.multi_latent_attention


# -- configs --------------------------------------------------------------------------------------


def deepseek_model_config(hf: dict[str, Any], source: str) -> ModelConfig:
    """meshtron's shape of a ``deepseek_v2`` config.json; what it cannot run raises, naming ``source``."""
    refused = {"scoring_func": lambda v: v != "softmax", "topk_method": lambda v: v not in (None, "greedy", "group_limited_greedy")}
    cfg = shared_deepseek_config(hf, source, refused, "DeepSeek-V2")
    if cfg.num_experts:
        cfg.moe_router_pre_softmax = not hf.get("norm_topk_prob", False)
        if hf.get("topk_method") == "group_limited_greedy" and (hf.get("n_group") or 1) > (hf.get("topk_group") or 1):
            cfg.moe_router_num_groups, cfg.moe_router_group_topk = hf["n_group"], hf["topk_group"]
            cfg.moe_router_group_score = "max"
    return cfg


def shared_deepseek_config(hf: dict[str, Any], source: str, refused: dict[str, Any], family: str) -> ModelConfig:
    """What DeepSeek-V2 and V3 config.json files say alike: the blocks, latent attention, YaRN, the
    experts' shape and layers, the routed scaling and the balancing loss; ``refused`` adds the
    version's own refusals (``checked_config``). Routing rules are the caller's."""
    refused = {"hidden_act": lambda v: v != "silu", "attention_bias": bool, "mlp_bias": bool, "moe_layer_freq": lambda v: v != 1, **refused}
    theta, scaling, rope_type = checked_config(hf, source, refused, ("default", "yarn"), family)
    layers, heads, experts = hf["num_hidden_layers"], hf["num_attention_heads"], hf.get("n_routed_experts") or 0
    dense = min(hf.get("first_k_dense_replace", 0), layers) if experts else layers
    cfg = ModelConfig(
        num_layers=layers, hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
        vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=1, max_position_embeddings=hf.get("max_position_embeddings", 2048),
        normalization="RMSNorm", norm_epsilon=hf.get("rms_norm_eps", 1e-6), activation="swiglu", position_embedding_type="rope",
        rotary_base=theta, add_bias_linear=False, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        multi_latent_attention=True, qk_layernorm=True, q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
    )  # fmt: skip
    if rope_type == "yarn":
        cfg.rope_scaling = "yarn"
        for key, field in YARN_KEYS.items():
            if key in scaling:
                setattr(cfg, field, type(getattr(cfg, field))(scaling[key]))
    if dense < layers:
        cfg.num_experts, cfg.moe_router_topk = experts, hf["num_experts_per_tok"]
        cfg.moe_ffn_hidden_size = hf["moe_intermediate_size"]
        cfg.moe_shared_expert_intermediate_size = (hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"]
        cfg.moe_layer_freq = f"([0]*{dense}+[1]*{layers - dense})" if dense else "1"
        cfg.moe_router_topk_scaling_factor = float(hf.get("routed_scaling_factor", 1.0))
        cfg.moe_router_load_balancing_type = "seq_aux_loss" if hf.get("seq_aux", True) else "aux_loss"
        cfg.moe_aux_loss_coeff = float(hf.get("aux_loss_alpha", 0.0))
    return cfg


def first_dense_layers(m: ModelConfig) -> int:
    """How many leading layers are dense, for ``first_k_dense_replace``; refuses other patterns."""
    pattern = moe_layer_pattern(m)
    dense = pattern.index(True) if any(pattern) else m.num_layers
    if any(pattern) and not all(pattern[dense:]):
        raise CheckpointError(f"hf-export: DeepSeek has dense layers only before its MoE ones; "
                              f"--moe-layer-freq {m.moe_layer_freq} mixes them")  # fmt: skip
    return dense


def _groups_by_best_expert(m: ModelConfig) -> bool:
    """Whether meshtron's group-limited routing is HF's ``group_limited_greedy`` (a group scored by its best expert)."""
    return m.moe_router_group_score == "max" or m.moe_router_topk // m.moe_router_group_topk == 1


def _topk_method(m: ModelConfig) -> dict[str, Any]:
    if m.moe_router_group_topk:
        return {"topk_method": "group_limited_greedy", "n_group": m.moe_router_num_groups, "topk_group": m.moe_router_group_topk}
    return {"topk_method": "greedy", "n_group": 1, "topk_group": 1}


def deepseek_hf_config(m: ModelConfig, vocab_size: int, max_positions: int, dtype_name: str) -> dict[str, Any]:
    """config.json for ``DeepseekV2ForCausalLM``; refuses what that class cannot express."""
    problems = {
        "a sigmoid router, expert bias or shared-expert gate": m.moe_router_score_function != "softmax"
        or m.moe_router_enable_expert_bias or m.moe_shared_expert_gate,
        "groups scored by the sum of their best k / group_topk experts (group_limited_greedy takes the best one: "
        "--model.moe_router_group_score max)": bool(m.moe_router_group_topk) and not _groups_by_best_expert(m),
    }  # fmt: skip
    config = shared_hf_config("DeepseekV2ForCausalLM", m, vocab_size, max_positions, dtype_name, problems)
    if m.num_experts:
        config.update({"norm_topk_prob": not m.moe_router_pre_softmax, "scoring_func": "softmax", **_topk_method(m)})
    return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", **config}


def shared_hf_config(architecture: str, m: ModelConfig, vocab_size: int, max_positions: int, dtype_name: str,
                     problems: dict[str, bool]) -> dict[str, Any]:  # fmt: skip
    """The config.json keys DeepSeek-V2 and V3 share (the blocks, latent attention, YaRN, the experts'
    shape and layers, the routed scaling, the balancing loss); refuses ``problems`` (the version's
    own) and what neither expresses, naming ``architecture``."""
    shared, expert_ffn = m.moe_shared_expert_intermediate_size, expert_ffn_hidden_size(m)
    refuse_unexpressible(architecture, {
        "--qk-layernorm off (DeepSeek norms both latents)": not m.qk_layernorm,
        "shared experts that are not a whole number of experts wide": bool(m.num_experts and shared % expert_ffn),
        "a non-Llama block (RMSNorm, SwiGLU, RoPE, no biases)": (m.normalization, m.activation, m.add_bias_linear)
        != ("RMSNorm", "swiglu", False),
        "rope scaling other than yarn": m.rope_scaling not in ("", "yarn"),
        **problems,
    })  # fmt: skip
    rope: dict[str, Any] = {"rope_type": "default"}
    if m.rope_scaling == "yarn":
        rope = {"rope_type": "yarn", **{key: getattr(m, field) for key, field in YARN_KEYS.items()}}
    legacy_rope = {"type": "yarn", **{k: v for k, v in rope.items() if k != "rope_type"}} if m.rope_scaling else None
    experts = {}
    if m.num_experts:
        experts = {
            "n_routed_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk, "moe_intermediate_size": expert_ffn,
            "n_shared_experts": shared // expert_ffn, "first_k_dense_replace": first_dense_layers(m), "moe_layer_freq": 1,
            "routed_scaling_factor": m.moe_router_topk_scaling_factor,
            "seq_aux": m.moe_router_load_balancing_type == "seq_aux_loss", "aux_loss_alpha": m.moe_aux_loss_coeff,
        }  # fmt: skip
    return {
        "hidden_size": m.hidden_size,
        "intermediate_size": ffn_hidden_size(m), "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads, "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_head_dim, "qk_rope_head_dim": m.qk_pos_emb_head_dim, "v_head_dim": m.v_head_dim,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "rms_norm_eps": m.norm_epsilon,
        "max_position_embeddings": max_positions, "vocab_size": vocab_size, "tie_word_embeddings": m.tie_embeddings,
        "rope_theta": m.rotary_base, "rope_scaling": legacy_rope, "rope_parameters": {**rope, "rope_theta": m.rotary_base},
        **experts, "torch_dtype": dtype_name,
    }  # fmt: skip


# -- tensors --------------------------------------------------------------------------------------


def attention_tensors(m: ModelConfig) -> list[tuple[str, str, list[int]]]:
    """(HF name under ``self_attn.``, meshtron's under ``self_attention.``, shape) of one layer's
    attention weights: the names of ``layers/mla.py``'s table."""
    h, heads, lora, rank = m.hidden_size, m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank
    q_out = heads * (m.qk_head_dim + m.qk_pos_emb_head_dim)
    query = [("q_proj", "linear_q_proj", [q_out, h])]
    if lora:
        query = [("q_a_proj", "linear_q_down_proj", [lora, h]), ("q_a_layernorm", "q_layernorm", [lora]),
                 ("q_b_proj", "linear_q_up_proj", [q_out, lora])]  # fmt: skip
    return query + [
        ("kv_a_proj_with_mqa", "linear_kv_down_proj", [rank + m.qk_pos_emb_head_dim, h]), ("kv_a_layernorm", "kv_layernorm", [rank]),
        ("kv_b_proj", "linear_kv_up_proj", [heads * (m.qk_head_dim + m.v_head_dim), rank]),
        ("o_proj", "linear_proj", [h, heads * m.v_head_dim]),
    ]  # fmt: skip


def import_layer(t: TensorSource, hf: str, mt: str, m: ModelConfig, is_moe: bool) -> dict[str, torch.Tensor]:
    """One layer's attention and MLP (not its two norms: ``import_body`` takes the blocks')."""
    state = {f"{mt}self_attention.{ours}.weight": t.take(f"{hf}self_attn.{theirs}.weight", shape) for theirs, ours, shape in attention_tensors(m)}
    return {**state, **import_block_mlp(t, hf, mt, m, is_moe)}


def export_layer(state: Mapping[str, torch.Tensor], mt: str, hf: str, m: ModelConfig, is_moe: bool) -> dict[str, torch.Tensor]:
    """The inverse of ``import_layer``."""
    out = {f"{hf}self_attn.{theirs}.weight": state[f"{mt}self_attention.{ours}.weight"] for theirs, ours, _ in attention_tensors(m)}
    return {**out, **export_block_mlp(state, mt, hf, m, is_moe)}


def deepseek_import(t: TensorSource, m: ModelConfig, vocab: int) -> dict[str, torch.Tensor]:
    """meshtron's state dict from the tensors of a ``deepseek_v2`` folder."""
    state, pattern = import_body(t, m, vocab), moe_layer_pattern(m)
    for i in range(m.num_layers):
        state.update(import_layer(t, f"model.layers.{i}.", f"layers.{i}.", m, pattern[i]))
    return state


def deepseek_export(state: Mapping[str, torch.Tensor], m: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``deepseek_import``, experts one module each (the Hub's form), one layer at a time."""
    pattern = moe_layer_pattern(m)
    yield from export_body(state, m)
    for i in range(m.num_layers):
        yield from export_layer(state, f"layers.{i}.", f"model.layers.{i}.", m, pattern[i]).items()
