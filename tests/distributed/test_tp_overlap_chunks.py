"""The overlapped sequence-parallel linears (``meshtron.parallel.tp_overlap``) at tp 4, where the
order of the pairwise exchanges matters (at tp 2 every peer is the same rank): each rank's
forward output and input, weight and bias gradients against the plain path (``all_gather_sequence``
then the linear; the linear then ``reduce_scatter_sequence``), with two sequences per micro batch
so the chunk-major buffers are not plain views. The ``symm_mem`` backend's adapter (its layout
changes around PyTorch's fused async-TP ops) runs too, with the ops' own reference implementations
registered for the CPU (their CUDA kernels need GPUs). The model-level cases (tp 2, GQA, SwiGLU, fused
weight gradients) are in test_tensor_parallel.py. fp32 on gloo, 1e-5 relative."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

import torch.distributed._symmetric_memory as symm_mem

from launcher import run_distributed
from meshtron.config import ParallelConfig
from meshtron.parallel import tp_overlap
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.tensor_parallel import all_gather_sequence, reduce_scatter_sequence

TP, BATCH, SEQ, IN, OUT = 4, 2, 12, 6, 10
RTOL = 1e-5


def _grads(fn, x, weight, bias, seed):
    """``fn``'s output and the gradients of x, weight (and bias) for a random output gradient."""
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias) if t is not None]
    out = fn(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
    assert out.is_contiguous(), "consumers view the output (by heads): it must be contiguous as the plain path's"
    return [out.detach()] + [t.grad for t in leaves]


def _worker(rank: int, world_size: int) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    mesh = Mesh.from_config(ParallelConfig(tensor_parallel=world_size))
    mesh.init_process_groups()
    cpu_ops = torch.library.Library("symm_mem", "IMPL")  # the ops' reference (all-gather + mm, mm + reduce-scatter)
    cpu_ops.impl("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback, "CPU")
    cpu_ops.impl("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback, "CPU")
    group = mesh.tp_group
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard and weight slice
    shard = torch.randn(BATCH, SEQ // TP, IN, generator=g)
    w_col, b_col = torch.randn(OUT, IN, generator=g), torch.randn(OUT, generator=g)
    full = torch.randn(BATCH, SEQ, OUT, generator=g)
    w_row = torch.randn(IN, OUT, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = {"resolved": tp_overlap.resolve_backend("symm_mem", group), "warnings": [str(w.message) for w in caught]}
    for backend in tp_overlap.BACKENDS:
        cases = {
            "column": (
                lambda x, w, b: tp_overlap.gather_linear(x, w, b, group, backend),
                lambda x, w, b: F.linear(all_gather_sequence(x, group), w, b),
                (shard, w_col, b_col),
            ),
            "row": (
                lambda y, w: tp_overlap.linear_scatter(y, w, group, backend),
                lambda y, w: reduce_scatter_sequence(F.linear(y, w), group),
                (full, w_row, None),
            ),
        }
        for name, (overlapped, plain, args) in cases.items():
            out[f"{backend} {name}"] = list(zip(_grads(overlapped, *args, seed=rank), _grads(plain, *args, seed=rank)))
    return out


def test_tp4_overlapped_linears_match_plain_sequence_parallel():
    for rank, results in enumerate(run_distributed(_worker, TP)):
        # gloo: the fused ops' CUDA kernels cannot serve it, so symm_mem falls back to p2p, saying so
        assert results.pop("resolved") == "p2p" and "portable p2p backend" in " ".join(results.pop("warnings"))
        for name, pairs in results.items():
            for what, (got, want) in zip(("output", "input grad", "weight grad", "bias grad"), pairs):
                assert got.shape == want.shape, f"rank {rank} {name}: {what} shape {got.shape} != {want.shape}"
                err = ((got - want).norm() / want.norm()).item()
                assert err < RTOL, f"rank {rank} {name}: {what} differs from the plain path by {err:.2e}"
