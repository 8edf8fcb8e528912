"""Megatron-LM's Adam state through ``megatron-import``: a resumed meshtron run takes Megatron's next steps.

``tests/data/megatron/llama_adam_dist`` (fp32) and ``llama_adam_bf16_dist`` (bf16 with fp32 main
params) were trained by Megatron-LM's own DDP, optimizer and scheduler for 7 steps on fixed tokens,
saved with the optimizer (torch_dist, model-space state), then trained 3 more steps; their
``reference.pt`` holds those losses. Imported, meshtron's optimizer holds Megatron's moments and
step exactly and continues to the same losses; a fresh optimizer on the same weights does not.
``llama_adam_tp2_torch`` (fp32, two tensor-parallel ranks) and ``llama_adam_bf16_torch`` are the
same runs saved in the legacy format, whose optimizer state is keyed by position;
``llama_adam_pp2vpp2_torch`` one Adam step over virtual pipeline chunks (``make_vpp_checkpoint.py``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from meshtron.checkpoint.checkpoint import CheckpointError, load_checkpoint, read_meta
from meshtron.checkpoint.megatron_files import open_megatron
from meshtron.checkpoint.megatron_optim import model_space_kinds
from meshtron.checkpoint.megatron_pickle import load_megatron_pickle
from meshtron.cli import main as cli_main
from meshtron.config import Config
from meshtron.models import build_model
from meshtron.models.megatron import dist_candidates
from meshtron.optim.build import build_optimizer
from meshtron.optim.lr_schedule import LRSchedule
from tests.unit.test_megatron_convert import DATA


def _import(case: str, out: Path, capsys=None) -> tuple[Path, str]:
    assert cli_main(["convert", "megatron-import", "--load", str(DATA / case), "--save", str(out)]) == 0
    return out, capsys.readouterr().out if capsys else ""


def _resumed(save_dir: Path, dtype: torch.dtype, load_optim: bool):
    meta = read_meta(save_dir)
    cfg = Config.from_dict(meta["config"])
    model = build_model(cfg.model, meta["vocab_size"], cfg.data.seq_length).to(dtype)
    optimizer = build_optimizer(model, cfg.train, dtype)
    load_checkpoint(save_dir, model, optimizer, load_rng=False, load_optim=load_optim, log=lambda _: None)
    return model, optimizer, cfg, meta["iteration"]


def _continued_losses(save_dir: Path, tokens: torch.Tensor, dtype: torch.dtype, load_optim: bool = True) -> torch.Tensor:
    """The loss before each of 3 steps on ``tokens`` and after the last, as Megatron's run recorded them."""
    model, optimizer, cfg, iteration = _resumed(save_dir, dtype, load_optim)
    schedule = LRSchedule.from_config(cfg.train)

    def loss() -> torch.Tensor:
        logits = model(tokens).float()
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    losses = []
    for i in range(3):
        optimizer.zero_grad()
        value = loss()
        optimizer.scale_loss(value).backward()
        optimizer.step(schedule.lr_at(iteration + i))
        losses.append(value.item())
    with torch.no_grad():
        losses.append(loss().item())
    return torch.tensor(losses, dtype=torch.float64)


def _megatron(ckpt, kind: str, name: str) -> torch.Tensor:
    """Megatron's optimizer tensor ``kind`` of meshtron parameter ``name``."""
    keys, layer = dist_candidates(name)
    key = next(f"optimizer.state.{kind}.{k}" for k in keys if f"optimizer.state.{kind}.{k}" in ckpt.shapes)
    return ckpt.read(key, layer)


def test_fp32_adam_state_continues_as_megatron_did(tmp_path, capsys):
    out, log = _import("llama_adam_dist", tmp_path / "mt", capsys)
    assert "Adam's state imported (step 7)" in log and "--no-load-optim" not in log
    reference = torch.load(DATA / "llama_adam_dist" / "reference.pt")
    _, optimizer, cfg, iteration = _resumed(out, torch.float32, load_optim=True)
    ckpt = open_megatron(DATA / "llama_adam_dist")
    for ps in optimizer.param_states():
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ps.tensors[kind], _megatron(ckpt, kind, ps.name)), (ps.name, kind)
        assert ps.step.item() == 7
    assert (iteration, cfg.train.lr, cfg.train.lr_decay_style, cfg.train.weight_decay) == (7, 1e-2, "constant", 0.1)
    assert (cfg.train.adam_beta2, cfg.train.clip_grad) == (0.95, 1.0)
    resumed = _continued_losses(out, reference["tokens"], torch.float32)
    fresh = _continued_losses(out, reference["tokens"], torch.float32, load_optim=False)
    torch.testing.assert_close(resumed, reference["losses"], atol=1e-5, rtol=0)
    assert (fresh - reference["losses"]).abs().max() > 1e-2  # Adam's moments matter here: a fresh optimizer goes elsewhere


def test_bf16_main_params_become_the_weights_and_the_run_continues(tmp_path, capsys):
    out, log = _import("llama_adam_bf16_dist", tmp_path / "mt", capsys)
    assert "main params as the weights" in log
    ckpt = open_megatron(DATA / "llama_adam_bf16_dist")
    model, optimizer, _, _ = _resumed(out, torch.bfloat16, load_optim=True)
    for ps in optimizer.param_states():
        assert torch.equal(ps.tensors["master"], _megatron(ckpt, "fp32_param", ps.name)), ps.name
        assert torch.equal(ps.tensors["exp_avg_sq"], _megatron(ckpt, "exp_avg_sq", ps.name)), ps.name
    reference = torch.load(DATA / "llama_adam_bf16_dist" / "reference.pt")
    resumed = (_continued_losses(out, reference["tokens"], torch.bfloat16) - reference["losses"]).abs().max()
    fresh = (_continued_losses(out, reference["tokens"], torch.bfloat16, load_optim=False) - reference["losses"]).abs().max()
    assert resumed < 5e-3 and fresh > 10 * resumed  # bf16 kernels differ from Megatron's by rounding; a fresh Adam by far more


def test_legacy_adam_state_over_two_tp_ranks_continues_as_megatron_did(tmp_path, capsys):
    """Each rank's positions tied to its weights by Megatron's group order, the shards merged as the weights are."""
    out, log = _import("llama_adam_tp2_torch", tmp_path / "mt", capsys)
    assert "Adam's state imported (step 7)" in log and "--no-load-optim" not in log
    _, optimizer, cfg, iteration = _resumed(out, torch.float32, load_optim=True)
    rank1 = load_megatron_pickle(DATA / "llama_adam_tp2_torch" / "iter_0000007" / "mp_rank_01" / "model_optim_rng.pt")["optimizer"]
    moments = {ps.name: ps.tensors["exp_avg"] for ps in optimizer.param_states()}
    # rank 1's position 1 is its half of linear_proj's columns (the groups: decayed weights in order, then the norms)
    torch.testing.assert_close(moments["layers.0.self_attention.linear_proj.weight"][:, 4:], rank1["state"][1]["exp_avg"], rtol=0, atol=0)
    assert all(ps.step.item() == 7 for ps in optimizer.param_states()) and (iteration, cfg.train.weight_decay) == (7, 0.1)
    reference = torch.load(DATA / "llama_adam_tp2_torch" / "reference.pt")
    resumed = _continued_losses(out, reference["tokens"], torch.float32)
    fresh = _continued_losses(out, reference["tokens"], torch.float32, load_optim=False)
    torch.testing.assert_close(resumed, reference["losses"], atol=1e-5, rtol=0)
    assert (fresh - reference["losses"]).abs().max() > 1e-2


def test_legacy_bf16_main_params_become_the_weights_and_the_run_continues(tmp_path, capsys):
    out, log = _import("llama_adam_bf16_torch", tmp_path / "mt", capsys)
    assert "Adam's state imported (step 7, main params as the weights)" in log
    saved = load_megatron_pickle(DATA / "llama_adam_bf16_torch" / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt")["optimizer"]
    model, optimizer, _, _ = _resumed(out, torch.bfloat16, load_optim=True)
    masters = {ps.name: ps.tensors["master"] for ps in optimizer.param_states()}
    assert torch.equal(masters["embedding.weight"], saved["fp32_from_fp16_params"][0][0])  # first decayed param
    assert torch.equal(masters["final_norm.weight"], saved["fp32_from_fp16_params"][1][2])  # last of the no-decay group
    reference = torch.load(DATA / "llama_adam_bf16_torch" / "reference.pt")
    resumed = (_continued_losses(out, reference["tokens"], torch.bfloat16) - reference["losses"]).abs().max()
    fresh = (_continued_losses(out, reference["tokens"], torch.bfloat16, load_optim=False) - reference["losses"]).abs().max()
    assert resumed < 5e-3 and fresh > 10 * resumed


def _one_step_residual(weight: torch.Tensor, exp_avg: torch.Tensor, decay: float, train) -> float:
    """How far ``weight`` is from AdamW's first step from p0 = exp_avg / (1 - beta1) with the
    gradient p0 (``make_vpp_checkpoint.py``'s step): p0 (1 - lr wd) - lr p0 / (|p0| + eps)."""
    p0 = exp_avg / (1 - train.adam_beta1)
    return (weight - (p0 * (1 - train.lr * decay) - train.lr * p0 / (p0.abs() + train.adam_eps))).abs().max().item()


def test_legacy_adam_state_of_virtual_pipeline_chunks_belongs_to_its_weights(tmp_path, capsys):
    """``llama_adam_pp2vpp2_torch``: Megatron's optimizer over two chunks per rank (its positions run
    through chunk 0's params, then chunk 1's, in each group) took one step with each param as its
    own gradient, which ties each moment to its weight; a moment of another layer of the same
    shape (layer 0's for layer 2) does not fit."""
    out, log = _import("llama_adam_pp2vpp2_torch", tmp_path / "mt", capsys)
    assert "Adam's state imported (step 1)" in log
    model, optimizer, cfg, _ = _resumed(out, torch.float32, load_optim=True)
    weights, states = dict(model.named_parameters()), {ps.name: ps for ps in optimizer.param_states()}
    assert len(states) == len(weights) and {int(ps.step.item()) for ps in states.values()} == {1}
    for name, ps in states.items():
        decay = 0.0 if name.endswith(".bias") or ps.tensors["exp_avg"].dim() == 1 else cfg.train.weight_decay
        p0 = ps.tensors["exp_avg"] / (1 - cfg.train.adam_beta1)
        torch.testing.assert_close(ps.tensors["exp_avg_sq"], (1 - cfg.train.adam_beta2) * p0 * p0, rtol=1e-5, atol=1e-9)
        assert _one_step_residual(weights[name].detach(), ps.tensors["exp_avg"], decay, cfg.train) < 1e-6, name
    other = states["layers.0.mlp.linear_fc1.weight"].tensors["exp_avg"]
    assert _one_step_residual(weights["layers.2.mlp.linear_fc1.weight"].detach(), other, cfg.train.weight_decay, cfg.train) > 1e-2


def test_a_legacy_optimizer_whose_order_is_not_known_is_named_and_the_weights_still_come(tmp_path, capsys):
    """Param groups other than Megatron's standard two: the positions cannot be tied to the weights; said, and skipped."""
    root = Path(shutil.copytree(DATA / "gpt_tp2_torch", tmp_path / "gpt"))
    for path in sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        saved = load_megatron_pickle(path, str(path))
        fields = {k: v for k, v in saved["args"].fields().items() if isinstance(v, (int, float, str, bool, type(None)))}
        optimizer = {"state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(7.0)}}, "param_groups": [{"lr": 1e-4, "params": [0]}]}
        torch.save({**saved, "args": argparse.Namespace(**fields), "optimizer": optimizer}, path)
    assert cli_main(["convert", "megatron-import", "--load", str(root), "--save", str(tmp_path / "mt")]) == 0
    log = capsys.readouterr().out
    assert "optimizer state is not imported" in log and "are not Megatron's standard two" in log and "--no-load-optim" in log
    with pytest.raises(CheckpointError, match="without optimizer state"):
        _resumed(tmp_path / "mt", torch.float32, load_optim=True)


def test_the_distributed_optimizers_bucket_layout_is_named():
    """``dp_reshardable`` (Megatron's default for the distributed optimizer) is cut by its gradient buckets: refused with the flag that avoids it."""
    common = {"optimizer": {"param_state_sharding_type": "dp_reshardable", "optimizer": {"param_groups": []}}}
    ckpt = SimpleNamespace(shapes={"embedding.word_embeddings.weight": (96, 8)}, common=common,
                           objects=["optimizer.distributed.dp_group_idx_0.param_state/shard_0_1"])  # fmt: skip
    kinds, reason = model_space_kinds(ckpt)
    assert not kinds and "'dp_reshardable'" in reason and "--dist-ckpt-optim-fully-reshardable" in reason
    assert model_space_kinds(SimpleNamespace(shapes={}, objects=[], common={})) == (set(), None)  # no optimizer saved
