"""BERT on the model contract: under tp2, tp2 with sequence parallelism (the pooler's [CLS] row
fetched from the rank holding it), the same under full activation recompute, pp2, dp2 and dp2 with
FSDP2 (world 2, one launch) its masked-LM loss, its sentence-order loss (an auxiliary term of the
loss, arising on the last stage only), every gradient and the gradient norm equal one process's
(fp32 on the CPU, 1e-5 relative, as a norm over each tensor), through the same runner as training.

Two variants: Megatron's pre-LN BERT with the tied LM head, and the post-LN one
(``--apply-residual-connection-post-layernorm``) with an untied output layer, whose bias is then
the only vocabulary-parallel parameter of its own. Batches have padding (the attention's key mask)
and both sentence orders.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor import DTensor

from launcher import by_name, run_distributed
from meshtron.config import ModelConfig, ParallelConfig, TrainConfig
from meshtron.models import build_model
from meshtron.models.bert import SOP_LOSS
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import gather_full
from meshtron.parallel.setup import runner_for
from test_model_contract import RTOL, _check

SEED, VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES = 1234, 128, 16, 2, 4
BERT = ModelConfig(model_type="bert", num_layers=4, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0)
VARIANTS = {
    "pre_ln": BERT,
    "post_ln_untied": ModelConfig(**{**BERT.__dict__, "apply_residual_connection_post_layernorm": True, "tie_embeddings": False}),
}
SP = ParallelConfig(tensor_parallel=2, sequence_parallel=True)
LAYOUTS = {  # name: (mesh sizes, parallel config, recompute granularity)
    "tp2": (dict(tp=2), ParallelConfig(tensor_parallel=2), ""),
    "tp2_sp": (dict(tp=2), SP, ""),
    "tp2_sp_recompute": (dict(tp=2), SP, "full"),
    "pp2": (dict(pp=2), ParallelConfig(pipeline_parallel=2), ""),
    "dp2": (dict(dp=2), ParallelConfig(), ""),
    "dp2_fsdp": (dict(dp=2), ParallelConfig(fsdp=True), ""),
}


def _model(variant: str, recompute: str = ""):
    torch.manual_seed(SEED)
    return build_model(ModelConfig(**{**VARIANTS[variant].__dict__, "recompute_granularity": recompute}), VOCAB, SEQ)


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    """BERT batches as ``data/bert_dataset.py`` yields them: some sequences padded from a random
    length on, 15% of the real tokens masked (the labels), random segment split and order."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(MICRO_BATCHES):
        lengths = torch.randint(SEQ // 2, SEQ + 1, (MICRO_BATCH, 1), generator=g)
        padding_mask = torch.arange(SEQ)[None, :] < lengths
        masked = (torch.rand(MICRO_BATCH, SEQ, generator=g) < 0.15) & padding_mask
        masked[:, 1] = True  # at least one prediction per sequence
        labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        out.append({
            "tokens": torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g),
            "types": (torch.arange(SEQ)[None, :] >= torch.randint(2, SEQ // 2, (MICRO_BATCH, 1), generator=g)).long(),
            "labels": labels.masked_fill(~masked, -100),
            "loss_mask": masked.float(),
            "padding_mask": padding_mask,
            "is_random": torch.randint(0, 2, (MICRO_BATCH,), generator=g),
        })  # fmt: skip
    return out


@functools.lru_cache
def _reference(variant: str) -> dict:
    """One process: the masked-LM loss sum / masked tokens of the whole batch, plus each micro
    batch's mean sentence-order loss / number of micro batches (Megatron's lm + sop)."""
    model, batches = _model(variant), _micro_batches()
    count = sum(b["loss_mask"].sum() for b in batches)
    total, sop = torch.zeros(()), 0.0
    for b in batches:
        out, _ = model.run_stage(None, b, list(model.layers), True, True)
        loss = model.loss(b, out)
        (loss.total / count + loss.aux[SOP_LOSS] / MICRO_BATCHES).backward()
        total += loss.total.detach()
        sop += loss.aux[SOP_LOSS].item() / MICRO_BATCHES
    grads = {n: p.grad for n, p in model.named_parameters()}
    norm = torch.cat([g.flatten() for g in grads.values()]).double().norm().item()  # fp32 loses 1e-5 here
    return {"loss": (total / count).item(), "aux": {SOP_LOSS: sop}, "grads": grads, "norm": norm}


def _summed_grad(param: torch.Tensor, runner, name: str, mesh: Mesh) -> torch.Tensor:
    """The one-process gradient of a parameter: gathered over tp, or from FSDP's shards."""
    if isinstance(param.grad, DTensor):
        return param.grad.full_tensor()
    return gather_full(param.main_grad.clone(), runner.metas[name], mesh)


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    batches = _micro_batches()
    for name, (sizes, parallel, recompute) in LAYOUTS.items():
        mesh = Mesh(**sizes, rank=rank)
        mesh.init_process_groups()
        for variant in VARIANTS:
            runner = runner_for(_model(variant, recompute), mesh, parallel, TrainConfig(), torch.float32)
            runner.optimizer.zero_grad()
            loss = runner.forward_backward([batches[i] for i in range(MICRO_BATCHES)[mesh.dp_rank :: mesh.dp]])
            runner.finalize_grads()
            grads = {n: _summed_grad(p, runner, n, mesh) for n, p in runner.model.named_parameters()}
            norm = runner.optimizer.step(1e-3).grad_norm
            out[f"{variant}/{name}"] = {"loss": (loss.total / loss.count).item(), "aux": {k: v.item() for k, v in loss.aux.items()},
                                        "grads": grads, "norm": norm}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return by_name(run_distributed(_worker, 2, timeout=300.0))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bert_matches_one_process(runs, variant, layout):
    ref = _reference(variant)
    assert ref["aux"][SOP_LOSS] > 0 and "output.bias" in ref["grads"] and "pooler.weight" in ref["grads"]
    name = f"bert {variant} {layout}"
    _check(runs[f"{variant}/{layout}"], ref, name)
    for rank, r in enumerate(runs[f"{variant}/{layout}"]):
        assert abs(r["norm"] - ref["norm"]) <= RTOL * ref["norm"], f"{name} rank {rank}: grad norm {r['norm']} != {ref['norm']}"
