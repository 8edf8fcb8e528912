"""The GPU feature matrix: two training steps of every meaningful combination of the features a
user switches on — recompute (none, selective, full, MoE-layer) × gradient-accumulation fusion ×
FP8 × compile, pruned to what can differ (``combinations``) — under every layout this launch's GPUs allow, for a dense, a MoE and an MLA model,
each compared with the plain reference path (one GPU, no recompute, no fusion, no FP8, eager).

Every row is the trainer built from flags, as ``meshtron train`` builds it. A row is

- ``ok``: both steps' losses within ``LOSS_TOL`` of the reference (``FP8_LOSS_TOL`` with FP8) and
  the first step's grad norm within ``NORM_RTOL`` (FP8: ``FP8_NORM_RTOL``);
- ``refused``: validation said no before anything was allocated (its message is the row's note);
- ``FAIL``: a traceback, or numbers outside the tolerance.

Tolerances (bf16 weights and activations, two steps of lr 1e-3 from the same seed and mock batch):
a layout only reorders bf16 sums, so the losses (about 6.9 at start) agree to ``LOSS_TOL`` = 0.02;
FP8 quantizes every block GEMM's operands (e4m3 forward, e5m2 gradients): 0.05.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/gpu/feature_matrix.py OUT.json

after ``python tests/gpu/feature_matrix.py REF.json --write-reference`` (one GPU, the plain path
of each model) with ``--reference REF.json``, and writes the rows.
``tests/gpu/test_feature_matrix_gpu.py`` runs it at 1, 2 and 4 GPUs and keeps the table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
import traceback

import torch
import torch.distributed as dist

LOSS_TOL, FP8_LOSS_TOL = 0.02, 0.05
NORM_RTOL, FP8_NORM_RTOL = 0.05, 0.15

COMMON = ["--mock-data", "--make-vocab-size-divisible-by", "1", "--vocab-size", "1024", "--seq-length", "256",
          "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--lr-warmup-iters", "0", "--eval-interval", "0",
          "--log-interval", "100", "--bf16", "--seed", "1234", "--distributed-timeout-minutes", "2"]  # fmt: skip
MODELS = {
    "dense": ["--preset", "tiny-llama", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
              "--num-query-groups", "4", "--ffn-hidden-size", "512"],
    "moe": ["--preset", "tiny-mixtral", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
            "--num-query-groups", "4", "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
            "--moe-shared-expert-intermediate-size", "256", "--max-position-embeddings", "256"],
    "mla": ["--preset", "tiny-deepseek", "--max-position-embeddings", "256"],
}  # fmt: skip
LAYOUTS = {  # world size -> {name: flags}; names with "ep" need experts
    1: {"one": ["--micro-batch-size", "2"]},
    2: {
        "tp2_sp": ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "2"],
        "pp2_vpp2": ["--pp", "2", "--virtual-pipeline-model-parallel-size", "2", "--micro-batch-size", "2"],
        "cp2": ["--cp", "2", "--micro-batch-size", "2"],
        "fsdp_dp2": ["--fsdp", "--micro-batch-size", "2"],
        "dp2_distopt": ["--use-distributed-optimizer", "--micro-batch-size", "2"],
        "ep2": ["--ep", "2", "--micro-batch-size", "2"],
    },
    4: {
        "tp4_sp": ["--tp", "4", "--sequence-parallel", "--micro-batch-size", "2"],
        "tp2_sp_dp2_distopt": ["--tp", "2", "--sequence-parallel", "--use-distributed-optimizer", "--micro-batch-size", "2"],
        "pp2_tp2_sp": ["--pp", "2", "--tp", "2", "--sequence-parallel", "--micro-batch-size", "1"],
        "cp2_dp2": ["--cp", "2", "--micro-batch-size", "2"],
        "fsdp_dp4": ["--fsdp", "--micro-batch-size", "2"],
        "ep2_etp2": ["--ep", "2", "--expert-tensor-parallel-size", "2", "--tp", "2", "--sequence-parallel", "--micro-batch-size", "2"],
        "ep4": ["--ep", "4", "--micro-batch-size", "2"],
    },
}
RECOMPUTE = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full": ["--recompute-granularity", "full"],
    "moe": ["--moe-layer-recompute"],
}
REFERENCE = ["--micro-batch-size", "2", "--no-gradient-accumulation-fusion"]


MLA_LAYOUTS = ("one", "tp2_sp", "cp2", "ep2", "ep2_etp2")  # the others repeat the MoE model's rows
COMPILED = {"dense": ("none", "full", "full+fp8"), "moe": ("full",), "mla": ("full",)}  # on one GPU, and dense tp2 + sp full


def combinations(model: str, layout: str) -> list[tuple[str, bool, bool, bool]]:
    """(recompute, fusion, fp8, compile) rows for one model and layout. On one GPU every recompute
    × fusion, FP8 with none, full and MoE-layer recompute, and the compiled rows of ``COMPILED``
    (each costs a compilation; compile turns fusion off). Under a layout: no, full and MoE-layer
    recompute with fusion (the default), full without it, and FP8 with full and MoE-layer recompute."""
    moe = model != "dense"
    if layout == "one":
        rows = [(r, fusion, False, False) for r in RECOMPUTE if moe or r != "moe" for fusion in (True, False)]
        rows += [(r, True, True, False) for r in ("none", "full", "moe") if moe or r != "moe"]
        rows += [(c.split("+")[0], False, c.endswith("fp8"), True) for c in COMPILED[model]]
        return rows
    rows = [("none", True, False, False), ("full", True, False, False), ("full", False, False, False), ("full", True, True, False)]
    rows += [("moe", True, False, False), ("moe", True, True, False)] if moe else []
    rows += [("full", False, False, True)] if (layout, model) == ("tp2_sp", "dense") else []
    return rows


def wanted(model: str, layout: str) -> bool:
    """Expert layouts need experts; MLA runs where its attention differs from the MoE model's."""
    if model == "dense":
        return "ep" not in layout
    return model != "mla" or layout in MLA_LAYOUTS


def row_flags(model: str, layout_flags: list[str], recompute: str, fusion: bool, fp8: bool, compiled: bool) -> list[str]:
    flags = COMMON + MODELS[model] + layout_flags + RECOMPUTE[recompute]
    flags += [] if fusion else ["--no-gradient-accumulation-fusion"]
    flags += ["--fp8-format", "hybrid"] if fp8 else []
    return flags + (["--compile"] if compiled else [])


def train(flags: list[str]) -> dict:
    """Two steps through the trainer built from ``flags``: losses and grad norms, or why not."""
    from meshtron.config import build_config
    from meshtron.errors import ConfigError
    from meshtron.training.trainer import Trainer

    start, trainer = time.perf_counter(), None
    try:
        trainer = Trainer(build_config(None, flags), log=lambda _: None)
        result = trainer.run()
        out = {"status": "ran", "losses": result.losses, "grad_norms": result.grad_norms}
    except ConfigError as err:
        out = {"status": "refused", "note": " ".join(str(err).split())[:240]}
    except Exception:  # noqa: BLE001 - the row records any failure and the matrix goes on
        out = {"status": "FAIL", "note": traceback.format_exc()[-1500:]}
    finally:
        # Each trainer made its own groups: free their communicators, except where FSDP2's
        # DeviceMesh (which torch caches by group) may be handed them again.
        if trainer is not None and dist.is_initialized() and "--fsdp" not in flags:
            for group in {id(g): g for g in trainer.mesh._groups.values()}.values():
                dist.destroy_process_group(group)
        del trainer
        torch.cuda.empty_cache()
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def judge(row: dict, ref: dict, fp8: bool) -> dict:
    if row["status"] != "ran":
        return row
    loss_tol, norm_rtol = (FP8_LOSS_TOL, FP8_NORM_RTOL) if fp8 else (LOSS_TOL, NORM_RTOL)
    loss_diff = max(abs(a - b) for a, b in zip(row["losses"], ref["losses"], strict=True))
    norm_diff = abs(row["grad_norms"][0] - ref["grad_norms"][0]) / ref["grad_norms"][0]
    ok = loss_diff <= loss_tol and norm_diff <= norm_rtol
    return {**row, "status": "ok" if ok else "FAIL", "loss_diff": loss_diff, "norm_rdiff": norm_diff,
            "note": row.get("note", "") if ok else f"loss diff {loss_diff:.4f} (tol {loss_tol}), grad norm {norm_diff:.3f} (tol {norm_rtol})"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", help="rows (JSON); with --write-reference the references")
    parser.add_argument("--reference", default="", help="references from a --write-reference run")
    parser.add_argument("--write-reference", action="store_true", help="one GPU: the plain path of each model only")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layouts", default="", help="only these layouts (comma-separated names)")
    args = parser.parse_args()
    models = args.models.split(",")
    if args.write_reference:
        with open(args.out, "w") as f:
            json.dump({model: train(COMMON + MODELS[model] + REFERENCE) for model in models}, f)
        return
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1 and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if world > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # gloo: a dry run on the CPU
    with open(args.reference) as f:
        refs = json.load(f)
    rows = []
    for model, (layout, layout_flags) in itertools.product(models, LAYOUTS[world].items()):
        if not wanted(model, layout) or (args.layouts and layout not in args.layouts.split(",")):
            continue
        for recompute, fusion, fp8, compiled in combinations(model, layout):
            row = judge(train(row_flags(model, layout_flags, recompute, fusion, fp8, compiled)), refs[model], fp8)
            rows.append({"gpus": world, "model": model, "layout": layout, "recompute": recompute, "fusion": fusion,
                         "fp8": fp8, "compile": compiled, **row})  # fmt: skip
            if rank == 0:
                print(f"{world} {model:5s} {layout:18s} rc={recompute:9s} fusion={fusion!s:5s} fp8={fp8!s:5s} "
                      f"compile={compiled!s:5s} {row['status']:7s} {row.get('seconds', '')}s {row.get('note', '')}", flush=True)  # fmt: skip
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
