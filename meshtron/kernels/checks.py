"""Every fused kernel held to its reference on random inputs, forward and backward.

One list of cases serves the CPU tests (fp32, Triton's interpreter), the GPU tests (bf16) and
the GPU benchmark session, which prints the errors beside the speed numbers it reports:

    python -m meshtron.kernels.checks [--dtype bf16] [--large]

Errors are norm-wise relative, ``|fast - ref| / |ref|``, with the reference run in the same dtype
(the fp32 internals of both are what is compared, not bf16 rounding of the inputs).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from dataclasses import dataclass
from typing import Callable

import torch

from meshtron.kernels.bias_gelu import bias_gelu
from meshtron.kernels.cross_entropy import linear_cross_entropy
from meshtron.kernels.cross_entropy_sum import linear_cross_entropy_sum
from meshtron.kernels.dropout_add import dropout_add
from meshtron.kernels.norms import layer_norm, rms_norm
from meshtron.kernels.rope import apply_rotary
from meshtron.kernels.swiglu import swiglu
from meshtron.layers.moe.grouped_gemm import grouped_mm
from meshtron.optim.build import build_optimizer


@dataclass
class CaseResult:
    name: str
    forward: float  # relative error of the output
    backward: float  # largest relative error over the input gradients


def relative_error(fast: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((fast.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def _compare(name: str, op: Callable[[str, tuple], torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> CaseResult:
    """Run ``op(mode, inputs)`` with the kernels on and off; same random upstream gradient for both."""
    outs, grads = [], []
    for mode in ("on", "off"):
        leaves = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
        out = op(mode, leaves)
        if not outs:
            upstream = torch.randn_like(out, dtype=torch.float32).to(out.dtype)
        targets = [t for t in leaves if t.requires_grad]
        grads.append(torch.autograd.grad(out, targets, upstream))
        outs.append(out.detach())
    backward = max(relative_error(a, b) for a, b in zip(*grads))
    return CaseResult(name, relative_error(*outs), backward)


def run_checks(device: torch.device | str, dtype: torch.dtype, large: bool = False, seed: int = 0) -> list[CaseResult]:
    """All cases at small shapes, or (``large``) at the 1.24 B Llama's shapes (a GPU's worth of memory)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    if large:
        b, s, hidden, heads, kv, hd, ffn, vocab = 2, 4096, 2048, 32, 8, 64, 8192, 128256
    else:
        b, s, hidden, heads, kv, hd, ffn, vocab = 2, 33, 96, 4, 2, 16, 80, 1000
    rows = b * s
    inv_freq = 500000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(s + 7, dtype=torch.float32), inv_freq).repeat(1, 2).to(device)
    cos, sin = angles.cos(), angles.sin()  # fp32 tables, as the model keeps them
    positions = torch.randint(0, s + 7, (b, s), generator=gen).to(device)
    labels = torch.randint(0, vocab, (b, s), generator=gen).to(device)
    labels[0, :3] = -100
    loss_weights = (torch.rand(b, s, generator=gen) < 0.5).float().to(device)
    group = heads // kv

    def rotary(mode, t, pos):
        (qkv,) = t
        qkv5 = qkv.view(b, s, kv, group + 2, hd)  # a strided q slice and k slice, as in Attention
        q, k = qkv5[:, :, :, :group].flatten(2, 3), qkv5[:, :, :, group]
        return torch.cat([apply_rotary(q, cos, sin, pos, mode), apply_rotary(k, cos, sin, pos, mode)], dim=2)

    chunk = 0 if large else 256  # several vocabulary chunks at small shapes too
    return [
        _compare("rmsnorm", lambda m, t: rms_norm(t[0], t[1], 1e-5, m), (rand(rows, hidden), 1 + rand(hidden, scale=0.1))),
        _compare("layernorm", lambda m, t: layer_norm(t[0], t[1], t[2], 1e-5, m),
                 (rand(rows, hidden, scale=2) + 0.5, 1 + rand(hidden, scale=0.1), rand(hidden, scale=0.1))),
        _compare("swiglu", lambda m, t: swiglu(t[0], m), (rand(b, s, 2 * ffn),)),
        _compare("bias+gelu", lambda m, t: bias_gelu(t[0], t[1], "none", m), (rand(b, s, ffn), rand(ffn))),
        _compare("bias+gelu tanh", lambda m, t: bias_gelu(t[0], t[1], "tanh", m), (rand(b, s, ffn), rand(ffn))),
        _compare("rope", lambda m, t: rotary(m, t, None), (rand(b, s, kv * (group + 2) * hd),)),
        _compare("rope+positions", lambda m, t: rotary(m, t, positions), (rand(b, s, kv * (group + 2) * hd),)),
        _compare("linear+cross-entropy", lambda m, t: linear_cross_entropy(t[0], t[1], labels, m, chunk),
                 (rand(b, s, hidden), rand(vocab, hidden, scale=0.02))),
        _compare("linear+bias+cross-entropy sum", lambda m, t: linear_cross_entropy_sum(t[0], t[1], labels, loss_weights, m, chunk, bias=t[2]),
                 (rand(b, s, hidden), rand(vocab, hidden, scale=0.02), rand(vocab))),
    ]  # fmt: skip


def grouped_gemm_checks(device: torch.device | str, dtype: torch.dtype, large: bool = False, seed: int = 0) -> list[CaseResult]:
    """The Triton grouped GEMM against the per-expert loop, forward and backward (x and weight):
    ragged groups with empty ones, all rows in one group, widths that are no multiple of a tile;
    ``large``: DeepSeek-V2-Lite's fc1 and fc2 (64 experts, 2048 <-> 2x1408, 49k rows)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if large:
        rows, experts = 49152, 64
        # Ragged (a router's skew), with two empty experts; sums to ``rows``.
        weights = torch.rand(experts, generator=gen) ** 2
        weights[[3, 40]] = 0
        sizes = (weights / weights.sum() * rows).floor().long()
        sizes[0] += rows - sizes.sum()
        cases = [("fc1", sizes, 2048, 2 * 1408), ("fc2", sizes, 1408, 2048)]
    else:
        cases = [("ragged+empty", torch.tensor([5, 0, 17, 33, 1]), 24, 40),
                 ("one group", torch.tensor([0, 0, 40, 0]), 32, 16),
                 ("all empty but one row", torch.tensor([0, 1, 0]), 16, 20)]  # fmt: skip
    results = []
    for name, sizes, k, n in cases:
        x = (torch.randn(int(sizes.sum()), k, generator=gen)).to(device=device, dtype=dtype)
        weight = (torch.randn(sizes.numel(), n, k, generator=gen) * k**-0.5).to(device=device, dtype=dtype)
        group_sizes = sizes.to(device)
        op = lambda mode, t: grouped_mm(t[0], t[1], group_sizes, "triton" if mode == "on" else "loop")  # noqa: E731
        results.append(_compare(f"grouped gemm {name}", op, (x, weight)))
    return results


@dataclass
class DropoutAddResult:
    kept: float  # fraction of the elements kept
    forward: float  # largest |out - (residual + x * scale, or residual where dropped)|, by the backward's mask
    backward: float  # largest |grad_x - upstream * scale where kept, 0 elsewhere| and |grad_residual - upstream|
    repeats: bool  # reseeding torch's generator repeats the output
    fresh: bool  # the next call draws another mask


def dropout_add_check(device: torch.device | str, dtype: torch.dtype, rows: int, cols: int, p: float, seed: int = 0) -> DropoutAddResult:
    """The fused ``residual + dropout(x)`` against F.dropout's arithmetic. Its mask cannot be drawn by
    the reference, so it is read off the backward (x's gradient under a positive upstream gradient is
    nonzero exactly where x was kept) and the forward is checked against it: both passes agree on
    the mask, and each is the reference's arithmetic rounded once (errors exactly 0 expected)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x, residual = ((torch.randn(rows, cols, generator=gen)).to(device=device, dtype=dtype).requires_grad_() for _ in range(2))
    upstream = (1 + torch.rand(rows, cols, generator=gen)).to(device=device, dtype=dtype)
    scale = 1 / (1 - p)
    torch.manual_seed(seed)
    out = dropout_add(x, residual, p, True, "on")
    grad_x, grad_residual = torch.autograd.grad(out, (x, residual), upstream)
    kept = grad_x != 0
    expected = torch.where(kept, (residual.float() + x.float() * scale).to(dtype), residual)
    expected_grad = torch.where(kept, (upstream.float() * scale).to(dtype), 0)
    backward = max((grad_x - expected_grad).abs().max().item(), (grad_residual - upstream).abs().max().item())
    torch.manual_seed(seed)
    again = dropout_add(x, residual, p, True, "on")
    return DropoutAddResult(kept.float().mean().item(), (out - expected).abs().max().item(), backward, torch.equal(again, out),
                            not torch.equal(dropout_add(x, residual, p, True, "on"), out))  # fmt: skip


# (name, score function, pre-softmax, k, experts, balancing type, z coeff, scaling, sequences, tokens per sequence)
# Loss coefficients far above a real run's (1e-3 ... 1e-2), so the losses' gradients weigh as much
# as the combine weights' in the compared input gradients.
_ROUTER_CASES = [("softmax top-k first, aux + z", "softmax", False, 2, 6, "aux_loss", 0.3, 1.0, 3, 25),
                 ("softmax pre-softmax, seq aux", "softmax", True, 3, 6, "seq_aux_loss", 0.0, 2.5, 2, 64),
                 ("sigmoid k=1", "sigmoid", False, 1, 5, "aux_loss", 0.0, 1.0, 1, 40),
                 ("sigmoid k=3, seq aux + z", "sigmoid", False, 3, 8, "seq_aux_loss", 0.3, 1.5, 2, 64)]  # fmt: skip
_LARGE_ROUTER_CASES = [("DeepSeek-V2-Lite (64, top-6)", "softmax", True, 6, 64, "seq_aux_loss", 0.0, 1.0, 2, 4096),
                       ("Mixtral (8, top-2, z)", "softmax", False, 2, 8, "aux_loss", 0.3, 1.0, 2, 4096),
                       ("DeepSeek-V3-like (256 sigmoid, top-8)", "sigmoid", False, 8, 256, "aux_loss", 0.0, 2.5, 1, 8192)]  # fmt: skip


def router_checks(device: torch.device | str, dtype: torch.dtype, large: bool = False, seed: int = 0) -> list[CaseResult]:
    """The fused router kernel against ``topk_routing`` + ``token_statistics``: the combine weights,
    the chosen experts and the balancing / z losses (from the kernel's statistics, and from the
    kernel itself) as one output, the gradients of the tokens and the gate weight; ``large``: DeepSeek-V2-Lite's, Mixtral's and a DeepSeek-V3-like router."""
    from meshtron.layers.moe.balancing import losses_from_statistics, statistics_needed, token_statistics
    from meshtron.layers.moe.router import _fused_routing, topk_routing

    gen = torch.Generator(device="cpu").manual_seed(seed)
    results = []
    for name, score, pre, k, experts, balancing, z_coeff, scaling, batch, seq in _LARGE_ROUTER_CASES if large else _ROUTER_CASES:
        needed = statistics_needed(balancing, 1.0, z_coeff)

        def op(mode, t, score=score, pre=pre, k=k, experts=experts, z_coeff=z_coeff, scaling=scaling, batch=batch, needed=needed):
            logits = torch.nn.functional.linear(t[0], t[1])
            if mode == "on":  # the losses from the kernel's statistics, and from the kernel itself
                rows = batch if needed.per_sequence else 1
                probs, chosen, stats, _ = _fused_routing(logits, k, score == "softmax", pre, scaling, rows, needed)
                kernel_losses = _fused_routing(logits, k, score == "softmax", pre, scaling, rows, needed, (1.0, z_coeff))[3]
            else:
                probs, chosen = topk_routing(logits, k, score, pre, scaling)
                stats = token_statistics(logits, batch, k, score, needed)
            losses = losses_from_statistics(stats, k, 1.0, z_coeff)
            if mode == "off":
                kernel_losses = losses
            both = [*losses.values(), *kernel_losses.values()]
            return torch.cat([probs.float().reshape(-1), chosen.float().reshape(-1), torch.stack(both).float()])

        if large or dtype != torch.float32:
            # No two logits of a token equal or within rounding of each other after the score
            # function (both sides would then be right to pick either): one-hot tokens read one
            # gate column, a permutation of values a power of 2 apart within +-2 (exact in bf16,
            # and far from where a sigmoid rounds to 1).
            step = 2.0 ** -max(3, (experts // 8).bit_length())
            tokens = torch.eye(32)[torch.arange(batch * seq) % 32]
            gate = (torch.stack([torch.randperm(experts, generator=gen) for _ in range(32)], dim=1) - experts // 2) * step
        else:
            tokens = torch.randn(batch * seq, 32, generator=gen)
            gate = torch.randn(experts, 32, generator=gen) * 0.5
        inputs = (tokens.to(device=device, dtype=dtype), gate.to(device=device, dtype=dtype))
        results.append(_compare(f"router {name}", op, inputs))
    return results


def fused_adamw_check(device: torch.device | str, dtype: torch.dtype, distributed: bool, steps: int = 4, clip: float = 0.05) -> dict[str, float]:
    """The fused optimizer step against the reference over ``steps`` steps of a small model with
    decay and no-decay groups, clipping (active at the default ``clip``; 0: none), two micro batches, fp16 loss scaling,
    several gradient buckets, each step taken by both from the reference's state:
    the largest relative error of masters, moments, model and grad norm over the steps."""
    from meshtron.config import TrainConfig  # only here: the kernel cases need no config

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 3)).to(device, dtype)
    runs = []
    for impl in ("fused", "reference"):
        model = copy.deepcopy(base)
        train = TrainConfig(lr=1e-2, weight_decay=0.1, clip_grad=clip, initial_loss_scale=1024.0, optimizer_impl=impl)
        # Small buckets: several flat segments (with padding) in the distributed layout.
        runs.append((model, build_optimizer(model, train, dtype, distributed=distributed, bucket_size=300)))
    worst = dict.fromkeys(("master", "exp_avg", "exp_avg_sq", "model", "grad_norm"), 0.0)
    gen = torch.Generator(device="cpu").manual_seed(1)
    for step in range(steps):
        inputs = [torch.randn(9, 24, generator=gen).to(device, dtype) for _ in range(2)]
        norms = []
        for model, opt in runs:
            opt.zero_grad()
            for i, x in enumerate(inputs):
                with opt.no_sync() if i == 0 else contextlib.nullcontext():
                    opt.scale_loss(model(x).float().square().mean()).backward()
            norms.append(opt.step(1e-2 * (step + 1)).grad_norm)
        (fused_model, fused_opt), (ref_model, ref_opt) = runs
        assert fused_opt.fused and not ref_opt.fused
        fused_state, ref_state = fused_opt.state_dict(), ref_opt.state_dict()
        for name, ref_master in ref_state["master"].items():
            errors = {"master": relative_error(fused_state["master"][name], ref_master)}
            for key in ("exp_avg", "exp_avg_sq"):
                errors[key] = relative_error(fused_state["state"][name][key], ref_state["state"][name][key])
            worst.update({k: max(worst[k], v) for k, v in errors.items()})
        for p, q in zip(fused_model.parameters(), ref_model.parameters()):
            worst["model"] = max(worst["model"], relative_error(p, q))
        worst["grad_norm"] = max(worst["grad_norm"], abs(norms[0] - norms[1]) / norms[1])
        # Each step from the same state: in fp16 a model copy one rounding apart changes the next
        # gradients at fp16's precision, and trajectories drift apart whatever the kernel does.
        with torch.no_grad():
            for p, q in zip(fused_model.parameters(), ref_model.parameters()):
                p.copy_(q)
        fused_opt.load_state_dict(ref_state)
    return worst


def adamw_block_groups_check(device: torch.device | str) -> bool:
    """The fused step's per-block group summary: over blocks all of group 0, all of group 1 and
    mixed (boundaries inside blocks, a partial last block), the step with ``block_groups`` equals,
    bit for bit, the step that reads every element's group, and each element got its group's decay."""
    from meshtron.kernels.fused_adamw import _BLOCK, block_groups, fused_adamw

    n = 3 * _BLOCK + 100
    index = torch.zeros(n, dtype=torch.uint8)
    index[_BLOCK + 10 : 2 * _BLOCK + 7] = 1  # block 1 mixed, block 2 mixed; block 0 all 0
    index[3 * _BLOCK :] = 1  # the partial last block all 1
    index = index.to(device)
    summary = block_groups(index)
    expected = torch.tensor([0, 2, 2, 1], dtype=torch.uint8, device=device)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen).to(device) for _ in range(3)] + [torch.rand(n, generator=gen).to(device)]
    results = []
    for groups in (summary, torch.full_like(summary, 2)):
        grad, master, exp_avg, exp_avg_sq = (t.clone() for t in tensors)
        fused_adamw(grad, master, exp_avg, exp_avg_sq, None, index, groups, coef=torch.ones((), device=device),
                    decay=[0.5, 1.0], step=1, lr=0.0, betas=(0.9, 0.999), eps=1e-8)  # fmt: skip
        results.append(master)
    decayed = torch.where(index == 0, tensors[1] * 0.5, tensors[1])  # lr 0: only the decay factor acts
    return torch.equal(summary, expected) and torch.equal(results[0], results[1]) and torch.equal(results[0], decayed)


def narrow_moments_check(device: torch.device | str, moment_dtype: str, distributed: bool, steps: int = 4) -> bool:
    """Precision-aware moments (``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` ``moment_dtype``): the
    fused step that stores them narrow equals, bit for bit, the fp32-moment fused step whose
    moments are rounded to ``moment_dtype`` after every step (the kernel reads them into fp32 and
    rounds once on store). True when masters and moments all agree and the moments are narrow."""
    from meshtron.config import TrainConfig  # only here: the kernel cases need no config
    from meshtron.optim.optimizer import MOMENT_DTYPES

    narrow_dtype = MOMENT_DTYPES[moment_dtype]
    runs = []
    for stored in (moment_dtype, "fp32"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4)).to(device, torch.float16)
        train = TrainConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, optimizer_impl="fused", use_precision_aware_optimizer=True,
                            exp_avg_dtype=stored, exp_avg_sq_dtype=stored)  # fmt: skip
        opt = build_optimizer(model, train, torch.float16, distributed=distributed, bucket_size=100)  # several flat segments
        for i in range(steps):
            opt.zero_grad()
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i)).to(device, torch.float16)
            model(x).float().square().sum().backward()
            opt.step(1e-2)
            if stored == "fp32":
                for seg in opt._segments:
                    for moment in (seg.exp_avg, seg.exp_avg_sq):
                        moment.copy_(moment.to(narrow_dtype))
        runs.append(opt)
    narrow, wide = runs
    return all(
        a.exp_avg.dtype == a.exp_avg_sq.dtype == narrow_dtype and torch.equal(a.master, b.master)
        and torch.equal(a.exp_avg.float(), b.exp_avg) and torch.equal(a.exp_avg_sq.float(), b.exp_avg_sq)
        for a, b in zip(narrow._segments, wide._segments)
    ) and narrow.memory_bytes() < wide.memory_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--large", action="store_true", help="the 1.24 B Llama's shapes")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"kernel vs reference, {args.dtype} on {device}, relative error |fast - ref| / |ref|")
    print(f"{'op':<22} {'forward':>10} {'backward':>10}")
    for r in run_checks(device, dtype, args.large) + grouped_gemm_checks(device, dtype, args.large) + router_checks(device, dtype, args.large):
        print(f"{r.name:<22} {r.forward:>10.2e} {r.backward:>10.2e}")
    for distributed in (False, True):
        print(f"fused AdamW (distributed={distributed}), largest relative error over 4 steps:",
              fused_adamw_check(device, dtype, distributed))  # fmt: skip


if __name__ == "__main__":
    main()
