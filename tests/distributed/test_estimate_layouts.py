"""``meshtron estimate`` against the runner training builds, one spawn of 4 gloo processes (CPU).

For every layout the runner of ``build_runner`` (bf16 model, fp32 masters, as on a GPU) is built
and, on the first pipeline stage, this rank's parameter bytes must equal the estimate exactly,
the optimizer's masters and moments (``memory_bytes``) averaged over the stage's ranks must equal
it too (each rank's shard of a bucket is cut at element boundaries, not parameter ones, so single
ranks differ by a few elements), and the gradient buffer must hold the estimate's fp32 gradients
plus at most its sharding padding. Layouts: expert parallelism with the experts' optimizer state
over the expert-data-parallel group (ep2, ep4), ep2 x etp2 x tp2 with MLA (DeepSeek shape), etp1
under tp2, ep2 with pp2, FSDP2 with ep2 (shards averaged the same way), and the dense families
BERT, T5 and the retriever under tp2, and full-width q/k norms under tp4 (kv heads replicated).
"""

from __future__ import annotations

import torch

from launcher import by_name, run_distributed
from meshtron.config import build_config
from meshtron.estimate import estimate
from meshtron.models import padded_vocab_size
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.setup import build_runner

WORLD = 4
DIST_OPT = ["--use-distributed-optimizer"]
LAYOUTS = {
    "mixtral_ep2": ["--preset", "tiny-mixtral", "--ep", "2", *DIST_OPT],
    "mixtral_ep4": ["--preset", "tiny-mixtral", "--ep", "4", *DIST_OPT],
    "mixtral_ep2_pp2": ["--preset", "tiny-mixtral", "--ep", "2", "--pp", "2", *DIST_OPT],
    "mixtral_fsdp_ep2": ["--preset", "tiny-mixtral", "--ep", "2", "--use-torch-fsdp2"],
    "deepseek_tp2_ep2_etp2": ["--preset", "tiny-deepseek", "--tp", "2", "--ep", "2", "--expert-tensor-parallel-size", "2", *DIST_OPT],
    "deepseek_tp2_ep2_etp1": ["--preset", "tiny-deepseek", "--tp", "2", "--ep", "2", *DIST_OPT],
    "deepseek_ep4_replicated_optimizer": ["--preset", "tiny-deepseek", "--ep", "4"],
    "bert_tp2": ["--preset", "tiny-bert", "--tp", "2", *DIST_OPT],
    "t5_tp2": ["--preset", "tiny-t5", "--tp", "2", *DIST_OPT],
    "ict_tp2": ["--preset", "tiny-ict", "--tp", "2", *DIST_OPT],
    # OLMoE's full-width q/k norms at tp 4 over 2 kv heads: q-norm columns split, k-norm columns replicated
    "qk_full_norms_tp4": ["--preset", "tiny-llama", "--qk-layernorm", "--qk-layernorm-span", "full", "--tp", "4", *DIST_OPT],
}


def _config(flags: list[str]):
    # --device cpu: the runners are built on the CPU, whose optimizer step is the reference one (no fused-step index)
    return build_config(overrides=[*flags, "--vocab-size", "256", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "4",
                                   "--device", "cpu"])  # fmt: skip


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2's DTensor shard
    return local.numel() * local.element_size()


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    for name, flags in LAYOUTS.items():
        cfg = _config(flags)
        mesh = Mesh.from_config(cfg.parallel, world_size=world_size, rank=rank, local_rank=0)
        mesh.init_process_groups()
        vocab = padded_vocab_size(256, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tensor_parallel)
        runner = build_runner(cfg, mesh, vocab, torch.device("cpu"), torch.bfloat16)
        fsdp = cfg.parallel.fsdp
        out[name] = {
            "first_stage": mesh.pp_rank == 0,
            "params": sum(_local_bytes(p) for p in runner.model.parameters()),
            "optimizer": None if fsdp else runner.optimizer.memory_bytes(),
            "grads": None if fsdp else _local_bytes(runner.optimizer.grads.data),
        }
    return out


def test_estimate_equals_the_built_runner():
    results = by_name(run_distributed(_worker, WORLD))
    for name, flags in LAYOUTS.items():
        est = estimate(_config(flags), world_size=WORLD)
        ranks = [r for r in results[name] if r["first_stage"]]
        params = [r["params"] for r in ranks]
        if "--use-torch-fsdp2" in flags:  # fp32 shards, uneven over ranks: their mean is the estimate
            assert sum(params) / len(params) == est.param_bytes, (name, params, est)
            continue
        assert params == [est.param_bytes] * len(ranks), (name, params, est)
        optimizer = sum(r["optimizer"] for r in ranks) / len(ranks)
        assert abs(optimizer - est.optimizer_bytes) <= 12 * len(ranks), (name, optimizer, est)
        # The buffer pads each bucket to a multiple of its group x 64 elements when sharded.
        assert all(est.grad_bytes <= r["grads"] <= est.grad_bytes + 4 * 64 * WORLD * 8 for r in ranks), (name, ranks, est)
