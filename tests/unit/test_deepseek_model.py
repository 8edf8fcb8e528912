"""The decoder with multi-head latent attention (DeepSeek-V2's shape): parameter counts of the
presets against the published totals, the count formula against built models, generation through
the latent cache against uncached forwards, YaRN for standard attention too, and Megatron's
spellings for both."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtron.config import build_config
from meshtron.data.tokenizers import build_tokenizer, train_bpe_tokenizer
from meshtron.inference.sampling import generate
from meshtron.layers.kv_cache import LatentKVCache
from meshtron.layers.rope import rope_tables
from meshtron.models import build_model, num_parameters, parameter_count


def _preset(name: str):
    return build_config(overrides=["--model.preset", name]).model


@pytest.mark.parametrize(
    "name, total, active",
    # Model cards: V2-Lite 15.7B total, 2.4B activated (without the input embedding); V2 236B / 21B.
    [("deepseek-v2-lite", 15.7e9, 2.4e9), ("deepseek-v2", 236e9, 21e9)],
)
def test_presets_match_published_sizes(name, total, active):
    m = _preset(name)
    assert abs(parameter_count(m, m.vocab_size) / total - 1) < 0.005
    without_input_embedding = parameter_count(m, m.vocab_size, active=True) - m.vocab_size * m.hidden_size
    assert abs(without_input_embedding / active - 1) < 0.03


def test_lite_preset_fields():
    m = _preset("deepseek-v2-lite")
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size) == (27, 2048, 16, 10944)
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (0, 512, 128, 64, 128)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size) == (64, 6, 1408, 2816)
    assert m.moe_layer_freq == "([0]*1+[1]*26)" and m.rope_scaling == "yarn" and not m.tie_embeddings


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_parameter_count_matches_built_model(q_lora_rank):
    m = dataclasses.replace(_preset("tiny-deepseek"), q_lora_rank=q_lora_rank)
    model = build_model(m, 96, 64)
    assert parameter_count(m, 96, 64) == num_parameters(model)


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_generation_through_the_latent_cache_matches_full_forwards(q_lora_rank):
    """Greedy tokens with the latent cache (absorbed one-token decoding) equal re-running the whole
    sequence each step; the cache holds kv_lora_rank + rope dims per token and layer."""
    m = dataclasses.replace(_preset("tiny-deepseek"), q_lora_rank=q_lora_rank, attention_backend="math",
                            moe_grouped_gemm="loop")  # fmt: skip
    torch.manual_seed(0)
    model = build_model(m, 96, 64).eval()
    cache = model.new_kv_cache(1, 8, torch.float32, torch.device("cpu"))
    assert isinstance(cache, LatentKVCache) and cache.rows[0].shape[-1] == m.kv_lora_rank + m.qk_pos_emb_head_dim
    prompt = [5, 17, 3, 42]
    new = generate(model, prompt, 6, greedy=True)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert new == ids[len(prompt) :]


def test_yarn_reaches_standard_attention():
    """rope_scaling yarn on a plain (non-MLA) decoder builds YaRN's tables at the head dim."""
    m = dataclasses.replace(_preset("tiny-llama"), rope_scaling="yarn", rope_scaling_factor=4.0,
                            rope_original_max_position_embeddings=16)  # fmt: skip
    model = build_model(m, 96, 64)
    cos, _ = model.rope_tables(torch.device("cpu"))
    want, _ = rope_tables(m, m.hidden_size // m.num_attention_heads, 64)
    plain, _ = rope_tables(dataclasses.replace(m, rope_scaling=""), m.hidden_size // m.num_attention_heads, 64)
    assert torch.equal(cos, want) and not torch.allclose(cos, plain)


def test_megatron_spellings():
    """``--position-embedding-type yarn`` is RoPE with YaRN's scaling; the DeepSeek scripts'
    ``DeepSeekV2Tokenizer`` reads the model's Hugging Face tokenizer."""
    cfg = build_config(overrides=["--position-embedding-type", "yarn", "--rotary-scaling-factor", "40"])
    assert (cfg.model.position_embedding_type, cfg.model.rope_scaling, cfg.model.rope_scaling_factor) == ("rope", "yarn", 40.0)


def test_deepseek_tokenizer_type_reads_the_hf_tokenizer(tmp_path):
    train_bpe_tokenizer(["hello world, hello tokens"] * 20, 300, str(tmp_path))
    tok = build_tokenizer("DeepSeekV2Tokenizer", str(tmp_path))
    assert tok.decode(tok.encode("hello world")) == "hello world"
