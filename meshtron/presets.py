"""Named model shapes (``[model] preset = "llama3-8b"`` or ``--model.preset llama3-8b``).

A preset is a set of dotted config fields applied before the config file and the command line,
so any field can still be overridden. Shapes follow the published models; ``vocab_size`` is set
where the preset implies a tokenizer, and ``data.seq_length`` is the model's training context.
"""

from __future__ import annotations

from typing import Any

from meshtron.errors import ConfigError, unknown_name


def _shape(layers: int, hidden: int, heads: int, kv_heads: int = 0, ffn: int = 0) -> dict[str, Any]:
    return {
        "model.num_layers": layers,
        "model.hidden_size": hidden,
        "model.num_attention_heads": heads,
        "model.num_query_groups": kv_heads,
        "model.ffn_hidden_size": ffn,
    }


_GPT = {
    "model.normalization": "LayerNorm",
    "model.norm_epsilon": 1e-5,
    "model.activation": "gelu",
    "model.position_embedding_type": "learned_absolute",
    "model.add_bias_linear": True,
    "model.tie_embeddings": True,
}
_GPT2 = {**_GPT, "model.vocab_size": 50257, "model.max_position_embeddings": 1024, "data.seq_length": 1024}

_LLAMA = {
    "model.normalization": "RMSNorm",
    "model.norm_epsilon": 1e-5,
    "model.activation": "swiglu",
    "model.position_embedding_type": "rope",
    "model.rope_scaling": "",
    "model.add_bias_linear": False,
    "model.tie_embeddings": False,
}
_LLAMA2 = {**_LLAMA, "model.rotary_base": 10000.0, "model.vocab_size": 32000, "data.seq_length": 4096}
_LLAMA3 = {**_LLAMA, "model.rotary_base": 500000.0, "model.vocab_size": 128256, "data.seq_length": 8192}
_LLAMA3_1 = {
    **_LLAMA3,
    "model.rope_scaling": "llama3",
    "model.rope_scaling_factor": 8.0,
    "model.rope_low_freq_factor": 1.0,
    "model.rope_high_freq_factor": 4.0,
    "model.rope_original_max_position_embeddings": 8192,
}
_LLAMA3_2 = {**_LLAMA3_1, "model.rope_scaling_factor": 32.0, "model.tie_embeddings": True}

# Megatron's BERT (pretrain_bert.py): pre-LN blocks, GELU, learned positions, tied LM head, 512
# positions; the vocabulary comes from the WordPiece vocab.txt.
_BERT = {**_GPT, "model.model_type": "bert", "model.max_position_embeddings": 512, "data.seq_length": 512}

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-124m": {**_GPT2, **_shape(12, 768, 12)},
    "gpt2-355m": {**_GPT2, **_shape(24, 1024, 16)},
    "gpt2-774m": {**_GPT2, **_shape(36, 1280, 20)},
    "gpt2-1.5b": {**_GPT2, **_shape(48, 1600, 25)},
    "llama2-7b": {**_LLAMA2, **_shape(32, 4096, 32, ffn=11008)},
    "llama2-13b": {**_LLAMA2, **_shape(40, 5120, 40, ffn=13824)},
    "llama2-70b": {**_LLAMA2, **_shape(80, 8192, 64, kv_heads=8, ffn=28672)},
    "llama3-8b": {**_LLAMA3, **_shape(32, 4096, 32, kv_heads=8, ffn=14336)},
    "llama3-70b": {**_LLAMA3, **_shape(80, 8192, 64, kv_heads=8, ffn=28672)},
    "llama3.1-8b": {**_LLAMA3_1, **_shape(32, 4096, 32, kv_heads=8, ffn=14336)},
    "llama3.1-70b": {**_LLAMA3_1, **_shape(80, 8192, 64, kv_heads=8, ffn=28672)},
    "llama3.1-405b": {**_LLAMA3_1, **_shape(126, 16384, 128, kv_heads=8, ffn=53248)},
    "llama3.2-1b": {**_LLAMA3_2, **_shape(16, 2048, 32, kv_heads=8, ffn=8192)},
    "llama3.2-3b": {**_LLAMA3_2, **_shape(28, 3072, 24, kv_heads=8, ffn=8192)},
    # The shape benchmarked against peers: Llama 3.2 1B's body at a 4k context, no rope scaling.
    "llama-1.24b-bench": {
        **_LLAMA3,
        **_shape(16, 2048, 32, kv_heads=8, ffn=8192),
        "model.tie_embeddings": True,
        "data.seq_length": 4096,
    },
    # Tiny shapes for tests and CPU smoke runs; the vocabulary comes from the tokenizer.
    "tiny-gpt": {**_GPT, **_shape(2, 64, 4), "data.seq_length": 64},
    "tiny-llama": {**_LLAMA, **_shape(2, 64, 4, kv_heads=2), "data.seq_length": 64},
    "bert-base": {**_BERT, **_shape(12, 768, 12)},
    "bert-large": {**_BERT, **_shape(24, 1024, 16)},
    "tiny-bert": {**_BERT, **_shape(2, 64, 4), "model.max_position_embeddings": 64, "data.seq_length": 64},
}


def preset_fields(name: str) -> dict[str, Any]:
    """The dotted config fields of preset ``name`` (a copy, safe to modify)."""
    if name not in PRESETS:
        raise ConfigError(unknown_name("model preset", name, list(PRESETS)))
    return dict(PRESETS[name])
