"""``meshtron estimate``: parameter and optimizer bytes exact against a built model of every family
(the multi-process layouts are in ``tests/distributed/test_estimate_layouts.py``), the published
total and active parameter counts, the attention, MLA and MoE activation terms against the tensors
autograd saves, activation terms ordered as the layouts promise, and the command line."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from meshtron.cli import main
from meshtron.config import build_config
from meshtron.estimate import (
    activation_bytes,
    activation_bytes_per_token_layer,
    attention_bytes_per_token,
    block_activations,
    estimate,
    first_stage_blocks,
    fsdp_gathered_bytes,
    model_parameters,
    moe_bytes_per_token,
    stage_parameters,
)
from meshtron.layers.attention import Attention, head_dim
from meshtron.layers.mla import MultiLatentAttention, rope_table_dim
from meshtron.layers.moe.layer import MoELayer
from meshtron.layers.rope import rope_tables
from meshtron.models import build_model, num_parameters
from meshtron.optim.build import build_optimizer

B1 = ["--preset", "llama-1.24b-bench", "--micro-batch-size", "4", "--global-batch-size", "4", "--bf16"]


def _b1(*flags: str):
    """The B1 config with ``flags``, not validated against this process's world size."""
    return build_config(overrides=B1 + list(flags))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt", "tiny-mixtral", "tiny-deepseek", "tiny-bert", "tiny-t5", "tiny-ict"])
def test_parameters_and_optimizer_match_a_built_model(preset):
    cfg = build_config(overrides=["--preset", preset, "--vocab-size", "256", "--bf16", "--device", "cpu"])
    model = build_model(cfg.model, 256, cfg.data.seq_length).to(torch.bfloat16)
    optimizer = build_optimizer(model, cfg.train, torch.bfloat16)  # the reference step: the CPU's
    est = estimate(cfg)
    # On a GPU the step is fused: one more byte per parameter (its uint8 parameter-group index).
    on_gpu = estimate(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device="auto")))
    assert on_gpu.optimizer_bytes == est.optimizer_bytes + est.params
    experts = sum(p.numel() for name, p in model.named_parameters() if name.endswith(("experts.weight1", "experts.weight2")))
    assert (est.dense_params, est.expert_params) == (num_parameters(model) - experts, experts)
    assert est.params == stage_parameters(cfg).total == model_parameters(cfg)[0] == num_parameters(model)
    assert est.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.optimizer_bytes == optimizer.memory_bytes()
    assert est.grad_bytes == 4 * est.params


def test_layouts_shrink_what_they_shard():
    base, tp = _b1(), _b1("--tp", "2")
    dist_opt = _b1("--use-distributed-optimizer", "--global-batch-size", "16")
    assert stage_parameters(tp).total < 0.55 * stage_parameters(base).total
    assert estimate(dist_opt, world_size=4).optimizer_bytes == estimate(base).optimizer_bytes // 4
    # Sequence parallelism shards the residual stream; the linears' gathered inputs stay whole.
    sp = dataclasses.replace(tp, parallel=dataclasses.replace(tp.parallel, sequence_parallel=True))
    assert activation_bytes_per_token_layer(sp) < activation_bytes_per_token_layer(tp) < activation_bytes_per_token_layer(base)
    # 1F1B on the first of pp stages: 1/pp of the layers (split evenly), pp micro batches in flight.
    pp = _b1("--pp", "4", "--global-batch-size", "16", "--pipeline-split", "uniform")
    assert activation_bytes(pp, world_size=4) == activation_bytes(base)
    # Split by cost, the first stage holds more layers (the last also holds the output layer).
    by_cost = _b1("--pp", "4", "--global-batch-size", "16")
    assert len(first_stage_blocks(by_cost, 16, 4)) == 5 and len(first_stage_blocks(pp, 16, 4)) == 4
    assert activation_bytes(by_cost, world_size=4) == activation_bytes(base) * 5 // 4


def test_fsdp2_counts_its_gathered_parameters_and_the_running_blocks_gradient():
    """Under FSDP2 a rank holds, beside its shards: the root's parameters gathered (embedding, final
    norm, output layer), two blocks gathered (the running one and the prefetched), and the running
    block's gradient unsharded, in bf16 and again in fp32 for the reduce-scatter. Counted from a
    built model's modules; nothing without data-parallel ranks or without FSDP2."""
    cfg = build_config(overrides=["--preset", "tiny-llama", "--vocab-size", "256", "--bf16", "--use-torch-fsdp2", "--global-batch-size", "16"])
    model = build_model(cfg.model, 256, cfg.data.seq_length)
    block = sum(p.numel() for p in model.blocks()[0].parameters())
    root = num_parameters(model) - sum(p.numel() for b in model.blocks() for p in b.parameters())
    assert fsdp_gathered_bytes(cfg, world_size=2) == 2 * root + 2 * 2 * block + (2 + 4) * block
    assert estimate(cfg, world_size=2).gathered_bytes == fsdp_gathered_bytes(cfg, world_size=2)
    assert fsdp_gathered_bytes(cfg, world_size=1) == 0
    assert fsdp_gathered_bytes(build_config(overrides=["--preset", "tiny-llama", "--vocab-size", "256", "--bf16"]), world_size=2) == 0
    assert "FSDP2 gathered" in estimate(cfg, world_size=2).table()


def test_recompute_meets_b7_on_paper():
    """Full recompute keeps one hidden state per layer plus one layer's worth: under 1/5 (B7)."""
    plain = activation_bytes(_b1())
    full, selective = activation_bytes(_b1("--recompute-granularity", "full")), activation_bytes(_b1("--recompute-granularity", "selective"))
    fp8 = activation_bytes(_b1("--fp8-format", "hybrid"))
    assert full < plain / 5 and full < selective < plain and fp8 < plain


def test_estimate_command(capsys):
    assert main(["estimate", *B1, "--global-batch-size", "8", "--world-size", "4", "--tp", "2", "--print-mesh"]) == 0
    out = capsys.readouterr().out
    assert "tp groups: [0, 1] [2, 3]" in out and "activations" in out and "total" in out
    assert out.count("\n     3       1") == 1  # rank 3: tp 1, cp 0, dp 1, ...
    assert main(["estimate", "--tp", "3", "--world-size", "4"]) == 2  # a layout that does not fit: one clear line
    assert "not a multiple" in capsys.readouterr().err


@pytest.mark.parametrize("preset, total, active", [("mixtral-8x7b", 46.7, 12.9), ("deepseek-v2-lite", 15.7, 2.4),
                                                    ("qwen3-30b-a3b", 30.5, 3.3)])  # fmt: skip
def test_published_total_and_active_counts(preset, total, active):
    """Mixtral's and Qwen3's cards count both embeddings as active, DeepSeek's leaves the input
    embedding out (2.45 B, which its card gives as 2.4 B; Mixtral's 12.88 B as 12.9 B): equal to 0.06 B."""
    counts = model_parameters(build_config(overrides=["--preset", preset]))
    ours = counts[2] if preset.startswith("deepseek") else counts[1]
    assert abs(counts[0] / 1e9 - total) < 0.06 and abs(ours / 1e9 - active) < 0.06


def test_deepseek_v2_lite_on_8_gpus_shards_experts_over_ep_and_their_optimizer_over_edp():
    """The README's plan: ep8 leaves 8 of 64 experts per MoE layer on a rank; with dp 8 the dense
    optimizer state splits 8 ways, the experts' not at all (edp 1); at ep4 both split in two."""
    flags = ["--preset", "deepseek-v2-lite", "--use-distributed-optimizer", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16"]
    ep8, ep4, one = (build_config(overrides=[*flags, "--ep", ep]) for ep in ("8", "4", "1"))
    whole = stage_parameters(one)
    assert stage_parameters(ep8) == dataclasses.replace(whole, expert=whole.expert // 8)
    # 12 bytes a parameter (fp32 master, two moments) and the fused step's 1-byte group index
    assert estimate(ep8, world_size=8).optimizer_bytes == 13 * whole.dense // 8 + 13 * whole.expert // 8
    assert estimate(ep4, world_size=8).optimizer_bytes == 13 * whole.dense // 8 + 13 * (whole.expert // 4) // 2
    # Expert tensor parallelism splits the experts over tp too; without it tp leaves them whole.
    tp2 = build_config(overrides=[*flags, "--tp", "2", "--ep", "4"])
    etp2 = build_config(overrides=[*flags, "--tp", "2", "--ep", "4", "--expert-tensor-parallel-size", "2"])
    assert stage_parameters(tp2).expert == 2 * stage_parameters(etp2).expert == whole.expert // 4


def test_moe_layer_recompute_keeps_the_inputs_and_one_layer_rerun():
    """With ``--moe-layer-recompute`` every MoE layer drops its experts' activations (its input is
    the norm output already counted) and one layer's come back while its backward reruns it;
    tests/unit/test_recompute.py measures the drop on autograd's saved tensors."""
    flags = ["--preset", "deepseek-v2-lite", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "1", "--num-layers", "4",
             "--moe-layer-freq", "([0]+[1]*3)"]
    plain, recomputed = build_config(overrides=flags), build_config(overrides=[*flags, "--moe-layer-recompute"])
    tokens = plain.data.seq_length
    moe = tokens * moe_bytes_per_token(plain, 2)
    assert block_activations(recomputed)[1][1] == pytest.approx(block_activations(plain)[1][1] - moe)
    assert block_activations(recomputed)[0] == block_activations(plain)[0]  # layer 0 is dense
    assert activation_bytes(recomputed) == pytest.approx(activation_bytes(plain) - 3 * moe + moe, abs=2)
    # Full recompute keeps each block's input and reruns one block; a MoE model's rerun layer needs
    # as much again for its expert rows' gradients while its backward runs.
    full = build_config(overrides=[*flags, "--recompute-granularity", "full"])
    inputs = 4 * tokens * full.model.hidden_size * 2
    largest = max(kept for _, kept in block_activations(full))
    assert activation_bytes(full) == pytest.approx(inputs + largest + moe, abs=2)


def test_moe_and_mla_activations():
    """A MoE layer keeps top-k copies of each token through its experts: more with a larger k or
    wider experts, the same per rank under ep (balanced loads), fewer under etp; a dense layer
    0 and the MoE layers differ; MLA keeps its latents whole on every tp rank."""
    def per_layer(*flags: str, is_moe: bool = True) -> float:
        cfg = build_config(overrides=["--preset", "deepseek-v2-lite", "--bf16", *flags])
        return activation_bytes_per_token_layer(cfg, is_moe=is_moe)

    base = per_layer()
    assert per_layer("--moe-router-topk", "8") > base and per_layer("--moe-ffn-hidden-size", "2816") > base
    assert per_layer("--ep", "8") == base
    # Without sequence parallelism etp 1 keeps each tp rank's 1/tp of the shared rows, etp = tp all
    # of them with half of each expert; both fewer than one rank.
    assert per_layer("--tp", "2") < per_layer("--tp", "2", "--expert-tensor-parallel-size", "2") < base
    assert per_layer(is_moe=False) != base
    # Six copies of 2048 in and out plus their 3 x 1408 hidden state dominate a DeepSeek MoE layer.
    assert 6 * 2 * (2 * 2048 + 3 * 1408) < base < 2 * 6 * 2 * (2 * 2048 + 3 * 1408)
    blocks = block_activations(build_config(overrides=["--preset", "deepseek-v2-lite", "--bf16", "--micro-batch-size", "1"]))
    assert len(blocks) == 27 and blocks[0][1] != blocks[1][1] == blocks[26][1]


def _saved_bytes_per_token(fn, x: torch.Tensor, skip: list[torch.Tensor]) -> float:
    """What autograd keeps of ``fn(x)`` per token: saved tensors' storages, each once, less the
    input's and those of ``skip`` (parameters, tables)."""
    skip = {t.untyped_storage().data_ptr() for t in [x, *skip]}
    kept = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(kept.values()) / x.shape[:-1].numel()


@pytest.mark.parametrize("flags", [["--preset", "tiny-deepseek"], ["--preset", "tiny-mixtral"],
                                   ["--preset", "tiny-deepseek", "--moe-router-dtype", "fp32"]])  # fmt: skip
def test_moe_activation_term_equals_what_autograd_keeps(flags):
    """The MoE layer alone, bf16 on the CPU: its saved tensors equal the estimate's MoE term to 2 %,
    once the SwiGLU's silu(gate) is left out (the fused GPU kernel recomputes it) and the reference
    combine's two rows in the router dtype are counted as the fused combine's one in bf16
    (tests/unit/test_moe_permute_triton.py measures that difference on the kernels)."""
    cfg = build_config(overrides=[*flags, "--bf16"])
    m = cfg.model
    torch.manual_seed(0)
    layer = MoELayer(m).to(torch.bfloat16)
    measured = _saved_bytes_per_token(layer, torch.randn(2, 64, m.hidden_size, dtype=torch.bfloat16, requires_grad=True), list(layer.parameters()))
    silu = 2 * (m.moe_router_topk * m.moe_ffn_hidden_size + m.moe_shared_expert_intermediate_size)
    router_bytes = 4 if m.moe_router_dtype == "fp32" else 2
    combine = m.moe_router_topk * (2 * router_bytes - 2) * m.hidden_size
    assert measured - silu - combine == pytest.approx(moe_bytes_per_token(cfg, 2), rel=0.02)


class _SavesLikeAKernel(torch.autograd.Function):
    """Stands in for a fused GPU kernel in a saved-tensor count: computes ``fn(*inputs)`` and keeps
    what the kernel keeps (the inputs and output; ``extra`` fp32 rows per token such as a
    log-sum-exp or a norm's rstd). Forward only: the counts need no backward."""

    @staticmethod
    def forward(ctx, fn, extra, keep_output, *inputs):
        out = fn(*inputs)
        stats = torch.zeros(*inputs[0].shape[:-1], extra)
        ctx.save_for_backward(*inputs, stats, *([out] if keep_output else []))
        return out


class _FlashCore(torch.nn.Module):
    """Flash attention keeps q, k, v, its output and the log-sum-exp."""

    def forward(self, q, k, v, mask, dropout, document_ids=None):
        def attention(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

        return _SavesLikeAKernel.apply(attention, 1, True, q, k, v)


class _FusedNorm(torch.nn.Module):
    """The Triton norm keeps its input and rstd."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return _SavesLikeAKernel.apply(lambda t: self.norm(t).detach(), 1, False, x)


def test_mla_activation_term_equals_what_autograd_keeps():
    """DeepSeek's attention alone, bf16 on the CPU with the GPU's kernels stood in for (flash
    attention, the fused latent norm): its saved tensors equal the estimate's MLA term to 2 %."""
    cfg = build_config(overrides=["--preset", "tiny-deepseek", "--bf16"])
    m = cfg.model
    torch.manual_seed(0)
    mla = MultiLatentAttention(m, 1).to(torch.bfloat16)
    mla.core_attention, mla.kv_layernorm = _FlashCore(), _FusedNorm(mla.kv_layernorm)
    cos, sin = (t.to(torch.bfloat16) for t in rope_tables(m, rope_table_dim(m), 64))
    x = torch.randn(2, 64, m.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    measured = _saved_bytes_per_token(lambda t: mla(t, cos, sin), x, skip=[cos, sin, *mla.parameters()])
    assert measured == pytest.approx(attention_bytes_per_token(cfg, 2, 2, keep_core=True), rel=0.02)


@pytest.mark.parametrize("flags", [["--preset", "tiny-llama"], ["--preset", "tiny-gpt"], ["--preset", "tiny-llama", "--qk-layernorm"],
                                   ["--preset", "tiny-llama", "--qk-layernorm", "--qk-layernorm-span", "full"]])  # fmt: skip
def test_attention_activation_term_equals_what_autograd_keeps(flags):
    """Standard attention (grouped-query with RoPE, and GPT's learned positions; with per-head q and
    k norms, fused, or OLMoE's full-width ones in torch ops), flash and the fused per-head norm stood in for: the saved tensors plus the projection input's
    copy (which the estimate counts and the CPU's attention layout makes a view) equal the
    estimate's term to 2 %."""
    cfg = build_config(overrides=[*flags, "--bf16"])
    m = cfg.model
    torch.manual_seed(0)
    attention = Attention(m, 1).to(torch.bfloat16)
    attention.core_attention = _FlashCore()
    if m.qk_layernorm and m.qk_layernorm_span == "head":
        attention.q_layernorm, attention.k_layernorm = _FusedNorm(attention.q_layernorm), _FusedNorm(attention.k_layernorm)
    tables = [t.to(torch.bfloat16) for t in rope_tables(m, head_dim(m), 64)] if m.position_embedding_type == "rope" else [None, None]
    x = torch.randn(2, 64, m.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    measured = _saved_bytes_per_token(lambda t: attention(t, *tables), x, [t for t in tables if t is not None] + list(attention.parameters()))
    projection_input = 2 * m.num_attention_heads * head_dim(m)
    assert measured + projection_input == pytest.approx(attention_bytes_per_token(cfg, 2, 2, keep_core=True), rel=0.02)


def test_t5_and_ict_activations_count_their_sequences():
    """T5's decoder blocks see the decoder's tokens (and the encoder's keys); the retriever runs a
    query and a context through its towers, one shared tower keeping both."""
    t5 = block_activations(build_config(overrides=["--preset", "tiny-t5", "--micro-batch-size", "2"]))
    assert [tokens for tokens, _ in t5] == [128, 128, 64, 64]
    ict = block_activations(build_config(overrides=["--preset", "tiny-ict"]))
    shared = block_activations(build_config(overrides=["--preset", "tiny-ict", "--biencoder-shared-query-context-model"]))
    assert len(ict) == 2 * len(shared) and sum(kept for _, kept in ict) == sum(kept for _, kept in shared)


def test_estimate_command_prints_total_and_active_parameters(capsys):
    assert main(["estimate", "--preset", "deepseek-v2-lite", "--ep", "8", "--use-distributed-optimizer", "--bf16",
                 "--micro-batch-size", "1", "--global-batch-size", "8", "--world-size", "8", "--vocab-size", "102400"]) == 0
    out = capsys.readouterr().out
    assert "ep 8, etp 1, edp 1" in out and "15.71 B parameters, 2.66 B active per token (2.45 B without the input embedding)" in out
    assert "8 per ep rank" in out and "routed experts 1,799.4 M" in out
