"""Hugging Face BERT (``BertForMaskedLM``, ``BertForPreTraining``) <-> meshtron's post-LN BERT.

Hugging Face's BERT is the original post-LN transformer: the embedding sum is normalized, then
each layer computes a = LN_a(h + attn(h)) and h' = LN_o(a + mlp(a)). meshtron's post-LN block
(``--apply-residual-connection-post-layernorm``, ``models/decoder.py``) computes n = LN_in(x),
a = n + attn(n), m = LN_mlp(a), x' = m + mlp(m): the same chain with every norm moved one step
earlier, so the mapping is exact (the forward pass gives HF's logits to rounding):

    embeddings.LayerNorm                  -> layers.0.input_layernorm
    layer.l.attention.output.LayerNorm    -> layers.l.pre_mlp_layernorm
    layer.l.output.LayerNorm              -> layers.l+1.input_layernorm (the last layer's: final_norm)

Only training's dropout differs in place: HF drops the normed embedding, meshtron (as Megatron)
the sum before the norm. Megatron's default pre-LN BERT has no HF equivalent and is refused.

Token types: HF's BERT always has ``token_type_embeddings``; the import keeps them
(``bert_tokentypes = type_vocab_size``) with or without the binary head. A meshtron BERT without
token types (no binary head) exports two zero rows: types then change nothing, as in meshtron.
Heads: ``cls.predictions`` (transform dense + LayerNorm, decoder tied to the embedding unless
``tie_word_embeddings`` is false, a bias) is the LM head; the pooler with ``cls.seq_relationship``
(BertForPreTraining) is the pooler with the binary head, imported when the weights hold them
(BertForMaskedLM has neither). QKV: HF's separate query/key/value (with biases) become the fused
``linear_qkv`` rows in meshtron's per-head order (``hf_common.fuse_qkv``).
Vocabulary: the import keeps HF's rows (no padding); the export crops meshtron's padded rows to
the tokenizer's vocabulary (plus ``--extra-vocab-size``), which the checkpoint keeps beside it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from meshtron.config import Config, ModelConfig
from meshtron.data.tokenizers import saved_tokenizer
from meshtron.errors import CheckpointError
from meshtron.layers.attention import head_dim, num_kv_heads
from meshtron.layers.mlp import ffn_hidden_size
from meshtron.models.bert import tokentype_rows
from meshtron.models.hf_common import TensorSource, fuse_qkv, refuse_unexpressible, split_qkv

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_BINARY_HEAD = "cls.seq_relationship.weight"
_LM_HEAD = "cls.predictions.transform.dense.weight"
_EXPORT_TYPES = 2  # the rows written for a model without token types (HF's default type_vocab_size)


# -- configs --------------------------------------------------------------------------------------


def bert_model_config(hf: dict[str, Any], source: str, names: set[str]) -> ModelConfig:
    """meshtron's post-LN BERT for a ``bert`` config.json whose weights hold the tensors ``names``
    (the binary head is on when they hold the pooler and ``cls.seq_relationship``)."""
    refused = {"position_embedding_type": lambda v: v != "absolute", "is_decoder": bool, "add_cross_attention": bool,
               "hidden_act": lambda v: v not in _ACTIVATIONS}  # fmt: skip
    for key, unsupported in refused.items():
        if key in hf and unsupported(hf[key]):
            raise CheckpointError(f"{source}: {key}={hf[key]!r} is not supported by meshtron's BERT")
    if _LM_HEAD not in names:
        raise CheckpointError(f"{source}: the weights have no masked-LM head ({_LM_HEAD}); hf-import reads "
                              "BertForMaskedLM and BertForPreTraining folders")  # fmt: skip
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    return ModelConfig(
        model_type="bert", apply_residual_connection_post_layernorm=True, bert_binary_head=_BINARY_HEAD in names,
        bert_tokentypes=hf.get("type_vocab_size", 2), num_layers=hf["num_hidden_layers"], hidden_size=hidden,
        ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads, kv_channels=hidden // heads,
        vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=1, max_position_embeddings=hf.get("max_position_embeddings", 512),
        normalization="LayerNorm", norm_epsilon=hf.get("layer_norm_eps", 1e-12), activation=_ACTIVATIONS[hf.get("hidden_act", "gelu")],
        position_embedding_type="learned_absolute", add_bias_linear=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1), attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        init_method_std=hf.get("initializer_range", 0.02),
    )  # fmt: skip


def bert_hf_config(m: ModelConfig, vocab_size: int, max_positions: int, dtype_name: str) -> dict[str, Any]:
    """config.json for ``BertForPreTraining`` (binary head) or ``BertForMaskedLM``; refuses what
    HF's BERT cannot express, naming the flag."""
    problems = {
        "a pre-LN BERT (Megatron's default): HF's BERT is post-LN, which meshtron trains with "
        "--apply-residual-connection-post-layernorm": not m.apply_residual_connection_post_layernorm,
        "--normalization RMSNorm": m.normalization != "LayerNorm",
        "--swiglu": m.activation == "swiglu",
        "--disable-bias-linear": not m.add_bias_linear,
        "--num-query-groups (HF's BERT has as many key/value heads as query heads)": num_kv_heads(m) != m.num_attention_heads,
        "--kv-channels other than hidden / heads": head_dim(m) * m.num_attention_heads != m.hidden_size,
    }  # fmt: skip
    refuse_unexpressible("Hugging Face's BERT", problems)
    return {
        "architectures": ["BertForPreTraining" if m.bert_binary_head else "BertForMaskedLM"], "model_type": "bert",
        "vocab_size": vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "intermediate_size": ffn_hidden_size(m),
        "hidden_act": "gelu_pytorch_tanh" if m.activation == "gelu_tanh" else "gelu", "hidden_dropout_prob": m.hidden_dropout,
        "attention_probs_dropout_prob": m.attention_dropout, "max_position_embeddings": max_positions,
        "type_vocab_size": tokentype_rows(m) or _EXPORT_TYPES, "initializer_range": m.init_method_std,
        "layer_norm_eps": m.norm_epsilon, "position_embedding_type": "absolute", "tie_word_embeddings": m.tie_embeddings,
        "torch_dtype": dtype_name,
    }  # fmt: skip


def bert_export_vocab_size(cfg: Config, padded: int, load_dir: Path, tokenizer: dict[str, str]) -> int:
    """The rows an exported BERT keeps: the tokenizer's vocabulary plus ``--extra-vocab-size``
    (or ``--vocab-size`` when larger), as training sized it before padding; all ``padded`` rows
    when the checkpoint has no readable tokenizer and no ``--vocab-size``."""
    m, base = cfg.model, 0
    if tokenizer.get("tokenizer_type") and len(tokenizer) > 1:  # files were copied beside the weights
        try:
            base = saved_tokenizer(load_dir, tokenizer, cfg.data.vocab_extra_ids).vocab_size
        except (OSError, ValueError):
            return padded  # the tokenizer files were not kept beside the weights: nothing tells the real size
        base += m.extra_vocab_size
    return min(padded, max(base, m.vocab_size)) if max(base, m.vocab_size) else padded


def bert_export_tokenizer(load_dir: Path, hf_dir: Path, tokenizer: dict[str, str]) -> None:
    """A WordPiece ``vocab.txt`` (``BertWordPieceLowerCase`` / ``Case``) goes beside the weights
    with the ``tokenizer_config.json`` that makes transformers' ``AutoTokenizer`` a BertTokenizer
    of the same casing."""
    kind, vocab = tokenizer.get("tokenizer_type", ""), tokenizer.get("vocab_file", "")
    if kind not in ("BertWordPieceLowerCase", "BertWordPieceCase") or not (load_dir / vocab).is_file():
        return
    shutil.copy2(load_dir / vocab, hf_dir / "vocab.txt")
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": kind == "BertWordPieceLowerCase"}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def bert_export_notes(m: ModelConfig, padded: int, vocab_size: int) -> list[str]:
    """What the export changes, for the user to read."""
    notes = []
    if not tokentype_rows(m):
        notes.append(f"the model has no token types (no binary head): token_type_embeddings written as {_EXPORT_TYPES} zero "
                     "rows, so token_type_ids change nothing, as in meshtron")  # fmt: skip
    if vocab_size < padded:
        notes.append(f"vocabulary cropped from the {padded} padded rows to the tokenizer's {vocab_size}")
    return notes


# -- tensors --------------------------------------------------------------------------------------


def _pairs(m: ModelConfig) -> list[tuple[str, str]]:
    """(HF name, meshtron name) of every tensor but the fused QKV's, the token types and the
    vocabulary-sized ones."""

    def both(hf: str, mt: str) -> list[tuple[str, str]]:
        return [(f"{hf}.weight", f"{mt}.weight"), (f"{hf}.bias", f"{mt}.bias")]

    pairs = [("bert.embeddings.position_embeddings.weight", "position_embedding.weight")]
    pairs += both("bert.embeddings.LayerNorm", "layers.0.input_layernorm")
    for i in range(m.num_layers):
        hf, mt = f"bert.encoder.layer.{i}.", f"layers.{i}."
        after = f"layers.{i + 1}.input_layernorm" if i + 1 < m.num_layers else "final_norm"
        pairs += both(hf + "attention.output.dense", mt + "self_attention.linear_proj")
        pairs += both(hf + "attention.output.LayerNorm", mt + "pre_mlp_layernorm")
        pairs += both(hf + "intermediate.dense", mt + "mlp.linear_fc1")
        pairs += both(hf + "output.dense", mt + "mlp.linear_fc2")
        pairs += both(hf + "output.LayerNorm", after)
    pairs += both("cls.predictions.transform.dense", "lm_head.dense") + both("cls.predictions.transform.LayerNorm", "lm_head.norm")
    if m.bert_binary_head:
        pairs += both("bert.pooler.dense", "pooler") + both("cls.seq_relationship", "binary_head")
    return pairs


def _vocab_pairs(m: ModelConfig) -> list[tuple[str, str]]:
    """The tensors with a row per token. Untied, transformers 5 adds ``decoder.bias`` (and leaves
    ``cls.predictions.bias`` unused); tied, and always in transformers 4, the two are one tensor."""
    pairs = [("bert.embeddings.word_embeddings.weight", "embedding.weight"), ("cls.predictions.bias", "output.bias")]
    return pairs if m.tie_embeddings else [*pairs, ("cls.predictions.decoder.weight", "output.weight"), ("cls.predictions.decoder.bias", "output.bias")]


def bert_import(t: TensorSource, m: ModelConfig, expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """meshtron's state dict from a BERT folder's tensors; ``expected``: the built model's shapes."""
    bias = "cls.predictions.decoder.bias" if not m.tie_embeddings and "cls.predictions.decoder.bias" in t.tensors else "cls.predictions.bias"
    pairs = [(hf, mt) for hf, mt in _vocab_pairs(m) if mt != "output.bias" or hf == bias]
    state = {mt: t.take(hf, list(expected[mt])) for hf, mt in _pairs(m) + pairs}
    state["tokentype_embedding.weight"] = t.take("bert.embeddings.token_type_embeddings.weight", list(expected["tokentype_embedding.weight"]))
    for name in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "cls.predictions.bias"):
        t.tensors.pop(name, None)  # left over: tied copies of the tensors taken, or transformers 5's unused bias
    h = m.hidden_size
    for i in range(m.num_layers):
        hf, mt = f"bert.encoder.layer.{i}.attention.self.", f"layers.{i}.self_attention.linear_qkv."
        weights = [t.take(f"{hf}{x}.weight", [h, h]) for x in ("query", "key", "value")]
        biases = [t.take(f"{hf}{x}.bias", [h]) for x in ("query", "key", "value")]
        state[mt + "weight"] = fuse_qkv(*weights, m.num_attention_heads)
        state[mt + "bias"] = fuse_qkv(*biases, m.num_attention_heads)
    return state


def bert_export(state: Mapping[str, torch.Tensor], m: ModelConfig, vocab_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``bert_import`` (``BertForPreTraining``'s / ``BertForMaskedLM``'s names),
    the vocabulary cropped to ``vocab_size`` rows, one tensor at a time."""
    for hf, mt in _pairs(m):
        yield hf, state[mt]
    for hf, mt in _vocab_pairs(m):
        yield hf, state[mt][:vocab_size].clone()  # untied: one bias saved twice; the crop keeps no padded rows alive
    types = state.get("tokentype_embedding.weight")  # zero rows in the export's dtype, read off a small tensor
    yield "bert.embeddings.token_type_embeddings.weight", types if types is not None else state["final_norm.weight"].new_zeros(_EXPORT_TYPES, m.hidden_size)
    for i in range(m.num_layers):
        hf, mt = f"bert.encoder.layer.{i}.attention.self.", f"layers.{i}.self_attention.linear_qkv."
        for kind in ("weight", "bias"):
            q, k, v = split_qkv(state[mt + kind], m.num_attention_heads, m.num_attention_heads)
            yield from {f"{hf}query.{kind}": q, f"{hf}key.{kind}": k, f"{hf}value.{kind}": v}.items()


def bert_hf_export(weights: Mapping[str, torch.Tensor], cfg: Config, meta: dict[str, Any], load_dir: Path, dtype: torch.dtype,
                   max_positions: int) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:  # fmt: skip
    """BERT's ``hf_export`` hook: ``BertForPreTraining`` / ``BertForMaskedLM``, the vocabulary
    cropped to its tokenizer's (``bert_export_vocab_size``), what changed printed."""
    m = cfg.model
    vocab = bert_export_vocab_size(cfg, meta["vocab_size"], load_dir, meta.get("tokenizer", {}))
    for note in bert_export_notes(m, meta["vocab_size"], vocab):
        print(f"hf-export: {note}")
    return bert_hf_config(m, vocab, max_positions, str(dtype).removeprefix("torch.")), bert_export(weights, m, vocab)
