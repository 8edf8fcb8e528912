import torch
from meshtron.kernels.fp8_cast import fp8_cast
E4M3 = torch.float8_e4m3fn
gen = torch.Generator(device="cuda").manual_seed(0)
t = (torch.randn(8192, 2096, device="cuda", generator=gen) * 3).bfloat16()
amax = t.float().abs()
fmax = torch.finfo(E4M3).max
for name, scale in (("tensor", fmax / amax.max()), ("row", fmax / amax.amax(1, keepdim=True))):
    fast, ref = (fp8_cast(t, scale, E4M3, True, True, True, mode) for mode in ("on", "off"))
    a, b = fast.rows.view(torch.uint8), ref.rows.view(torch.uint8)
    bad = (a != b)
    print(name, "mismatch fraction", bad.float().mean().item(), "amax", fast.amax.item(), ref.amax.item())
    idx = bad.nonzero()[:12]
    for r, c in idx.tolist():
        s = scale if scale.ndim == 0 else scale[r, 0]
        y = (t[r, c] * s)
        print(f"  x={t[r,c].item()!r} scale={float(s)!r} x*s(bf16)={y.item()!r} fp32={t[r,c].float().item()*float(s)!r} fast={fast.rows[r,c].float().item()} ref={ref.rows[r,c].float().item()} bytes {a[r,c].item()} {b[r,c].item()}")
    y = (t.float() * scale.float())
    direct = y.to(E4M3).view(torch.uint8)
    print("  fp32->e4m3 (torch) vs fast:", (direct != a).float().mean().item(), "vs ref:", (direct != b).float().mean().item())
