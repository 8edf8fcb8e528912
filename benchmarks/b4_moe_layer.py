"""B4's whole layer: one DeepSeek-V2-Lite MoE layer, forward + backward, against a dense chain of
the same work, with the time split into its parts.

    python benchmarks/b4_moe_layer.py [--tokens 8192] [--grouped-gemm torch|triton] [--steps 20] [--rounds 5] [--tiny]

The layer is meshtron's ``MoELayer`` (64 routed experts top-6, 2 shared experts, expert FFN 1408,
hidden 2048, SwiGLU, softmax router in fp32, dropless), bf16, 8192 tokens (B4b's micro batch of
2 x 4096). The dense chain is one SwiGLU MLP whose FFN width is the active experts' together
((6 + 2) x 1408 = 11,264): the same GEMM FLOPs per token. B4's target: the layer >= 75 % of the
dense chain's TFLOP/s.

The parts are timed the same way, each forward + backward on its own inputs, so their sum is
close to, not equal to, the layer: router (gate GEMM, softmax, top-k, the balancing loss),
dispatch (the plan's sort and counts, the permutation and the weighted unpermutation), routed
experts (the grouped GEMMs and the activation) and shared experts. The layer and the dense chain are
timed ``--rounds`` times in turn and the ratio is the median of the rounds' ratios: a GPU's clock
drifts within a call, and the layer and the chain should see the same drift. ``--tiny``: a 4-expert,
64-wide layer on the CPU in fp32 (a smoke test of the script; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from meshtron.config import ModelConfig
from meshtron.layers.mlp import MLP
from meshtron.layers.moe import MoELayer
from meshtron.layers.moe.dispatch import permute, plan_dispatch, unpermute

DEEPSEEK_V2_LITE = dict(hidden_size=2048, num_experts=64, moe_router_topk=6, moe_ffn_hidden_size=1408,
                        moe_shared_expert_intermediate_size=2 * 1408)  # fmt: skip
TINY = dict(hidden_size=64, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32)


def b4_config(**fields) -> ModelConfig:
    """The layer's config: ``fields`` (a shape, the grouped GEMM's backend) over B4's rules."""
    rules = dict(num_layers=1, add_bias_linear=False, activation="swiglu", moe_router_dtype="fp32",
                 moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3)  # fmt: skip
    return ModelConfig(**{**rules, **fields})


def time_ms(fn, device: torch.device, warmup: int, steps: int) -> float:
    """Median milliseconds of ``fn`` after warm-up. On the GPU the calls run back to back and are
    timed by CUDA events between them (``b1_llama.time_steps``), as a layer runs inside a model
    whose host is ahead of the GPU: its launches are hidden, its kernels are not. On the CPU, the
    wall clock."""
    if device.type == "cuda":
        from b1_llama import time_steps

        return statistics.median(time_steps(fn, warmup, steps)) * 1000
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def backward_of(make_output, leaves: list[torch.Tensor]):
    """A step: ``make_output()`` then its backward with a fixed random upstream gradient."""
    upstream = {}

    def step():
        for t in leaves:
            t.grad = None
        out = make_output()
        if "g" not in upstream:
            upstream["g"] = torch.randn_like(out)
        out.backward(upstream["g"])

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--grouped-gemm", default="auto")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5, help="layer and dense chain timed in turn this many times")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--profile-dir", default="", help="also profile the whole layer (with its timeline and host syncs) and the router into this directory (GPU)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape, tokens = (TINY, 64) if args.tiny else (DEEPSEEK_V2_LITE, args.tokens)
    cfg = b4_config(moe_grouped_gemm=args.grouped_gemm, **shape)
    torch.manual_seed(0)
    layer = MoELayer(cfg).to(device, dtype)
    active_ffn = (cfg.moe_router_topk * cfg.moe_ffn_hidden_size) + cfg.moe_shared_expert_intermediate_size
    dense = MLP(cfg, width=active_ffn).to(device, dtype)
    h = cfg.hidden_size
    x = torch.randn(1, tokens, h, device=device, dtype=dtype, requires_grad=True)
    flat = x.detach().reshape(tokens, h).requires_grad_()
    routing = layer.router(flat.detach())
    plan = plan_dispatch(routing.probs.detach(), routing.experts, cfg.num_experts, fused_kernels=cfg.fused_kernels)
    expert_in = permute(flat.detach(), plan).requires_grad_()
    params = list(layer.parameters()) + list(dense.parameters())

    def layer_out():
        out = layer(x)
        return out + sum(layer.last_aux_losses.values())

    def router_out():
        r = layer.router(flat, 1, layer.needed, layer.token_sum, (layer.aux_loss_coeff, cfg.moe_z_loss_coeff))
        return r.probs.sum() + sum(r.losses.values())

    def dispatch_out():
        p = plan_dispatch(routing.probs.detach(), routing.experts, cfg.num_experts, fused_kernels=cfg.fused_kernels)
        return unpermute(permute(flat, p, cfg.fused_kernels), p, tokens, flat.dtype, cfg.fused_kernels)

    parts = {
        "MoE layer (whole)": backward_of(layer_out, [x, *params]),
        "dense chain (same FLOPs)": backward_of(lambda: dense(x), [x, *params]),
        "  router + balancing loss": backward_of(router_out, [flat, *params]),
        "  dispatch (plan, permute, unpermute)": backward_of(dispatch_out, [flat]),
        "  routed experts (grouped GEMMs)": backward_of(lambda: layer.experts(expert_in, plan.group_sizes), [expert_in, *params]),
        "  shared experts": backward_of(lambda: layer.shared_experts(flat), [flat, *params]),
    }
    flops = 3 * 2 * tokens * h * active_ffn * 3  # fwd + 2 bwd GEMMs; SwiGLU: fc1 is 2 x width, fc2 1 x width
    expert_flops = 3 * 2 * plan.num_rows * h * cfg.moe_ffn_hidden_size * 3
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}: {tokens} tokens, {cfg.num_experts} experts top-{cfg.moe_router_topk}, ffn {cfg.moe_ffn_hidden_size}, "
          f"shared {cfg.moe_shared_expert_intermediate_size}, {dtype}, grouped GEMM {args.grouped_gemm}, fwd+bwd")  # fmt: skip
    whole_part, dense_part = "MoE layer (whole)", "dense chain (same FLOPs)"
    rounds = [(time_ms(parts[whole_part], device, args.warmup, args.steps), time_ms(parts[dense_part], device, args.warmup, args.steps))
              for _ in range(args.rounds)]  # fmt: skip
    ratios = sorted(dense / layer for layer, dense in rounds)
    results = {whole_part: statistics.median(r[0] for r in rounds), dense_part: statistics.median(r[1] for r in rounds)}
    for part, step in parts.items():
        if part not in results:
            results[part] = time_ms(step, device, args.warmup, args.steps)
    print(f"{'part':<40} {'ms':>8} {'TFLOP/s':>8} {'share':>7}")
    whole = results["MoE layer (whole)"]
    for part, ms in results.items():
        work = {"MoE layer (whole)": flops, "dense chain (same FLOPs)": flops, "  routed experts (grouped GEMMs)": expert_flops}
        tflops = f"{work[part] / ms / 1e9:8.1f}" if part in work else f"{'':>8}"
        print(f"{part:<40} {ms:>8.3f} {tflops} {ms / whole:>7.1%}")
    print(f"layer / dense chain TFLOP/s: {statistics.median(ratios):.1%} (median of {args.rounds} rounds, "
          f"{ratios[0]:.1%} to {ratios[-1]:.1%}; B4 target >= 75 %)")  # fmt: skip
    if args.profile_dir:
        from b1_llama import profile_steps
        from host_waits import find_syncs

        os.makedirs(args.profile_dir, exist_ok=True)  # the trace's writer does not create it
        layer_step = parts["MoE layer (whole)"]
        trace = f"{args.profile_dir}/trace_moe_layer_{args.grouped_gemm}.json.gz"
        profile_steps(layer_step, f"{args.profile_dir}/profile_moe_layer_{args.grouped_gemm}.txt", trace)
        profile_steps(parts["  router + balancing loss"], f"{args.profile_dir}/profile_moe_router.txt")
        print(f"host syncs per layer step: {find_syncs(layer_step, f'{args.profile_dir}/syncs_moe_layer.txt') / 2:g}")


if __name__ == "__main__":
    main()
