"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, model_type ``deepseek_v3``) to and from Hugging Face.

V3 is V2's blocks (``hf_deepseek.py`` maps them) with another router and multi-token prediction:

* Routing (``topk_method`` ``noaux_tc``): sigmoid scores; the expert bias
  ``mlp.gate.e_score_correction_bias`` (meshtron's ``mlp.router.expert_bias``, the
  auxiliary-loss-free balancing) is added for choosing only; a token's experts come from the
  ``topk_group`` of ``n_group`` groups whose best two biased scores sum highest, which is
  meshtron's ``sum_topk`` group score when ``num_experts_per_tok / topk_group`` is 2 (V3's 8 / 4);
  the chosen scores are renormalized (``norm_topk_prob``) and times ``routed_scaling_factor``. The
  gate runs in fp32 (transformers keeps it there), so the import asks ``--moe-router-dtype fp32``.
* Multi-token prediction: depth k is layer ``num_hidden_layers + k - 1`` of the files
  (``num_nextn_predict_layers`` of them) with ``enorm``, ``hnorm``, ``eh_proj``, a whole layer and
  ``shared_head.norm`` (``models/mtp.py``'s ``mtp.{k-1}.``), plus ``embed_tokens`` and
  ``shared_head.head``, copies of the embedding and output layer, which meshtron shares: the
  import checks they are copies, the export writes them. transformers builds no depth (it skips
  these tensors), and a folder saved by transformers holds none: the import reads as many depths
  as the files have.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from meshtron.config import ModelConfig
from meshtron.errors import CheckpointError
from meshtron.layers.moe import moe_layer_pattern
from meshtron.models.hf_common import TensorSource, export_body, import_body
from meshtron.models.hf_deepseek import export_layer, import_layer, shared_deepseek_config, shared_hf_config

BEST_PER_GROUP = 2  # noaux_tc scores a group by the sum of its best two experts


def is_deepseek_v3(m: ModelConfig) -> bool:
    """A latent-attention model HF calls DeepSeek-V3: a sigmoid router (a softmax one is V2's, its
    prediction depths then left out), or dense with prediction depths."""
    routed = bool(m.num_experts) and m.moe_router_score_function == "sigmoid"
    return m.multi_latent_attention and (routed or (not m.num_experts and m.mtp_num_layers > 0))


def _depths_in(names: set[str], layers: int) -> int:
    """How many prediction depths the files hold (layers ``layers``, ``layers + 1``, ... with an ``eh_proj``)."""
    depths = 0
    while f"model.layers.{layers + depths}.eh_proj.weight" in names:
        depths += 1
    return depths


def deepseek_v3_model_config(hf: dict[str, Any], source: str, names: set[str]) -> ModelConfig:
    """meshtron's shape of a ``deepseek_v3`` config.json and the depths its tensor ``names`` hold;
    what meshtron cannot run raises, naming ``source``."""
    k = hf.get("num_experts_per_tok") or 1
    refused = {"scoring_func": lambda v: v != "sigmoid", "topk_method": lambda v: v not in (None, "noaux_tc"),
               "rope_interleave": lambda v: v is False, "norm_topk_prob": lambda v: not v and k > 1}  # fmt: skip
    cfg = shared_deepseek_config(hf, source, refused, "DeepSeek-V3")
    if cfg.num_experts:
        if k == 1:
            raise CheckpointError(f"{source}: num_experts_per_tok 1 is not supported by meshtron's DeepSeek-V3 "
                                  "(HF renormalizes the one score to 1; meshtron keeps it)")  # fmt: skip
        cfg.moe_router_score_function, cfg.moe_router_enable_expert_bias, cfg.moe_router_dtype = "sigmoid", True, "fp32"
        groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
        if groups > group_topk:
            if k != BEST_PER_GROUP * group_topk:
                raise CheckpointError(f"{source}: num_experts_per_tok {k} with topk_group {group_topk}: meshtron scores a group by "
                                      f"its best {k} / {group_topk} experts, HF by its best {BEST_PER_GROUP}; only k = "
                                      f"{BEST_PER_GROUP} x topk_group routes alike")  # fmt: skip
            cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_group_score = groups, group_topk, "sum_topk"
    cfg.mtp_num_layers = _depths_in(names, cfg.num_layers)
    return cfg


def deepseek_v3_hf_config(m: ModelConfig, vocab_size: int, max_positions: int, dtype_name: str) -> dict[str, Any]:
    """config.json for ``DeepseekV3ForCausalLM``; refuses what that class cannot express."""
    groups = bool(m.moe_router_group_topk)
    problems = {
        "a shared-expert gate": m.moe_shared_expert_gate,
        "one routed expert per token (HF renormalizes its score to 1)": bool(m.num_experts) and m.moe_router_topk == 1,
        f"groups not scored by their best {BEST_PER_GROUP} experts (--moe-router-topk = {BEST_PER_GROUP} x --moe-router-group-topk, "
        "--model.moe_router_group_score sum_topk)": groups and (m.moe_router_group_score != "sum_topk"
                                                               or m.moe_router_topk != BEST_PER_GROUP * m.moe_router_group_topk),
    }  # fmt: skip
    config = shared_hf_config("DeepseekV3ForCausalLM", m, vocab_size, max_positions, dtype_name, problems)
    if m.num_experts:
        config.update({"norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                       "n_group": m.moe_router_num_groups if groups else 1, "topk_group": m.moe_router_group_topk if groups else 1})  # fmt: skip
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **config, "rope_interleave": True,
            "num_nextn_predict_layers": m.mtp_num_layers}  # fmt: skip


# -- tensors --------------------------------------------------------------------------------------

_BIAS = ("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias")
_DEPTH_NORMS = (("enorm", "enorm"), ("hnorm", "hnorm"), ("shared_head.norm", "final_norm"),
                ("input_layernorm", "layer.input_layernorm"), ("post_attention_layernorm", "layer.pre_mlp_layernorm"))  # fmt: skip
_DEPTH_COPIES = (("embed_tokens.weight", "embedding.weight"), ("shared_head.head.weight", "output.weight"))


def _import_v3_layer(t: TensorSource, hf: str, mt: str, m: ModelConfig, is_moe: bool) -> dict[str, torch.Tensor]:
    state = import_layer(t, hf, mt, m, is_moe)
    if is_moe:
        state[mt + _BIAS[1]] = t.take(hf + _BIAS[0], [m.num_experts]).float()
    return state


def _export_v3_layer(state: Mapping[str, torch.Tensor], mt: str, hf: str, m: ModelConfig, is_moe: bool) -> dict[str, torch.Tensor]:
    out = export_layer(state, mt, hf, m, is_moe)
    if is_moe:  # zeros where meshtron trained without the bias: the same choices
        bias = state[mt + _BIAS[1]] if m.moe_router_enable_expert_bias else torch.zeros(m.num_experts)
        out[hf + _BIAS[0]] = bias.float()
    return out


def deepseek_v3_import(t: TensorSource, m: ModelConfig, vocab: int) -> dict[str, torch.Tensor]:
    """meshtron's state dict from the tensors of a ``deepseek_v3`` folder, its prediction depths included."""
    state, pattern, h = import_body(t, m, vocab), moe_layer_pattern(m), m.hidden_size
    for i in range(m.num_layers):
        state.update(_import_v3_layer(t, f"model.layers.{i}.", f"layers.{i}.", m, pattern[i]))
    for k in range(m.mtp_num_layers):
        hf, mt = f"model.layers.{m.num_layers + k}.", f"mtp.{k}."
        state.update(_import_v3_layer(t, hf, mt + "layer.", m, pattern[-1]))
        state.update({f"{mt}{ours}.weight": t.take(f"{hf}{theirs}.weight", [h]) for theirs, ours in _DEPTH_NORMS})
        state[mt + "eh_proj.weight"] = t.take(hf + "eh_proj.weight", [h, 2 * h])
        for theirs, ours in _DEPTH_COPIES:
            main = state.get(ours, state["embedding.weight"])  # a tied model's output layer is its embedding
            if hf + theirs in t.tensors and not torch.equal(t.take(hf + theirs, list(main.shape)), main):
                raise CheckpointError(f"{hf}{theirs} differs from the main model's: meshtron's prediction depths share "
                                      "the embedding and output layer")  # fmt: skip
    return state


def deepseek_v3_export(state: Mapping[str, torch.Tensor], m: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``deepseek_v3_import``, experts one module each, one layer at a time; each
    depth with its copies of the embedding and output layer, as DeepSeek's files hold them."""
    pattern = moe_layer_pattern(m)
    yield from export_body(state, m)
    for i in range(m.num_layers):
        yield from _export_v3_layer(state, f"layers.{i}.", f"model.layers.{i}.", m, pattern[i]).items()
    for k in range(m.mtp_num_layers):
        hf, mt = f"model.layers.{m.num_layers + k}.", f"mtp.{k}."
        yield from _export_v3_layer(state, mt + "layer.", hf, m, pattern[-1]).items()
        yield from ((f"{hf}{theirs}.weight", state[f"{mt}{ours}.weight"]) for theirs, ours in _DEPTH_NORMS)
        yield hf + "eh_proj.weight", state[mt + "eh_proj.weight"]
        for theirs, ours in _DEPTH_COPIES:
            yield hf + theirs, state["embedding.weight" if m.tie_embeddings else ours]
