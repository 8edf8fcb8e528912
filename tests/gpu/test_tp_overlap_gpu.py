"""``--tp-comm-overlap`` on two GPUs: the overlapped tp2+sp model (p2p and bulk backends over NCCL/RCCL, and
PyTorch's symmetric-memory async-TP ops where ``symmetric_memory_usable`` finds them) against the
plain tp2+sp model, same seed and batch: per-token losses and every full gradient. Two sequences
per micro batch (so the chunk-major buffers are copied, not viewed), GQA and SwiGLU.

fp32 (TF32 off): 1e-4 relative (the chunks' GEMMs may take other cuBLAS algorithms than the whole
one's); bf16: 2e-2 relative, norm-wise over each tensor. The pytest case launches this file under
``torchrun`` on 2 GPUs; by hand:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/gpu/test_tp_overlap_gpu.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-2, 2e-2)}  # (losses, gradients)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_overlapped_tp2_matches_plain_tp2_on_two_gpus():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    assert "overlap p2p" in proc.stdout, proc.stdout


def _run(backend: str, dtype: torch.dtype, mesh, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token losses and full gradients of the tp2+sp model, ``backend`` overlapping ("" none)."""
    from meshtron.config import ModelConfig
    from meshtron.models import build_model
    from meshtron.parallel.plan import finalize_tensor_parallel_grads, gather_full, parallelize

    cfg = ModelConfig(num_layers=2, hidden_size=1024, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=2816,
                      normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                      add_bias_linear=False, tie_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(cfg, 2048, batch["tokens"].shape[1])
    metas = parallelize(model, mesh, sequence_parallel=True, tp_comm_overlap=backend)
    model.to(dtype)
    losses = model(batch["tokens"], labels=batch["labels"])
    (losses.float() * batch["weights"]).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    finalize_tensor_parallel_grads(grads, metas, mesh)
    return losses.detach().float(), {n: gather_full(g, metas[n], mesh).float() for n, g in grads.items()}


def _main() -> None:
    import torch.distributed as dist

    from meshtron.config import ParallelConfig
    from meshtron.parallel.mesh import Mesh
    from meshtron.parallel.tp_overlap import symmetric_memory_usable

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    mesh = Mesh.from_config(ParallelConfig(tensor_parallel=2))
    mesh.init_process_groups()
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(1)
    batch = {"tokens": torch.randint(0, 2048, (2, 4096), device="cuda", generator=g),
             "labels": torch.randint(0, 2048, (2, 4096), device="cuda", generator=g),
             "weights": torch.rand(2, 4096, device="cuda", generator=g)}  # fmt: skip
    backends = ["p2p", "bulk"] + (["symm_mem"] if symmetric_memory_usable(mesh.tp_group) else [])
    failures = []
    for dtype, (loss_tol, grad_tol) in TOLERANCES.items():
        want_losses, want_grads = _run("", dtype, mesh, batch)
        for backend in backends:
            losses, grads = _run(backend, dtype, mesh, batch)
            errs = {"losses": ((losses - want_losses).norm() / want_losses.norm()).item()}
            errs.update({n: ((grads[n] - w).norm() / w.norm()).item() for n, w in want_grads.items()})
            worst = max((e for n, e in errs.items() if n != "losses"), default=0.0)
            if rank == 0:
                print(f"{dtype} overlap {backend}: losses {errs['losses']:.2e}, worst gradient {worst:.2e}", flush=True)
            if errs["losses"] > loss_tol or worst > grad_tol:
                failures.append(f"{dtype} {backend}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items() if e > grad_tol))
    if rank == 0 and "symm_mem" not in backends:
        print("symm_mem: not usable here (needs NCCL on an NVIDIA GPU or AMD gfx942/gfx950); p2p only", flush=True)
    dist.destroy_process_group()
    if failures:
        raise SystemExit("overlapped path differs from plain tp2+sp: " + "; ".join(failures))


if __name__ == "__main__":
    _main()
