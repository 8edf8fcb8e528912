"""T5 on the model contract: under tp2, tp2 with sequence parallelism (also overlapped,
--tp-comm-overlap), pp2 (the encoder's blocks on stage 0, the decoder's on stage 1, the encoder's
output carried between them; and interleaved, one block per model chunk), dp2 with the distributed
optimizer and dp2 with FSDP2 (world 2, one launch), its loss, the gradient norm, the parameters
after one optimizer step and (where a rank holds whole summed gradients: tp, pp) every gradient
equal one process's (fp32 on the CPU; losses, gradients and norms 1e-5 relative, as a norm over
each tensor; updated parameters within 1e-6 of their size plus 1e-3 of the step, leaving out the
elements whose gradient is rounding noise, see ``_above_noise``).

Three variants: the tied LM head (Megatron's T5), an untied output layer under full activation
recompute (every block its own checkpoint), and relative position buckets (each stack's table
split by heads under tp, the encoder's on pp stage 0 and the decoder's on stage 1; not
interleaved, which the validation refuses). Batches pad both sequences (encoder padding is the
cross- and self-attention's key mask; decoder padding has no loss).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor import DTensor

from launcher import by_name, run_distributed
from meshtron.config import ModelConfig, ParallelConfig, TrainConfig
from meshtron.models import build_model
from meshtron.models.contract import default_meta
from meshtron.optim.build import build_optimizer
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import gather_full
from meshtron.parallel.setup import runner_for
from test_model_contract import RTOL, _check

SEED, VOCAB, ENC_SEQ, DEC_SEQ, MICRO_BATCH, MICRO_BATCHES, LR = 1234, 128, 16, 8, 2, 4, 1e-3
T5 = ModelConfig(model_type="t5", num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0)
VARIANTS = {
    "tied": T5,
    "untied_recompute": ModelConfig(**{**T5.__dict__, "tie_embeddings": False, "recompute_granularity": "full"}),
    "relative": ModelConfig(**{**T5.__dict__, "position_embedding_type": "relative", "relative_attention_num_buckets": 8,
                               "relative_attention_max_distance": 12}),  # fmt: skip
}
LAYOUTS = {
    "tp2": (dict(tp=2), ParallelConfig(tensor_parallel=2)),
    "tp2_sp": (dict(tp=2), ParallelConfig(tensor_parallel=2, sequence_parallel=True)),
    # --tp-comm-overlap: the cross-attention's key/value projection gathers the encoder's (shorter-than-decoder) shards
    "tp2_sp_overlap": (dict(tp=2), ParallelConfig(tensor_parallel=2, sequence_parallel=True, tp_comm_overlap=True)),
    "pp2": (dict(pp=2), ParallelConfig(pipeline_parallel=2)),
    # One block per chunk: encoder 0 | encoder 1 (and its final norm) | decoder 0 | decoder 1, the
    # two streams passing through both ranks twice under the interleaved schedule.
    "pp2_interleaved": (dict(pp=2), ParallelConfig(pipeline_parallel=2, virtual_pipeline_parallel=2)),
    "dp2_distopt": (dict(dp=2), ParallelConfig(use_distributed_optimizer=True)),
    "dp2_fsdp": (dict(dp=2), ParallelConfig(fsdp=True)),
}
TRAIN = TrainConfig()
CASES = [(v, layout) for v in sorted(VARIANTS) for layout in sorted(LAYOUTS) if not (v == "relative" and layout == "pp2_interleaved")]


def _model(variant: str):
    torch.manual_seed(SEED)
    return build_model(VARIANTS[variant], VOCAB, ENC_SEQ)


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    """T5 batches as ``data/t5_dataset.py`` yields them: encoder and decoder sequences padded from
    a random length on, labels -100 and no loss at the decoder's padding."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(MICRO_BATCHES):
        enc_real = torch.arange(ENC_SEQ)[None, :] < torch.randint(ENC_SEQ // 2, ENC_SEQ + 1, (MICRO_BATCH, 1), generator=g)
        dec_real = torch.arange(DEC_SEQ)[None, :] < torch.randint(2, DEC_SEQ + 1, (MICRO_BATCH, 1), generator=g)
        labels = torch.randint(0, VOCAB, (MICRO_BATCH, DEC_SEQ), generator=g)
        out.append({
            "encoder_tokens": torch.randint(0, VOCAB, (MICRO_BATCH, ENC_SEQ), generator=g),
            "decoder_tokens": torch.randint(0, VOCAB, (MICRO_BATCH, DEC_SEQ), generator=g),
            "labels": labels.masked_fill(~dec_real, -100),
            "loss_mask": dec_real.float(),
            "encoder_padding_mask": enc_real,
            "decoder_padding_mask": dec_real,
        })  # fmt: skip
    return out


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.lru_cache
def _reference(variant: str) -> dict:
    """One process: the loss sum / loss tokens of the whole batch, its gradients, then one step."""
    model, batches = _model(variant), _micro_batches()
    optimizer = build_optimizer(model, TRAIN, torch.float32, metas={n: default_meta(n, p) for n, p in model.named_parameters()})
    optimizer.zero_grad()
    count = sum(b["loss_mask"].sum() for b in batches)
    total = torch.zeros(())
    for b in batches:
        out, _ = model.run_stage(None, b, list(model.layers), True, True)
        loss = model.loss(b, out)
        (loss.total / count).backward()
        total += loss.total.detach()
    grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    before = _params(model)
    norm = optimizer.step(LR).grad_norm
    return {"loss": (total / count).item(), "aux": {}, "grads": grads, "norm": norm, "before": before, "after": _params(model)}


def _whole(param: torch.Tensor, meta, mesh: Mesh) -> torch.Tensor:
    """The one-process tensor of a parameter: gathered over tp, or from FSDP's shards."""
    if isinstance(param, DTensor):
        return param.full_tensor().detach().clone()
    return gather_full(param.detach().clone(), meta, mesh)


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    batches = _micro_batches()
    for name, (sizes, parallel) in LAYOUTS.items():
        mesh = Mesh(**sizes, rank=rank)
        mesh.init_process_groups()
        for variant in (v for v, layout in CASES if layout == name):
            runner = runner_for(_model(variant), mesh, parallel, TRAIN, torch.float32)
            runner.optimizer.zero_grad()
            loss = runner.forward_backward([batches[i] for i in range(MICRO_BATCHES)[mesh.dp_rank :: mesh.dp]])
            runner.finalize_grads()
            # The distributed optimizer and FSDP hold each summed gradient only in its owner's shard.
            grads = {} if parallel.use_distributed_optimizer or parallel.fsdp else {
                n: gather_full(p.main_grad.clone(), runner.metas[n], mesh) for n, p in runner.model.named_parameters()}  # fmt: skip
            norm = runner.optimizer.step(LR).grad_norm
            after = {n: _whole(p, runner.metas[n], mesh) for n, p in runner.model.named_parameters()}
            out[f"{variant}/{name}"] = {"loss": (loss.total / loss.count).item(), "aux": {}, "grads": grads, "norm": norm, "after": after}
    return out


def _above_noise(grad: torch.Tensor) -> torch.Tensor:
    """1 where a gradient element stands above rounding noise, else 0. Adam's first step moves every
    element by about ``lr * sign(grad)``, so an element whose true gradient is zero (the key bias:
    softmax ignores a shift shared by all keys) moves by ``±lr`` at random in any layout."""
    return (grad.abs() > 1e-4 * grad.norm() / grad.numel() ** 0.5).to(grad.dtype)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return by_name(run_distributed(_worker, 2, timeout=300.0))


@pytest.mark.parametrize("variant,layout", CASES)
def test_t5_matches_one_process(runs, variant, layout):
    ref = _reference(variant)
    assert any(n.endswith("cross_attention.linear_kv.weight") for n in ref["grads"]) and "output.bias" in ref["grads"]
    results, name = runs[f"{variant}/{layout}"], f"t5 {variant} {layout}"
    if results[0]["grads"]:
        _check(results, ref, name)
    holders = set()
    for rank, r in enumerate(results):
        assert abs(r["loss"] - ref["loss"]) <= RTOL * ref["loss"], f"{name} rank {rank}: loss {r['loss']} != {ref['loss']}"
        assert abs(r["norm"] - ref["norm"]) <= RTOL * ref["norm"], f"{name} rank {rank}: grad norm {r['norm']} != {ref['norm']}"
        for pname, value in r["after"].items():
            step = ref["after"][pname] - ref["before"][pname]
            err = ((value - ref["after"][pname]) * _above_noise(ref["grads"][pname])).norm()
            assert err <= 1e-6 * ref["after"][pname].norm() + 1e-3 * step.norm(), f"{name} rank {rank}: {pname} after the step: {err}"
            holders.add(pname)
    assert holders == ref["after"].keys(), f"{name}: parameters no rank holds: {sorted(ref['after'].keys() - holders)}"
