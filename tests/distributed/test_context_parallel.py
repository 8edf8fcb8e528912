"""Context parallelism equals the one-process run: attention outputs and gradients, per-token
losses and every parameter gradient.

One spawn of 4 gloo processes holds three layouts at once: cp 4, cp 2 x dp 2 and cp 2 x tp 2.
The reference is computed in this (pytest's) process from the same seed and data, unsharded.

- Attention alone: q/k/v of the whole sequence are sharded the load-balanced way, attended with
  ``ring_attention`` and ``allgather_kv_attention`` (causal, with and without packed documents;
  the ring also non-causal), and compared with ``math_attention`` over the whole sequence: the
  output and the q/k/v gradients of the rank's tokens. Once on the fp32 math path, and once on
  the fused path with ``ReferenceKernel`` standing in for the GPU kernels (their conventions, in
  plain PyTorch), which proves the fused path's block slicing, merges and the all-gather's
  reordering here; the kernels themselves are checked on the GPU
  (tests/gpu/test_context_parallel_gpu.py, benchmarks/cp_long_context.py).
- The model: a tiny Llama (rope, GQA; also with sequence parallelism under tp, and with the core
  attention recomputed in backward) and a GPT (learned positions, packed documents, biases)
  trained one step the trainer's way: masked loss sum over the global token count (all-reduced
  over dp x cp), gradients summed over dp x cp. Unsharded per-token losses, the global loss and
  every gradient must match the plain model on the whole batch.

Tolerance: fp32 on the CPU, 1e-5 relative (as a norm over the whole tensor).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from launcher import run_distributed

from meshtron.config import ModelConfig
from meshtron.layers.attention import attention_mask, math_attention
from meshtron.models import build_model
from meshtron.parallel.context_parallel import (
    allgather_kv_attention,
    cp_token_index,
    ring_attention,
    shard_batch_for_cp,
)
from meshtron.parallel.cp_block_kernels import PaddedValues
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import finalize_tensor_parallel_grads, gather_full, parallelize

SEED, VOCAB, SEQ, BATCH = 1234, 128, 32, 2
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
RTOL = 1e-5
WORLD = 4
LAYOUTS = {"cp4": dict(cp=4), "cp2xdp2": dict(cp=2, dp=2), "cp2xtp2": dict(tp=2, cp=2)}

LLAMA = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
                    ffn_hidden_size=96, normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                    add_bias_linear=False, tie_embeddings=False)  # fmt: skip
GPT = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS, normalization="LayerNorm", activation="gelu",
                  position_embedding_type="learned_absolute", add_bias_linear=True, tie_embeddings=True)  # fmt: skip
# Core attention recomputed in backward (``--recompute-granularity selective``): the ring runs again there.
# OLMoE's full-width q/k norms (per token, so cp needs nothing; their sums of squares go over tp).
MODELS = {"llama": LLAMA, "gpt": GPT, "llama_recompute": dataclasses.replace(LLAMA, recompute_granularity="selective"),
          "llama_qk_full": dataclasses.replace(LLAMA, qk_layernorm=True, qk_layernorm_span="full")}  # fmt: skip
# (model, layout, algorithm, sequence parallel): every layout with the ring; the all-gather variant,
# packed documents, sequence parallelism, recomputation and full-width q/k norms once each.
MODEL_CASES = [("llama", "cp4", "p2p", False), ("llama", "cp2xdp2", "p2p", False), ("llama", "cp2xtp2", "p2p", False),
               ("llama", "cp4", "all_gather", False), ("gpt", "cp2xtp2", "p2p", False),
               ("llama", "cp2xtp2", "p2p", True), ("llama_recompute", "cp2xdp2", "p2p", False),
               ("llama_qk_full", "cp2xtp2", "p2p", True)]  # fmt: skip
# (algorithm, causal, documents, block kernel): packed documents always take the math path.
ATTENTION_CASES = [("p2p", True, False, "math"), ("p2p", True, True, "math"), ("p2p", False, False, "math"),
                   ("all_gather", True, False, "math"), ("all_gather", True, True, "math"),
                   ("p2p", True, False, "reference"), ("p2p", False, False, "reference"),
                   ("all_gather", True, False, "reference"), ("all_gather", False, False, "reference")]  # fmt: skip
ATTENTION_FNS = {"p2p": ring_attention, "all_gather": allgather_kv_attention}


class ReferenceKernel:
    """A CPU stand-in for ``FlashKernel``: [b, heads, s, d] inputs with fewer kv heads, output in
    q's dtype and log-sum-exp [b, heads, s] (fp32) forward; backward from the output and
    log-sum-exp it is given (the merged ones), the kv gradients summed over each group."""

    AUX = ("placeholder",)

    @staticmethod
    def _scores(q, k, causal, scale):
        scores = q.double() @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).double().transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
        return scores

    @classmethod
    def forward(cls, q, k, v, causal, scale):
        scores = cls._scores(q, k, causal, scale)
        lse = scores.logsumexp(dim=-1)
        out = (scores - lse[..., None]).exp() @ v.repeat_interleave(q.shape[1] // k.shape[1], 1).double()
        return out.to(q.dtype), lse.float(), cls.AUX

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, aux, causal, scale):
        assert aux is cls.AUX, "the forward's auxiliary outputs must come back to the backward"
        group = q.shape[1] // k.shape[1]
        probs = (cls._scores(q, k, causal, scale) - lse.double()[..., None]).exp()
        dout, v_full = dout.double(), v.repeat_interleave(group, 1).double()
        dscores = probs * (dout @ v_full.transpose(-1, -2) - (dout * out.double()).sum(-1, keepdim=True))
        dq = dscores @ k.repeat_interleave(group, 1).double() * scale
        dk, dv = dscores.transpose(-1, -2) @ q.double() * scale, probs.transpose(-1, -2) @ dout
        by_group = lambda g: g.unflatten(1, (k.shape[1], group)).sum(2).to(k.dtype)
        return dq.to(q.dtype), by_group(dk), by_group(dv)


KERNELS = {"math": "math", "reference": ReferenceKernel}


class EqualWidthsOnly:
    """``ReferenceKernel`` with flash's limit: values exactly as wide as q/k."""

    @staticmethod
    def forward(q, k, v, causal, scale):
        assert v.shape[-1] == q.shape[-1], "a flash-like kernel got unequal head dims"
        return ReferenceKernel.forward(q, k, v, causal, scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, causal, scale):
        assert v.shape[-1] == dout.shape[-1] == out.shape[-1] == q.shape[-1], "a flash-like kernel got unequal head dims"
        return ReferenceKernel.backward(dout, q, k, v, out, lse, aux, causal, scale)


@pytest.mark.parametrize("algorithm", ["p2p", "all_gather"])
def test_padded_values_give_mla_head_dims_to_a_flash_like_kernel(algorithm):
    """One process (cp 1): MLA's shape (q/k 12 wide, v 8, grouped kv heads, its own scale) through
    ``PaddedValues`` around a kernel that takes only equal widths (as flash, what ROCm's ``auto``
    picks) equals the reference kernel on the narrow values, forward and backward."""
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 16, 4, 12, generator=g, requires_grad=True), torch.randn(2, 16, 2, 12, generator=g, requires_grad=True)
    v, dout = torch.randn(2, 16, 2, 8, generator=g, requires_grad=True), torch.randn(2, 16, 4, 8, generator=g)
    results = []
    for kernel in (PaddedValues(EqualWidthsOnly), ReferenceKernel):
        out = ATTENTION_FNS[algorithm](q, k, v, Mesh(), causal=True, kernel=kernel, scale=0.3)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    assert results[0][0].shape == (2, 16, 4, 8)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- data


def unshard_sequence(x: torch.Tensor, mesh: Mesh, dim: int = 1) -> torch.Tensor:
    """The inverse of the sharding: every cp rank's part of ``x`` put back in sequence order
    (per-token losses, for logging or a test). Collective over cp; not differentiable."""
    if mesh.cp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(mesh.cp)]
    dist.all_gather(parts, x.contiguous(), group=mesh.cp_group)
    seq_len = x.shape[dim] * mesh.cp
    index = torch.cat([cp_token_index(seq_len, mesh.cp, r, x.device) for r in range(mesh.cp)])
    shape = list(x.shape)
    shape[dim] = seq_len
    return x.new_empty(shape).index_copy_(dim, index, torch.cat(parts, dim=dim))


def _attention_inputs() -> dict[str, torch.Tensor]:
    """Whole-sequence q, k, v, an upstream gradient and three packed documents per sequence."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=g)
    k, v = (torch.randn(BATCH, SEQ, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    dout = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=g)
    docs = torch.tensor([[0] * 5 + [1] * 14 + [2] * 13, [0] * 20 + [1] * 3 + [2] * 9])
    return {"q": q, "k": k, "v": v, "dout": dout, "docs": docs}


def _batch(name: str) -> dict[str, torch.Tensor]:
    """Random tokens and labels (a few ignored), a random loss mask; the GPT packs documents
    (positions restart, attention stays inside each)."""
    g = torch.Generator().manual_seed(7)
    batch = {
        "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "loss_mask": (torch.rand(BATCH, SEQ, generator=g) < 0.8).float(),
    }
    batch["labels"][0, :3] = -100
    if name == "gpt":
        docs = torch.tensor([[0] * 11 + [1] * 21, [0] * 26 + [1] * 6])
        starts = torch.tensor([[0] * 11 + [11] * 21, [0] * 26 + [26] * 6])
        batch["document_ids"] = docs
        batch["position_ids"] = torch.arange(SEQ) - starts
    return batch


def _model(name: str):
    torch.manual_seed(SEED)
    return build_model(MODELS[name], VOCAB, SEQ)


def _loss(model, batch, num_tokens):
    per_token = model(batch["tokens"], batch.get("position_ids"), batch.get("document_ids"), batch["labels"])
    return per_token, (per_token * batch["loss_mask"]).sum() / num_tokens


# ---------------------------------------------------------------------- the distributed side


def _attention_case(mesh: Mesh, algorithm: str, causal: bool, documents: bool, kernel: str) -> dict[str, torch.Tensor]:
    data = _attention_inputs()
    index = cp_token_index(SEQ, mesh.cp, mesh.cp_rank)
    q, k, v = (data[n].index_select(1, index).requires_grad_() for n in ("q", "k", "v"))
    docs = data["docs"].index_select(1, index) if documents else None
    out = ATTENTION_FNS[algorithm](q, k, v, mesh, causal=causal, document_ids=docs, kernel=KERNELS[kernel])
    (out * data["dout"].index_select(1, index)).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _model_case(mesh: Mesh, name: str, algorithm: str, sequence_parallel: bool) -> dict[str, object]:
    model = _model(name)
    metas = parallelize(model, mesh, sequence_parallel, cp_algorithm=algorithm)
    batch = {k: t.chunk(mesh.dp)[mesh.dp_rank] for k, t in _batch(name).items()}
    local = shard_batch_for_cp(batch, mesh)
    num_tokens = local["loss_mask"].sum()
    dist.all_reduce(num_tokens, group=mesh.dp_cp_group)
    per_token, loss = _loss(model, local, num_tokens)
    loss.backward()
    finalize_tensor_parallel_grads({n: p.grad for n, p in model.named_parameters()}, metas, mesh)
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss, group=mesh.dp_cp_group)
    grads = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad, group=mesh.dp_cp_group)  # the data-parallel buffer's job
        grads[n] = gather_full(p.grad, metas[n], mesh)
    return {"losses": unshard_sequence(per_token.detach(), mesh), "loss": global_loss, "grads": grads}


def _worker(rank: int, world_size: int) -> dict:
    meshes = {name: Mesh(rank=rank, **sizes) for name, sizes in LAYOUTS.items()}
    for mesh in meshes.values():
        mesh.init_process_groups()
    out = {}
    for layout in ("cp4", "cp2xdp2"):
        for case in ATTENTION_CASES:
            out[("attention", layout, *case)] = _attention_case(meshes[layout], *case)
    for name, layout, algorithm, sp in MODEL_CASES:
        out[("model", name, layout, algorithm, sp)] = _model_case(meshes[layout], name, algorithm, sp)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD)


# ---------------------------------------------------------------------- the checks


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def _reference_attention(causal: bool, documents: bool) -> dict[str, torch.Tensor]:
    data = _attention_inputs()
    q, k, v = (data[n].clone().requires_grad_() for n in ("q", "k", "v"))
    if causal:
        mask = attention_mask(SEQ, SEQ, data["docs"] if documents else None)
    else:
        mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool)
    group = HEADS // KV_HEADS
    out = math_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, 1),
                         v.transpose(1, 2).repeat_interleave(group, 1), mask).transpose(1, 2)  # fmt: skip
    (out * data["dout"]).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("layout", ["cp4", "cp2xdp2"])
@pytest.mark.parametrize("algorithm,causal,documents,kernel", ATTENTION_CASES)
def test_attention_matches_full_attention(results, layout, algorithm, causal, documents, kernel):
    want = _reference_attention(causal, documents)
    for rank, result in enumerate(results):
        got = result[("attention", layout, algorithm, causal, documents, kernel)]
        mesh = Mesh(rank=rank, **LAYOUTS[layout])
        index = cp_token_index(SEQ, mesh.cp, mesh.cp_rank)
        for name in ("out", "dq", "dk", "dv"):
            err = _rel_err(got[name], want[name].index_select(1, index))
            assert err < RTOL, f"rank {rank}: {name} differs by {err:.2e} (relative)"


@pytest.mark.parametrize("layout", ["cp4", "cp2xdp2"])
@pytest.mark.parametrize("documents", [False, True])
def test_allgather_equals_ring(results, layout, documents):
    for rank, result in enumerate(results):
        ring, gathered = (result[("attention", layout, alg, True, documents, "math")] for alg in ("p2p", "all_gather"))
        for name in ("out", "dq", "dk", "dv"):
            assert _rel_err(gathered[name], ring[name]) < RTOL, f"rank {rank}: {name}"


def _reference_model(name: str) -> dict[str, object]:
    model, batch = _model(name), _batch(name)
    per_token, loss = _loss(model, batch, batch["loss_mask"].sum())
    loss.backward()
    return {"losses": per_token.detach(), "loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("name,layout,algorithm,sp", MODEL_CASES)
def test_model_matches_one_process(results, name, layout, algorithm, sp):
    want = _reference_model(name)
    for rank, result in enumerate(results):
        got = result[("model", name, layout, algorithm, sp)]
        mesh = Mesh(rank=rank, **LAYOUTS[layout])
        rows = torch.arange(BATCH).chunk(mesh.dp)[mesh.dp_rank]
        err = _rel_err(got["losses"], want["losses"][rows])
        assert err < RTOL, f"rank {rank}: per-token losses differ by {err:.2e}"
        assert _rel_err(got["loss"], want["loss"]) < RTOL, f"rank {rank}: loss {got['loss']} != {want['loss']}"
        assert got["grads"].keys() == want["grads"].keys()
        for n, ref in want["grads"].items():
            assert ref.norm() > 0, f"{n}: reference gradient is zero, the comparison would prove nothing"
            err = _rel_err(got["grads"][n], ref)
            assert err < RTOL, f"rank {rank}: gradient of {n} differs by {err:.2e} (relative)"
