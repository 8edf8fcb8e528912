"""Sizes read off the meta-built model (``models/sizes.py``, ``parallel/sizes.py``) equal the
materialized model's, for every built-in family; routed experts count their top-k share as active."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import ModelConfig
from meshtron.models import build_model
from meshtron.models.sizes import model_sizes
from meshtron.parallel.sizes import rank_parameters

VOCAB, SEQ = 96, 32
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
ROPE = dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope", add_bias_linear=False)
MOE = dict(ROPE, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=32)
MLA = dict(ROPE, multi_latent_attention=True, kv_lora_rank=16, q_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
           qk_layernorm=True)  # fmt: skip
FAMILIES = {
    "dense": dict(ROPE, num_query_groups=2),
    "moe": MOE,
    "mla": dict(MLA, num_experts=4, moe_router_topk=1),
    "bert": dict(model_type="bert"),
    "t5": dict(model_type="t5", position_embedding_type="relative"),
    "ict": dict(model_type="ict", biencoder_projection_dim=8),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_meta_count_equals_the_materialized_model(name):
    cfg = ModelConfig(**{**BASE, **FAMILIES[name]})
    torch.manual_seed(0)
    built = sum(p.numel() for p in build_model(cfg, VOCAB, SEQ).parameters())
    sizes = model_sizes(cfg, VOCAB, SEQ)
    assert sizes.total() == built == rank_parameters(cfg, VOCAB, SEQ).total
    assert not any(p.place == "block" and p.block < 0 for p in sizes.params)


def test_routed_experts_count_their_top_k_share_as_active():
    cfg = ModelConfig(**{**BASE, **MOE})
    sizes = model_sizes(cfg, VOCAB, SEQ)
    routed = sum(p.numel for p in sizes.params if p.expert)
    assert routed == 2 * 4 * 3 * 32 * 16  # layers x experts x (SwiGLU fc1 two halves + fc2) x h x ffn
    assert sizes.total(active=True) == sizes.total() - routed // 2
    assert sum(sizes.block_counts(active=True)) == sizes.total(active=True) - VOCAB * 32 - 32  # less the (tied) table, final norm


def test_meta_build_leaves_the_random_state_alone():
    torch.manual_seed(3)
    model_sizes(ModelConfig(**{**BASE, "num_layers": 3}), VOCAB, SEQ)
    drawn = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(1))


def test_rank_parameters_split_as_the_plan_does():
    cfg = ModelConfig(**{**BASE, **MOE})
    whole, split = rank_parameters(cfg, VOCAB, SEQ), rank_parameters(cfg, VOCAB, SEQ, tp=2, ep=2)
    assert [b.expert for b in split.blocks] == [b.expert // 2 for b in whole.blocks]  # half the experts, each whole
    assert split.head == whole.head // 2  # the table by vocabulary rows
