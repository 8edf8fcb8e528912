"""Gradient-accumulation fusion on a GPU: is the fused weight gradient right, and is it in place?

    python benchmarks/grad_accum_fusion_check.py [--layers 2] [--micro-batches 2]

1. Correctness: two layers of the B1 Llama shape in bf16, fp32 gradient buffer, ``--micro-batches``
   micro batches accumulated, once with the flag off and once on; each ``main_grad`` against the
   same run of an fp32 copy of the model (norm-wise relative error, worst parameter). The flag on
   should be as close as off or closer: it skips the bf16 rounding of each weight gradient.
2. Which path ``accumulate_wgrad`` takes on this build (in-place fp32 ``addmm`` or the fallback).
3. Speed of one wgrad at the B1 fc1 shape (16384 tokens, 2048 -> 16384): bf16 GEMM + fp32 add
   (the hook's way) against the fused accumulate, CUDA events, median of 20.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from b1_llama import time_steps  # CUDA-event timing after warm-up

from meshtron.config import build_config
from meshtron.kernels import grad_accum_fusion
from meshtron.models import build_model
from meshtron.optim.grad_buffer import GradBuffer


def main_grads(cfg, dtype: torch.dtype, fuse: bool, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_length).to(dtype)
    if fuse:
        grad_accum_fusion.apply_gradient_accumulation_fusion(model.layers)
    named = list(model.named_parameters())
    GradBuffer(named)
    for tokens in batches:
        model(tokens, labels=tokens).sum().div(tokens.numel() * len(batches)).backward()
    return {name: p.main_grad.clone() for name, p in named}


def time_ms(fn) -> float:
    return statistics.median(time_steps(fn, 3, 20)) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2)
    args = parser.parse_args()
    cfg = build_config(None, ["--preset", "llama-1.24b-bench", "--mock-data", "--num-layers", str(args.layers),
                              "--seq-length", "2048", "--micro-batch-size", "2", "--bf16"])  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (2, 2048), device="cuda", generator=gen) for _ in range(args.micro_batches)]
    ref = main_grads(cfg, torch.float32, False, batches)
    for fuse in (False, True):
        got = main_grads(cfg, torch.bfloat16, fuse, batches)
        errors = {n: ((got[n] - r).norm() / r.norm().clamp(min=1e-30)).item() for n, r in ref.items()}
        worst = max(errors, key=errors.get)
        linear = [e for n, e in errors.items() if ".linear_" in n]
        print(f"flag {'on ' if fuse else 'off'}: main_grad vs fp32 model, worst {errors[worst]:.2e} ({worst}), "
              f"linears mean {sum(linear) / len(linear):.2e}")  # fmt: skip

    in_place = grad_accum_fusion._fp32_addmm_in_place(torch.cuda.current_device())
    print(f"fused path on this build: {'in-place fp32 addmm' if in_place else 'fallback: bf16 GEMM + add'}")
    x = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.zeros(16384, 2048, device="cuda")
    unfused = time_ms(lambda: main_grad.add_(g.t() @ x))
    fused = time_ms(lambda: grad_accum_fusion.accumulate_wgrad(main_grad, g, x))
    print(f"wgrad 16384x2048 over 16384 tokens: bf16 GEMM + fp32 add {unfused:.3f} ms, fused {fused:.3f} ms")


if __name__ == "__main__":
    main()
