"""Megatron-LM's model: its ``args`` as a ``ModelConfig`` and its tensor names as meshtron's.

meshtron's decoder keeps Megatron-Core's local-spec names (``layers.N.self_attention.linear_qkv``,
``mlp.linear_fc1`` = [gate | up], the per-group QKV order, rotate-half RoPE), so most tensors map
by name alone. What differs:

* the top level: ``embedding.word_embeddings`` / ``embedding.position_embeddings`` /
  ``decoder.final_layernorm`` / ``output_layer`` are meshtron's ``embedding`` /
  ``position_embedding`` / ``final_norm`` / ``output``;
* the norms: ``torch_dist`` (and Transformer Engine's spec) store ``input_layernorm`` as
  ``self_attention.linear_qkv.layer_norm_weight`` and ``pre_mlp_layernorm`` as
  ``mlp.linear_fc1.layer_norm_weight``;
* experts: Megatron's SequentialMLP holds ``mlp.experts.local_experts.K.linear_fc1.weight`` per
  expert (``torch_dist``: ``mlp.experts.experts.linear_fc1.weight`` with an expert axis); meshtron
  stacks them as ``mlp.experts.weight1`` [E, 2f, h] and ``weight2`` [E, h, f]. Grouped experts
  write SequentialMLP's torch_dist keys (their ``sharded_state_dict`` says so); their legacy state
  differs: Transformer Engine's ``mlp.experts.linear_fc1.weightK`` per local expert, the older
  GroupedMLP's ``mlp.experts.weight1`` [h, experts*2f] and ``weight2`` [experts*f, h], unpacked
  by ``legacy_pieces`` as that module's own ``view(experts, h, -1)`` reads them;
* latent attention (MLA): the submodules carry Megatron's names; TE's spec fuses the latent norms
  into the up-projections after them (``LATENT_NORMS``) and keeps the input norm apart, the local
  spec fuses nothing; the local spec splits the down-projections' rows over tp, TE's keeps them
  whole on every rank;
* older checkpoints (``language_model.encoder.*``) use the pre-Core names, renamed here;
* BERT and T5 (``Naming``): BERT's one stack is ``encoder.layers``, its heads ``lm_head.dense`` /
  ``lm_head.layer_norm`` / ``output_layer.bias`` / ``pooler.dense`` / ``binary_head`` and its token
  types ``embedding.tokentype_embeddings``; T5 stacks ``encoder.layers`` then ``decoder.layers``
  (meshtron's layers in that order), each with its ``final_layernorm`` (the encoder's is meshtron's
  last encoder block's ``final_norm``), the head's bias ``lm_head.output_layer.bias``. The family is
  told by the stacks a checkpoint holds (``megatron_family``).

The legacy ``torch`` format stores each tensor-parallel rank's shard; ``merge_tp`` joins them by
the rule of the layer that split them (vocabulary and QKV rows, SwiGLU's halves, row-parallel
columns), replicated tensors are taken from rank 0; ``split_tp`` cuts them again for an export.
``dist_state`` / ``legacy_state`` name a whole model the way Megatron's loader asks for it, each
linear's ``_extra_state`` entry included.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from meshtron.config import ModelConfig, encoder_decoder_layers
from meshtron.errors import CheckpointError
from meshtron.layers.rope import yarn_attention_factor, yarn_mscale

TOP = {"embedding.weight": "embedding.word_embeddings.weight", "position_embedding.weight": "embedding.position_embeddings.weight",
       "final_norm.weight": "decoder.final_layernorm.weight", "final_norm.bias": "decoder.final_layernorm.bias",
       "output.weight": "output_layer.weight"}  # fmt: skip
# meshtron's per-layer norm names -> the fused names torch_dist stores them under.
FUSED_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
# MLA's latent norms -> the up-projections Transformer Engine's spec fuses them into.
LATENT_NORMS = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}  # fmt: skip
ALL_FUSED = {**FUSED_NORMS, **LATENT_NORMS}
EXPERTS = {"mlp.experts.weight1": "linear_fc1.weight", "mlp.experts.weight2": "linear_fc2.weight"}
_STACKED = {v: k for k, v in EXPERTS.items()}
# The linear layers, each with an ``_extra_state`` entry Megatron's loader asks for.
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
           "linear_kv_down_proj", "linear_kv_up_proj")  # fmt: skip
# MLA's down-projections: column-parallel rows in the local spec, whole on every rank in TE's.
LATENT_DOWN = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
# Megatron's MLATransformerConfig defaults for the YaRN fields no Megatron arg of that name sets.
MLA_YARN_DEFAULTS = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
# Pre-Core names (``language_model.*``) -> Core's.
_OLD_TOP = {"language_model.embedding.word_embeddings.": "embedding.word_embeddings.",
            "language_model.embedding.position_embeddings.": "embedding.position_embeddings.",
            "language_model.encoder.final_layernorm.": "decoder.final_layernorm.", "language_model.output_layer.": "output_layer.",
            "language_model.encoder.layers.": "decoder.layers."}  # fmt: skip
_OLD_LAYER = {"self_attention.query_key_value.": "self_attention.linear_qkv.", "self_attention.dense.": "self_attention.linear_proj.",
              "post_attention_layernorm.": "pre_mlp_layernorm.", "mlp.dense_h_to_4h.": "mlp.linear_fc1.",
              "mlp.dense_4h_to_h.": "mlp.linear_fc2."}  # fmt: skip
# A legacy expert tensor: SequentialMLP's (local expert first) or TE's grouped linear's (last).
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)")
_TE_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12]\.weight)(\d+)")
_LAYER = re.compile(r"((?:en|de)coder\.layers\.)(\d+)\.(.+)")  # a legacy layer key: its stack, local number, the rest
# BERT's tensors outside its layers (meshtron's name -> Megatron-Core's), beside the embeddings
_BERT_TOP = {"tokentype_embedding.weight": "embedding.tokentype_embeddings.weight", "final_norm.weight": "encoder.final_layernorm.weight",
             "final_norm.bias": "encoder.final_layernorm.bias", "lm_head.dense.weight": "lm_head.dense.weight",
             "lm_head.dense.bias": "lm_head.dense.bias", "lm_head.norm.weight": "lm_head.layer_norm.weight",
             "lm_head.norm.bias": "lm_head.layer_norm.bias", "output.bias": "output_layer.bias", "pooler.weight": "pooler.dense.weight",
             "pooler.bias": "pooler.dense.bias", "binary_head.weight": "binary_head.weight", "binary_head.bias": "binary_head.bias"}  # fmt: skip


@dataclass(frozen=True)
class Naming:
    """Where a Megatron model family keeps its tensors: the ones outside its layers (meshtron's name
    -> Megatron's), its layer stacks in meshtron's layer order (Megatron's prefix and layer count,
    None: all), and the keys that repeat another tensor of the model (read once, under the other)."""

    top: dict[str, str]
    stacks: tuple[tuple[str, int | None], ...] = (("decoder.layers.", None),)
    aliases: tuple[str, ...] = ()

    def megatron_layer(self, layer: int) -> tuple[str, int]:
        """The stack prefix and local number of meshtron's layer ``layer``."""
        for prefix, count in self.stacks:
            if count is None or layer < count:
                return prefix, layer
            layer -= count
        raise CheckpointError(f"meshtron layer {layer} lies beyond the model's Megatron stacks {self.stacks}")

    def meshtron_layer(self, prefix: str, local: int) -> int:
        """meshtron's layer of layer ``local`` of Megatron's stack ``prefix``."""
        first = 0
        for stack, count in self.stacks:
            if stack == prefix:
                return first + local
            first += count or 0
        raise CheckpointError(f"Megatron tensors under {prefix} have no place in this model (its stacks: {[p for p, _ in self.stacks]})")


GPT_NAMING = Naming(TOP)


# -- config ---------------------------------------------------------------------------------------


def _choice(args: dict[str, Any], field: str, allowed: tuple, source: str) -> Any:
    value = args.get(field)
    if value not in allowed:
        raise CheckpointError(f"{source}: args.{field} = {value!r} is not supported; meshtron reads {', '.join(map(repr, allowed))}")
    return value


def megatron_family(keys: Iterable[str]) -> str:
    """The model family of a checkpoint holding tensors ``keys``: T5 stacks an encoder and a
    decoder, BERT an encoder (Megatron-Core's ``BertModel.encoder``), GPT a decoder; ``legacy-gpt``
    for the pre-Core model's ``language_model.*`` names."""
    keys = list(keys)
    if any(key.startswith("language_model.") for key in keys):
        return "legacy-gpt"
    stacks = {key.split(".", 1)[0] for key in keys if key.startswith(("encoder.layers.", "decoder.layers."))}
    return "t5" if stacks == {"encoder", "decoder"} else "bert" if stacks == {"encoder"} else "gpt"


def naming(m: ModelConfig) -> Naming:
    """Megatron-Core's names for model ``m``'s family."""
    if m.model_type == "bert":
        return Naming({**TOP, **_BERT_TOP}, (("encoder.layers.", None),))
    if m.model_type == "t5":
        encoder, decoder = encoder_decoder_layers(m)
        top = {"embedding.weight": TOP["embedding.weight"], "position_embedding.weight": TOP["position_embedding.weight"],
               **{f"layers.{encoder - 1}.final_norm.{leaf}": f"encoder.final_layernorm.{leaf}" for leaf in ("weight", "bias")},
               **{f"final_norm.{leaf}": f"decoder.final_layernorm.{leaf}" for leaf in ("weight", "bias")},
               "output.weight": "lm_head.output_layer.weight", "output.bias": "lm_head.output_layer.bias"}  # fmt: skip
        # T5Model also registers the position table and the head's output layer under their own names
        return Naming(top, (("encoder.layers.", encoder), ("decoder.layers.", decoder)),
                      ("position_embeddings.weight", "output_layer.weight", "output_layer.bias"))  # fmt: skip
    return GPT_NAMING


def model_config_from_args(args: dict[str, Any], source: str, family: str = "gpt") -> ModelConfig:
    """The meshtron model a Megatron run's ``args`` describe (a ``family`` of ``megatron_family``),
    from the fields that define the model only; a value meshtron does not implement is refused,
    naming the field. ``apply_residual_connection_post_layernorm`` is read for the pre-Core model
    only: Megatron-Core's TransformerLayer takes the flag into its config and never reads it, so a
    Core checkpoint saved with it ran pre-LN. Norm gains stored centred on 0 (``apply_layernorm_1p``,
    ``layernorm_zero_centered_gamma``) describe the same model: the importer adds 1
    (``zero_centred_gains``)."""
    for field, must in (("rotary_interleaved", False), ("mla_down_proj_fusion", False), ("use_rope_scaling", False), ("moe_single_grouped_weight", False),
                        ("moe_single_grouped_bias", False), ("moe_mlp_glu_interleave_size", None),
                        ("moe_shared_expert_gate", False), ("squared_relu", False), ("mtp_num_layers", None),
                        ("heterogeneous_layers_config_path", None), ("hybrid_layer_pattern", None), ("qk_l2_norm", False),
                        ("softmax_type", "vanilla")):  # fmt: skip
        if field in args and args[field] not in (must, None if must is False else must):
            raise CheckpointError(f"{source}: args.{field} = {args[field]!r} is not supported by megatron-import (only {must!r})")
    missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size") if not isinstance(args.get(f), int)]
    if missing:
        raise CheckpointError(f"{source}: args lacks the model fields {missing}; is this a Megatron-LM GPT checkpoint?")
    normalization = _choice(args, "normalization", ("LayerNorm", "RMSNorm"), source)
    mla = bool(args.get("multi_latent_attention"))  # brings its own RoPE, under the model's type rope or none
    positions = _choice(args, "position_embedding_type", ("rope", "none") if mla else ("rope", "learned_absolute"), source)
    epsilon = args.get("norm_epsilon", args.get("layernorm_epsilon", 1e-5))
    activation = "swiglu" if args.get("swiglu") else "gelu_tanh" if args.get("openai_gelu") else "gelu"
    experts = args.get("num_experts") or 0
    m = ModelConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args.get("ffn_hidden_size") or 0,
        num_attention_heads=args["num_attention_heads"],
        num_query_groups=args["num_query_groups"] if args.get("group_query_attention") else 0,
        kv_channels=args.get("kv_channels") or 0, vocab_size=args["padded_vocab_size"], make_vocab_size_divisible_by=1,
        max_position_embeddings=args.get("max_position_embeddings") or args.get("seq_length"), normalization=normalization,
        norm_epsilon=float(epsilon), activation=activation, position_embedding_type="rope" if mla else positions,
        rotary_base=int(args.get("rotary_base", 10000)), rotary_percent=float(args.get("rotary_percent", 1.0)),
        add_bias_linear=bool(args.get("add_bias_linear", True)), add_qkv_bias=bool(args.get("add_qkv_bias", False)),
        tie_embeddings=not args.get("untie_embeddings_and_output_weights", False),
        apply_residual_connection_post_layernorm=family == "legacy-gpt" and bool(args.get("apply_residual_connection_post_layernorm")),
        qk_layernorm=bool(args.get("qk_layernorm", False)), attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    if mla:
        for field, value in _mla_fields(args, source).items():
            setattr(m, field, value)
    if experts:
        if str(args.get("moe_layer_freq", 1)) != "1":
            raise CheckpointError(f"{source}: args.moe_layer_freq = {args['moe_layer_freq']!r}: megatron-import reads models whose "
                                  "every layer is MoE (1) only")  # fmt: skip
        _choice(args, "moe_router_score_function", ("softmax", "sigmoid"), source)
        _choice(args, "moe_router_load_balancing_type", ("aux_loss", "seq_aux_loss", "none", "sinkhorn"), source)
        m.num_experts, m.moe_router_topk = experts, args["moe_router_topk"]
        m.moe_ffn_hidden_size = args.get("moe_ffn_hidden_size") or m.ffn_hidden_size
        m.moe_shared_expert_intermediate_size = args.get("moe_shared_expert_intermediate_size") or 0
        m.moe_router_load_balancing_type = args["moe_router_load_balancing_type"]
        m.moe_router_score_function = args["moe_router_score_function"]
        m.moe_router_pre_softmax = bool(args.get("moe_router_pre_softmax", False))
        m.moe_router_topk_scaling_factor = float(args.get("moe_router_topk_scaling_factor") or 1.0)
        m.moe_aux_loss_coeff = float(args.get("moe_aux_loss_coeff") or 0.0)
        m.moe_z_loss_coeff = float(args.get("moe_z_loss_coeff") or 0.0)
        m.moe_router_enable_expert_bias = bool(args.get("moe_router_enable_expert_bias", False))
        m.moe_router_num_groups = args.get("moe_router_num_groups") or 0
        m.moe_router_group_topk = args.get("moe_router_group_topk") or 0
        m.moe_router_dtype = _choice(args, "moe_router_dtype", (None, "fp32", "fp64"), source) or ""
    if family in ("bert", "t5"):
        _encoder_fields(m, args, family, source)
    return m


def _encoder_fields(m: ModelConfig, args: dict[str, Any], family: str, source: str) -> None:
    """BERT's and T5's fields, in place: Megatron's ``pretrain_bert.py`` builds token types and the
    sentence-order head with ``bert_binary_head``; ``pretrain_t5.py`` its two stacks from
    ``encoder_num_layers`` / ``decoder_num_layers`` and a vocabulary bias only on a tied head."""
    if m.num_experts or m.multi_latent_attention:
        raise CheckpointError(f"{source}: a {family.upper()} checkpoint with experts or latent attention is not read by megatron-import")
    if m.position_embedding_type != "learned_absolute":
        raise CheckpointError(f"{source}: args.position_embedding_type = {m.position_embedding_type!r}: megatron-import reads "
                              f"{family.upper()} with learned absolute positions only")  # fmt: skip
    m.model_type = family
    if family == "bert":
        m.bert_binary_head = bool(args.get("bert_binary_head", True))
        return
    if not m.tie_embeddings:
        raise CheckpointError(f"{source}: args.untie_embeddings_and_output_weights: Megatron's untied T5 head has no vocabulary "
                              "bias, meshtron's T5 has; megatron-import reads tied T5 checkpoints only")  # fmt: skip
    m.encoder_num_layers = int(args.get("encoder_num_layers") or m.num_layers)
    m.decoder_num_layers = int(args.get("decoder_num_layers") or m.num_layers)


def _mla_fields(args: dict[str, Any], source: str) -> dict[str, Any]:
    """MLA's model fields. Megatron builds its MLATransformerConfig from ``args`` by field name:
    ``rope_type`` unset means YaRN there, and the YaRN context and betas keep the config's defaults
    (``MLA_YARN_DEFAULTS``: Megatron-Core 0.19 has no args of those names; its ``--yarn-*`` flags
    serve GPT's YaRN, not MLA). Megatron scales attention by YaRN's ``mscale_all_dim`` temperature
    squared whatever the rope type, meshtron under YaRN only: a pair of values where the two
    differ is refused rather than imported to other logits."""
    rope_type = _choice(args, "rope_type", (None, "rope", "yarn"), source) or "yarn"
    factor = float(args.get("rotary_scaling_factor") or 1.0)
    mscale, mscale_all_dim = float(args.get("mscale", 1.0)), float(args.get("mscale_all_dim", 0.0))
    yarn = rope_type == "yarn" and factor != 1.0
    tables = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if rope_type == "yarn" else 1.0
    mine = yarn_attention_factor(factor, mscale, mscale_all_dim) if yarn else 1.0
    if not math.isclose(tables, mine) or (not yarn and yarn_mscale(factor, mscale_all_dim) != 1.0):
        raise CheckpointError(f"{source}: args.rope_type = {rope_type!r} with rotary_scaling_factor {factor}, mscale {mscale}, "
                              f"mscale_all_dim {mscale_all_dim}: Megatron's MLA scales its rotary tables or attention unlike "
                              "meshtron's YaRN there; megatron-import does not read that combination")  # fmt: skip
    defaults = {k: args.get(k) or v for k, v in MLA_YARN_DEFAULTS.items()}
    return {"multi_latent_attention": True, "q_lora_rank": args.get("q_lora_rank") or 0, "kv_lora_rank": args["kv_lora_rank"],
            "qk_head_dim": args["qk_head_dim"], "qk_pos_emb_head_dim": args["qk_pos_emb_head_dim"], "v_head_dim": args["v_head_dim"],
            "kv_channels": 0, "num_query_groups": 0, "rope_scaling": "yarn" if yarn else "", "rope_scaling_factor": factor,
            "rope_original_max_position_embeddings": int(defaults["original_max_position_embeddings"]),
            "rope_beta_fast": float(defaults["beta_fast"]), "rope_beta_slow": float(defaults["beta_slow"]),
            "rope_mscale": mscale, "rope_mscale_all_dim": mscale_all_dim}  # fmt: skip


def args_from_model(m: ModelConfig, vocab_size: int, seq_length: int) -> dict[str, Any]:
    """The model-defining ``args`` fields Megatron-LM checks when it loads a checkpoint."""
    heads = m.num_attention_heads
    args = {"num_layers": m.num_layers, "hidden_size": m.hidden_size, "ffn_hidden_size": m.ffn_hidden_size,
            "num_attention_heads": heads, "group_query_attention": bool(m.num_query_groups) and m.num_query_groups != heads,
            "num_query_groups": m.num_query_groups or heads, "kv_channels": m.kv_channels or m.hidden_size // heads,
            "padded_vocab_size": vocab_size, "max_position_embeddings": m.max_position_embeddings, "seq_length": seq_length,
            "normalization": m.normalization, "norm_epsilon": m.norm_epsilon, "layernorm_epsilon": m.norm_epsilon,
            "swiglu": m.activation == "swiglu", "openai_gelu": m.activation == "gelu_tanh",
            "position_embedding_type": m.position_embedding_type, "rotary_base": m.rotary_base, "rotary_percent": m.rotary_percent,
            "add_bias_linear": m.add_bias_linear, "add_qkv_bias": m.add_qkv_bias, "untie_embeddings_and_output_weights": not m.tie_embeddings,
            "apply_residual_connection_post_layernorm": m.apply_residual_connection_post_layernorm, "qk_layernorm": m.qk_layernorm,
            "num_experts": m.num_experts or None}  # fmt: skip
    if m.multi_latent_attention:  # kv_channels: the local spec's core attention sizes its output by it
        yarn = m.rope_scaling == "yarn"
        args.update(multi_latent_attention=True, group_query_attention=False, q_lora_rank=m.q_lora_rank or None,
                    kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
                    v_head_dim=m.v_head_dim, kv_channels=m.v_head_dim, rope_type="yarn" if yarn else "rope",
                    rotary_scaling_factor=m.rope_scaling_factor if yarn else 1.0, mscale=m.rope_mscale, mscale_all_dim=m.rope_mscale_all_dim)  # fmt: skip
    if m.num_experts:
        args.update(moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
                    moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size or None,
                    moe_router_load_balancing_type=m.moe_router_load_balancing_type, moe_router_score_function=m.moe_router_score_function,
                    moe_router_pre_softmax=m.moe_router_pre_softmax, moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
                    moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
                    moe_layer_freq=1, moe_grouped_gemm=False)  # fmt: skip
    return args


def check_exportable(m: ModelConfig) -> None:
    """Refuse what has no Megatron-Core GPT equivalent written here."""
    if m.model_type != "gpt":
        raise CheckpointError(f"megatron-export writes GPT decoders; this checkpoint holds a '{m.model_type}' model")
    if m.apply_residual_connection_post_layernorm:
        raise CheckpointError("megatron-export: a post-LN model (--apply-residual-connection-post-layernorm) would run pre-LN in "
                              "Megatron-Core, whose TransformerLayer does not read that flag")  # fmt: skip
    if m.position_embedding_type not in ("rope", "learned_absolute") or m.rope_scaling not in ("", "yarn" if m.multi_latent_attention else ""):
        raise CheckpointError("megatron-export: relative positions and RoPE scaling (but latent attention's YaRN) are not mapped to "
                              "Megatron names here")  # fmt: skip
    if m.multi_latent_attention:  # what Megatron's MLA reads back from the args written
        back = _mla_fields(args_from_model(m, 1, 1), "megatron-export")
        lost = [f for f, v in back.items() if getattr(m, f) != v and (m.rope_scaling or not f.startswith("rope_"))]
        if lost:
            raise CheckpointError(f"megatron-export: Megatron's latent attention would read {', '.join(lost)} otherwise "
                                  f"({', '.join(f'{f} {back[f]!r}' for f in lost)}): its MLA takes no args for them")  # fmt: skip
    if m.num_experts and (m.moe_shared_expert_gate or str(m.moe_layer_freq) != "1"):
        raise CheckpointError("megatron-export: a shared-expert gate or dense layers between MoE layers are not mapped here")
    if m.mtp_num_layers:
        raise CheckpointError("megatron-export: multi-token prediction depths (--mtp-num-layers) are not mapped to Megatron-Core's "
                              "mtp.layers names here")  # fmt: skip


# -- names ----------------------------------------------------------------------------------------


def fused_norms(ckpt_format: str, transformer_impl: str, moe: bool, mla: bool = False) -> dict[str, str]:
    """The per-layer norms a Megatron spec stores under the linear they precede (``ALL_FUSED``'s
    subset): the local spec maps both block norms in torch_dist (its sharded-state-dict key map;
    none for MLA, whose local layer has no map) and neither in its legacy state dict; Transformer
    Engine's fuses the input norm into ``linear_qkv`` (MLA's stays apart, its latent norms go into
    the up-projections) and the pre-MLP norm into ``linear_fc1`` when the MLP is dense (an MoE
    layer keeps its own norm)."""
    if transformer_impl == "local":
        return dict(FUSED_NORMS) if ckpt_format == "torch_dist" and not mla else {}
    fused = {k: v for k, v in FUSED_NORMS.items() if not (moe and k == "pre_mlp_layernorm.") and not (mla and k == "input_layernorm.")}
    return {**fused, **LATENT_NORMS} if mla else fused


def layer_key(rest: str, fused: dict[str, str]) -> str:
    """A layer's tensor ``rest`` (meshtron's name after ``layers.N.``) under Megatron's name, the
    norms in ``fused`` renamed to their fused names (experts are named by the caller)."""
    for norm, name in fused.items():
        if rest.startswith(norm):
            return name + rest[len(norm) :]
    return rest


def dist_key(name: str, fused: dict[str, str] = FUSED_NORMS, names: Naming = GPT_NAMING) -> tuple[str, int | None]:
    """The torch_dist key of meshtron tensor ``name`` and its layer in its stack (the key's leading
    axis), or None."""
    if name in names.top:
        return names.top[name], None
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if not match:
        raise CheckpointError(f"meshtron tensor {name} has no Megatron name")
    (prefix, layer), rest = names.megatron_layer(int(match.group(1))), match.group(2)
    rest = "mlp.experts.experts." + EXPERTS[rest] if rest in EXPERTS else layer_key(rest, fused)
    return prefix + rest, layer


def dist_candidates(name: str, names: Naming = GPT_NAMING) -> tuple[list[str], int | None]:
    """``dist_key``'s key (any spec's fused norm name), then the unfused one a layer may be stored under."""
    key, layer = dist_key(name, ALL_FUSED, names)
    return ([key] if layer is None else [key, dist_key(name, {}, names)[0]]), layer


def _is_linear(module: str) -> bool:
    return module.rpartition(".")[2] in LINEARS


def dist_state(weights: dict[str, torch.Tensor], m: ModelConfig, fused: dict[str, str]) -> dict[str, Any]:
    """The torch_dist state: Megatron's keys, layers stacked, and each linear's ``_extra_state``
    object (one per layer, and per expert for the stacked experts), Megatron-Core's ``[None]``."""
    state: dict[str, Any] = {}
    layers: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor in weights.items():
        key, layer = dist_key(name, fused)
        if layer is None:
            state[key] = tensor
        else:
            layers.setdefault(key, [None] * m.num_layers)[layer] = tensor
    for key, per_layer in layers.items():
        state[key] = torch.stack(per_layer)
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and _is_linear(module):
            grid = state[key].shape[:2] if ".experts.experts." in key else state[key].shape[:1]
            for index in itertools.product(*map(range, grid)):
                state[f"{module}._extra_state/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, grid))}"] = [None]
    return state


def legacy_state(weights: dict[str, torch.Tensor], m: ModelConfig, layout: tuple[int, int, int], rank: tuple[int, int, int],
                 fused: dict[str, str], impl: str) -> dict[str, Any]:  # fmt: skip
    """The ``model`` state dict of legacy rank ``rank`` = (tp, pp, ep) of ``layout``: its shards,
    its stage's layers numbered from 0, its expert rank's experts, ``_extra_state`` set to None."""
    (tp, pp, ep), (t, p, e) = layout, rank
    per_stage, local_experts = m.num_layers // pp, (m.num_experts or 0) // ep
    first, last = p == 0, p == pp - 1
    model: dict[str, Any] = {}
    for name, tensor in weights.items():
        match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if match is None:
            if (last if name.startswith(("final_norm.", "output.")) else first):
                model[TOP[name]] = split_tp(name, tensor, m, tp, impl)[t]
            continue
        layer, rest = int(match.group(1)), match.group(2)
        if layer // per_stage != p:
            continue
        prefix = f"decoder.layers.{layer % per_stage}."
        if rest in EXPERTS:
            for k in range(local_experts):
                model[f"{prefix}mlp.experts.local_experts.{k}.{EXPERTS[rest]}"] = split_tp(name, tensor[e * local_experts + k], m, tp, impl)[t]
        else:
            model[prefix + layer_key(rest, fused)] = split_tp(name, tensor, m, tp, impl)[t]
    if last and m.tie_embeddings and pp > 1:  # the last stage's own copy of the shared embedding
        model[TOP["output.weight"]] = split_tp("output.weight", weights["embedding.weight"], m, tp, impl)[t]
    modules = {key.rpartition(".")[0] for key in model if _is_linear(key.rpartition(".")[0])}
    if impl == "transformer_engine":
        modules |= {f"decoder.layers.{i}.self_attention.core_attention" for i in range(per_stage)}
    if last:
        modules.add("output_layer")
    model.update({f"{module}._extra_state": None for module in sorted(modules)})
    return model


def legacy_name(key: str) -> str:
    """A Megatron state-dict key in Core's unfused names (pre-Core and fused-norm names renamed)."""
    for old, new in _OLD_TOP.items():
        if key.startswith(old):
            key = new + key[len(old) :]
    match = _LAYER.fullmatch(key)
    if not match:
        return key
    rest = match.group(3)
    for old, new in _OLD_LAYER.items():
        if rest.startswith(old):
            rest = new + rest[len(old) :]
    for norm, fused in ALL_FUSED.items():
        if rest.startswith(fused):
            rest = norm + rest[len(fused) :]
    return f"{match.group(1)}{match.group(2)}.{rest}"


def meshtron_name(key: str, layer_offset: int, names: Naming = GPT_NAMING) -> tuple[str, int | None]:
    """meshtron's name for legacy key ``key`` (after ``legacy_name``) of a stage whose first layer
    (in its stack) is ``layer_offset``, and the local expert index for a SequentialMLP expert's tensor."""
    for mt, mg in names.top.items():
        if key == mg:
            return mt, None
    match = _LAYER.fullmatch(key)
    if not match:
        raise CheckpointError(f"Megatron tensor {key} has no meshtron equivalent")
    layer, rest = names.meshtron_layer(match.group(1), int(match.group(2)) + layer_offset), match.group(3)
    if sequential := _LOCAL_EXPERT.fullmatch(rest):
        index, linear = int(sequential.group(1)), sequential.group(2)
    elif grouped := _TE_EXPERT.fullmatch(rest):
        index, linear = int(grouped.group(2)), grouped.group(1)
    else:
        return f"layers.{layer}.{rest}", None
    return f"layers.{layer}.{_STACKED[linear]}", index


def legacy_pieces(key: str, tensor: torch.Tensor, layer_offset: int, m: ModelConfig, local_experts: int, names: Naming = GPT_NAMING,
                  ) -> Iterator[tuple[str, int | None, torch.Tensor]]:  # fmt: skip
    """``meshtron_name``'s name and local expert for legacy ``key``, with its tensor; a GroupedMLP's
    packed ``mlp.experts.weight1`` [h, experts*fc1] / ``weight2`` [experts*f, h] (its name is
    meshtron's, its layout is not) gives one piece per local expert, read as that module's forward
    reads it (``view(experts, h, -1)`` / ``view(experts, -1, h)``), each [in, out] transposed to the
    [out, in] of SequentialMLP's shard of that expert. A key in ``names.aliases`` gives nothing."""
    if key in names.aliases:
        return
    name, expert = meshtron_name(legacy_name(key), layer_offset, names)
    if expert is not None or not name.endswith(tuple(EXPERTS)):
        yield name, expert, tensor
        return
    h = m.hidden_size
    packed = tensor.reshape(local_experts, h, -1) if name.endswith("weight1") else tensor.reshape(local_experts, -1, h)
    for index, piece in enumerate(packed.transpose(-1, -2)):
        yield name, index, piece


def layer_count(keys: list[str]) -> int:
    """How many layers a stage's legacy state dict holds (local numbers 0..n-1 in each stack)."""
    stacks: dict[str, set[int]] = {}
    for key in keys:
        if match := _LAYER.match(key):
            stacks.setdefault(match.group(1), set()).add(int(match.group(2)))
    for stack, numbers in stacks.items():
        if numbers != set(range(len(numbers))):
            raise CheckpointError(f"{stack} layer numbers {sorted(numbers)} are not 0..{len(numbers) - 1}")
    return sum(map(len, stacks.values()))


def _tp_rule(name: str, m: ModelConfig, impl: str) -> str | None:
    """How the layer of tensor ``name`` splits it over tensor-parallel ranks under spec ``impl``:
    ``rows`` (vocabulary, QKV in its per-group order, MLA's whole heads, the local spec's MLA
    down-projections), ``halves`` (SwiGLU's [gate | up] rows, each half split), ``columns``
    (row-parallel layers), or None (every rank holds it whole)."""
    if name.endswith(LATENT_DOWN):
        return "rows" if impl == "local" else None
    if name in ("embedding.weight", "output.weight", "output.bias") or name.endswith(
            ("linear_qkv.weight", "linear_qkv.bias", "linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight",
             "cross_attention.linear_q.weight", "cross_attention.linear_q.bias", "cross_attention.linear_kv.weight",
             "cross_attention.linear_kv.bias")):  # fmt: skip
        return "rows"
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias", "experts.weight1")):
        return "halves" if m.activation == "swiglu" else "rows"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight", "experts.weight2")):
        return "columns"
    return None


def merge_tp(name: str, pieces: list[torch.Tensor], m: ModelConfig, impl: str = "local") -> torch.Tensor:
    """The global tensor ``name`` from its tensor-parallel shards (rank order), by the rule of the
    layer that split it; a replicated tensor must be equal on every rank."""
    if len(pieces) == 1:
        return pieces[0]
    rule = _tp_rule(name, m, impl)
    if rule == "halves":
        halves = [p.chunk(2, 0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    if rule is not None:
        return torch.cat(pieces, 1 if rule == "columns" else 0)
    if any(not torch.equal(pieces[0], p) for p in pieces[1:]):
        raise CheckpointError(f"{name} differs between tensor-parallel ranks, but meshtron's model replicates it")
    return pieces[0]


def split_tp(name: str, tensor: torch.Tensor, m: ModelConfig, tp: int, impl: str = "local") -> list[torch.Tensor]:
    """``merge_tp``'s inverse: the ``tp`` shards of global tensor ``name``, each its own copy (a
    saved view would carry the whole tensor's storage)."""
    rule = _tp_rule(name, m, impl)
    if rule is None or tp == 1:
        return [tensor.clone()] * tp
    dim = 1 if rule == "columns" else 0
    size = tensor.shape[dim] // (2 if rule == "halves" else 1)
    if size % tp:
        raise CheckpointError(f"megatron-export: {name} has {size} {'columns' if dim else 'rows'} per part, not divisible by tp {tp}")
    if rule == "halves":
        gate, up = (h.chunk(tp, 0) for h in tensor.chunk(2, 0))
        return [torch.cat([g, u], 0) for g, u in zip(gate, up, strict=True)]
    return [piece.clone() for piece in tensor.chunk(tp, dim)]


def zero_centred_gains(args: dict[str, Any]) -> bool:
    """Whether a Megatron run stored its norm gains centred on 0 (``--apply-layernorm-1p``, or
    Transformer Engine's ``layernorm_zero_centered_gamma``): each applies as 1 + the stored value."""
    return bool(args.get("apply_layernorm_1p") or args.get("layernorm_zero_centered_gamma"))
