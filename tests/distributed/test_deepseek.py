"""A tiny DeepSeek-V2-shaped model (multi-head latent attention with YaRN, layer 0 a dense MLP,
then mixture-of-experts layers with shared experts) under tp2, tp2 + sequence parallelism (also
overlapped, --tp-comm-overlap), cp2 (ring and all-gather) and pp2, against one process: step loss,
auxiliary terms and every gradient within 1e-5 (fp32, CPU, relative norm per tensor), through the
runner as training uses it.

Both query paths run: the full query projection (V2-Lite) and the low-rank one with its norm
(V2). Under tp the shared RoPE key is read by each rank's heads, so its gradient must be summed
over tp (``rope_key_to_heads``); under sp the down-projections and latent norms see their rank's
tokens (gradients summed over tp); under cp the ring carries keys 24 wide and values 16 wide and
uses MLA's own softmax scale (YaRN's temperature), all of which these layouts would get wrong
otherwise. Routing is token by token, so sp and cp run the MoE layers without balancing losses
(which would see one shard's tokens; validation refuses them there); tp and pp keep both losses.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from launcher import by_name, run_distributed
from meshtron.config import ParallelConfig, build_config
from meshtron.models import build_model
from meshtron.parallel.mesh import Mesh
from test_model_contract import _check, _train_step, token_batches

SEED, VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES = 1234, 128, 16, 2, 4
BASE = dataclasses.replace(build_config(overrides=["--model.preset", "tiny-deepseek"]).model, vocab_size=VOCAB,
                           attention_backend="math", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)  # fmt: skip
CONFIGS = {
    "lite": BASE,
    "full": dataclasses.replace(BASE, q_lora_rank=24),
}
for _name in list(CONFIGS):
    CONFIGS[f"{_name}_token_wise"] = dataclasses.replace(CONFIGS[_name], moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
# layout -> (mesh sizes, parallel config fields, which configs run on it)
LAYOUTS = {
    "tp2": (dict(tp=2), dict(tensor_parallel=2), ("lite", "full")),
    "tp2_sp": (dict(tp=2), dict(tensor_parallel=2, sequence_parallel=True), ("lite_token_wise", "full_token_wise")),
    # --tp-comm-overlap through MLA's head-split up-projections (the latents' norms stay replicated)
    "tp2_sp_overlap": (dict(tp=2), dict(tensor_parallel=2, sequence_parallel=True, tp_comm_overlap=True), ("full_token_wise",)),
    "cp2": (dict(cp=2), dict(context_parallel=2), ("lite_token_wise", "full_token_wise")),
    "cp2_all_gather": (dict(cp=2), dict(context_parallel=2, cp_comm_type="all_gather"), ("lite_token_wise",)),
    "pp2": (dict(pp=2), dict(pipeline_parallel=2), ("lite", "full")),
}
CASES = [(layout, config) for layout, (_, _, configs) in LAYOUTS.items() for config in configs]


def _model(config: str):
    torch.manual_seed(SEED)
    return build_model(CONFIGS[config], VOCAB, SEQ)


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    return token_batches(VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES)


@functools.lru_cache
def _reference(config: str) -> dict:
    """One process: loss sum / tokens of the whole batch, each auxiliary term / micro batches."""
    model, batches = _model(config), _micro_batches()
    count = sum(b["loss_mask"].sum() for b in batches)
    total, aux_sum = torch.zeros(()), {}
    for b in batches:
        out, aux = model.run_stage(None, b, list(model.layers), True, True)
        loss_sum = model.loss(b, out).total
        (loss_sum / count + sum(aux.values(), torch.zeros(())) / MICRO_BATCHES).backward()
        total += loss_sum.detach()
        for name, value in aux.items():
            aux_sum[name] = aux_sum.get(name, 0.0) + value.item() / MICRO_BATCHES
    return {"loss": (total / count).item(), "aux": aux_sum, "grads": {n: p.grad for n, p in model.named_parameters()}}


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    for layout, (sizes, fields, configs) in LAYOUTS.items():
        mesh = Mesh(**sizes, rank=rank)
        mesh.init_process_groups()
        for config in configs:
            out[f"{config}/{layout}"] = _train_step(_model(config), mesh, ParallelConfig(**fields))[1]
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return by_name(run_distributed(_worker, 2))


@pytest.mark.parametrize("layout, config", CASES)
def test_deepseek_shape_matches_one_process(runs, layout, config):
    ref = _reference(config)
    assert any(n.endswith("linear_kv_down_proj.weight") for n in ref["grads"]) and any("experts.weight1" in n for n in ref["grads"])
    assert bool(ref["aux"]) == (not config.endswith("token_wise"))
    _check(runs[f"{config}/{layout}"], ref, f"{config} {layout}")
