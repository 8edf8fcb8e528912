"""Context parallelism pieces that need no second process: the load-balanced sharding, the ring's
block math at cp 1 (one block, its own backward) against ``math_attention``, and how the
parallel plan installs it. The cross-rank behaviour is proven in
tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import ConfigError, ModelConfig
from meshtron.layers.attention import attention_mask, math_attention
from meshtron.models import build_model
from meshtron.parallel.context_parallel import (
    ContextParallelAttention,
    allgather_kv_attention,
    cp_token_index,
    ring_attention,
    shard_batch_for_cp,
)
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import parallelize

LLAMA = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, normalization="RMSNorm",
                    activation="swiglu", position_embedding_type="rope", add_bias_linear=False)  # fmt: skip


def test_token_index_balances_causal_work():
    seq, cp = 32, 4
    parts = [cp_token_index(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq))
    assert parts[1].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]  # chunks 1 and 2cp-1-1 = 6 of 8
    # Causal work of a token is its position + 1: every rank gets the same total.
    assert len({int((p + 1).sum()) for p in parts}) == 1
    with pytest.raises(ConfigError, match="multiple of 2 x --context-parallel-size"):
        cp_token_index(36, 4, 0)


def test_shard_batch_keeps_global_positions():
    g = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, 100, (2, 16), generator=g), "labels": torch.randint(0, 100, (2, 16), generator=g),
             "loss_mask": torch.rand(2, 16, generator=g)}  # fmt: skip
    shards = [shard_batch_for_cp(batch, Mesh(cp=2, rank=r)) for r in range(2)]
    index = torch.cat([cp_token_index(16, 2, r) for r in range(2)])
    for name, full in batch.items():
        rebuilt = torch.empty_like(full).index_copy_(1, index, torch.cat([s[name] for s in shards], dim=1))
        assert torch.equal(rebuilt, full), name
    assert torch.equal(shards[1]["position_ids"], cp_token_index(16, 2, 1).expand(2, 8))
    # Given positions (reset at document starts) are sharded, not replaced.
    restarted = dict(batch, position_ids=torch.arange(16).remainder(5).expand(2, 16))
    sharded = shard_batch_for_cp(restarted, Mesh(cp=2, rank=0))["position_ids"]
    assert torch.equal(sharded[0], torch.tensor([0, 1, 2, 3, 2, 3, 4, 0]))
    assert shard_batch_for_cp(batch, Mesh()) is batch


def _reference(q, k, v, mask):
    group = q.shape[2] // k.shape[2]
    k, v = (t.transpose(1, 2).repeat_interleave(group, 1) for t in (k, v))
    return math_attention(q.transpose(1, 2), k, v, mask).transpose(1, 2)


@pytest.mark.parametrize("attention", [ring_attention, allgather_kv_attention])
@pytest.mark.parametrize("case", ["causal", "documents", "full"])
def test_single_rank_equals_math_attention(attention, case):
    """At cp 1 the ring is one block: its forward (log-sum-exp) and hand-written backward, and the
    all-gather variant's masked attention, must equal the reference, GQA included."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 12, 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 12, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(2, 12, 4, 8, generator=g)
    docs = torch.tensor([[0] * 3 + [1] * 9, [0] * 7 + [1] * 5]) if case == "documents" else None
    mask = attention_mask(12, 12, docs) if case != "full" else torch.ones(1, 1, 12, 12, dtype=torch.bool)
    got = attention(q, k, v, Mesh(), causal=case != "full", document_ids=docs)
    got_grads = torch.autograd.grad(got, (q, k, v), dout)
    want = _reference(q, k, v, mask)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, a, b in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"d{name}")


@pytest.mark.parametrize("attention", [ring_attention, allgather_kv_attention])
def test_values_narrower_than_keys_and_the_cores_own_scale(attention):
    """Multi-head latent attention's shape at cp 1: keys 12 wide, values 8, a softmax scale that
    is not 1/sqrt(12); forward and the hand-written backward against the reference."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 12, 4, 12, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 12, 4, 8, generator=g, requires_grad=True)
    dout = torch.randn(2, 12, 4, 8, generator=g)
    got = attention(q, k, v, Mesh(), scale=0.37)
    want = math_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention_mask(12, 12), scale=0.37).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, a, b in zip("qkv", torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"d{name}")


def test_ring_keeps_bf16_inputs_and_accumulates_in_fp32():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g) for _ in range(3))
    got = ring_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), Mesh())
    assert got.dtype == torch.bfloat16
    want = _reference(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), attention_mask(16, 16))
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_plan_installs_core_on_every_layer_and_keeps_the_math():
    torch.manual_seed(0)
    model = build_model(LLAMA, 64, 16)
    tokens = torch.randint(0, 64, (2, 16))
    want = model(tokens, labels=tokens)
    parallelize(model, Mesh())
    assert all(type(layer.self_attention.core_attention).__name__ == "CoreAttention" for layer in model.layers)
    # A cp 1 mesh stands in for a larger one: the same core, degenerate ring.
    for layer in model.layers:
        layer.self_attention.core_attention = ContextParallelAttention(Mesh())
    torch.testing.assert_close(model(tokens, labels=tokens), want, rtol=1e-5, atol=1e-6)

    parallelize(model, Mesh(cp=2), cp_algorithm="all_gather")  # installing needs no process group
    cores = [layer.self_attention.core_attention for layer in model.layers]
    assert all(isinstance(core, ContextParallelAttention) for core in cores)
    assert repr(cores[1]) == "ContextParallelAttention(cp=2, algorithm=all_gather, block_kernel=auto)"
    with pytest.raises(ConfigError, match="unknown context-parallel algorithm"):
        parallelize(model, Mesh(cp=2), cp_algorithm="ring")


def test_core_refuses_what_it_cannot_do():
    core = ContextParallelAttention(Mesh())
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="KV cache"):
        core(q, torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), None, 0.0)
    doc_mask = attention_mask(4, 4, torch.tensor([[0, 0, 1, 1]]))
    with pytest.raises(NotImplementedError, match="document_ids"):
        core(q, q, q, doc_mask, 0.0)
    core(q, q, q, attention_mask(4, 4), 0.0)  # the math backend's plain causal mask is fine
