"""Which SDPA kernel to prefer: causal fwd+bwd per backend, grouped heads passed as they are
(``enable_gqa``) or repeated, at the B1 attention shape by default.

    python benchmarks/sdpa_backends.py [--batch 4] [--heads 32] [--kv-heads 8] [--seq 4096] [--head-dim 64]

Prints TFLOP/s (causal attention fwd+bwd counted as 3.5 x 2 x b h s^2 d, half of it masked) and
the output's relative difference from the flash backend; ``n/a`` where a backend refuses the inputs.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def fwd_bwd(q, k, v, gqa: bool):
    group = q.shape[1] // k.shape[1]
    if not gqa:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    out.backward(torch.ones_like(out))
    return out.detach()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(h):
        # [b, s, h, d] transposed, as the model passes them
        t = torch.randn(a.batch, a.seq, h, a.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        return t.transpose(1, 2).requires_grad_()

    q, k, v = rand(a.heads), rand(a.kv_heads), rand(a.kv_heads)
    flops = 3.5 * 2 * a.batch * a.heads * a.seq**2 * a.head_dim
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        ref = fwd_bwd(q, k, v, True).float()
    print(f"SDPA causal fwd+bwd, b{a.batch} h{a.heads} kv{a.kv_heads} s{a.seq} d{a.head_dim}, bf16, {torch.cuda.get_device_name()}")
    for name, backend in BACKENDS.items():
        for gqa in (True, False):
            label = f"{name:<10} {'enable_gqa' if gqa else 'repeated':<11}"
            try:
                with sdpa_kernel([backend]):
                    out = fwd_bwd(q, k, v, gqa)
                    for _ in range(3):
                        fwd_bwd(q, k, v, gqa)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(10):
                        fwd_bwd(q, k, v, gqa)
                    end.record()
                    torch.cuda.synchronize()
            except RuntimeError as exc:
                print(f"{label} n/a ({str(exc).splitlines()[0][:80]})")
                continue
            ms = start.elapsed_time(end) / 10
            diff = ((out.float() - ref).norm() / ref.norm()).item()
            print(f"{label} {ms:7.2f} ms {flops / ms / 1e9:7.1f} TFLOP/s  rel diff vs flash {diff:.1e}")


if __name__ == "__main__":
    main()
