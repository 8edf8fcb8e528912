"""What Hugging Face's checkpoints share, mapped once: the fused QKV rows (separate q, k, v <->
meshtron's per-group layout; every family but DeepSeek's latent attention) and, for the Llama
family (Llama, DeepSeek-V2), the embedding, final norm and output head, the two norms of each
block, SwiGLU MLPs (``gate_proj``/``up_proj``/``down_proj`` <-> the fused ``linear_fc1`` =
[gate | up] and ``linear_fc2``) and the rope settings of ``config.json``.

Importers take tensors from an object with ``take(name, shape)`` (``hf.HFTensors``: each tensor
handed out once, its shape checked); exporters read a meshtron state dict.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from meshtron.checkpoint.checkpoint import CheckpointError
from meshtron.config import ModelConfig


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


def export_body(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of ``import_body``."""
    out = {"model.embed_tokens.weight": state["embedding.weight"], "model.norm.weight": state["final_norm.weight"]}
    if not m.tie_embeddings:
        out["lm_head.weight"] = state["output.weight"]
    for i in range(m.num_layers):
        hf, mt = f"model.layers.{i}.", f"layers.{i}."
        out[hf + "input_layernorm.weight"] = state[mt + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = state[mt + "pre_mlp_layernorm.weight"]
    return out


def import_swiglu(t: TensorSource, hf: str, mt: str, ffn: int, h: int) -> dict[str, torch.Tensor]:
    """The MLP under HF prefix ``hf`` (``model.layers.0.mlp.``) as meshtron's under ``mt``."""
    gate, up = (t.take(hf + f"{x}_proj.weight", [ffn, h]) for x in ("gate", "up"))
    return {mt + "linear_fc1.weight": torch.cat([gate, up]), mt + "linear_fc2.weight": t.take(hf + "down_proj.weight", [h, ffn])}


def export_swiglu(state: dict[str, torch.Tensor], mt: str, hf: str) -> dict[str, torch.Tensor]:
    """The inverse of ``import_swiglu``."""
    gate, up = state[mt + "linear_fc1.weight"].chunk(2)
    return {hf + "gate_proj.weight": gate, hf + "up_proj.weight": up, hf + "down_proj.weight": state[mt + "linear_fc2.weight"]}
