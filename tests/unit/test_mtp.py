"""Multi-token prediction in one process (``models/mtp.py``): the shifted targets, each depth's loss
against a plain re-computation from the modules, generation untouched, and the flags' checks.
The layouts are ``tests/distributed/test_mtp_layouts.py``'s."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import build_config
from meshtron.errors import ConfigError
from meshtron.models import build_model
from meshtron.models.mtp import mtp_parameter_count, shifted_targets, target_keys
from meshtron.validation import validate

VOCAB, SEQ = 64, 8


def _config(depths: int, **fields):
    m = build_config(overrides=["--model.preset", "tiny-deepseek-v3"]).model
    return dataclasses.replace(m, vocab_size=VOCAB, attention_backend="math", mtp_num_layers=depths, **fields)


def _model(depths: int, **fields):
    torch.manual_seed(3)
    return build_model(_config(depths, **fields), VOCAB, SEQ)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"tokens": torch.randint(0, VOCAB, (2, SEQ), generator=g), "labels": torch.randint(0, VOCAB, (2, SEQ), generator=g),
            "loss_mask": (torch.rand(2, SEQ, generator=g) < 0.8).float()}  # fmt: skip


def test_shifted_targets_read_ahead_within_the_document():
    tokens = torch.arange(10, 16).view(1, 6)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.tensor([[1.0, 1, 0, 1, 1, 1]]),
             "document_ids": torch.tensor([[0, 0, 0, 0, 1, 1]])}  # fmt: skip
    out = shifted_targets(batch, 2)
    t1, l1, m1 = (out[k] for k in target_keys(1))
    assert t1.tolist() == [[11, 12, 13, 14, 15, 0]] and l1.tolist() == [[12, 13, 14, 15, 16, 0]]
    # position 1 reads the masked label 2; position 3's target is in the next document; the last has none
    assert m1.tolist() == [[1.0, 0, 1, 0, 1, 0]]
    t2, l2, m2 = (out[k] for k in target_keys(2))
    assert t2.tolist() == [[12, 13, 14, 15, 0, 0]] and l2.tolist() == [[13, 14, 15, 16, 0, 0]]
    assert m2.tolist() == [[0.0, 1, 0, 0, 0, 0]]
    assert shifted_targets({"tokens": tokens}, 2) == {"tokens": tokens}  # generation: nothing to predict


@pytest.mark.parametrize("fused_loss", [True, False])
def test_depth_losses_equal_a_plain_recomputation(fused_loss):
    model = _model(2, cross_entropy_loss_fusion=fused_loss)
    batch = model.prepare_batch(_batch())
    out, aux = model.run_stage(None, batch, list(model.layers), True, True)
    loss = model.loss(batch, out)
    inputs = model.block_inputs(batch)
    hidden = model.final_norm(model.run_blocks(model.embed(batch), inputs, list(model.layers))[0]["hidden"])
    for k, depth in enumerate(model.mtp, start=1):
        tokens, labels, mask = (batch[key] for key in target_keys(k))
        joined = torch.cat([depth.enorm(model.embedding(tokens)), depth.hnorm(hidden)], dim=-1)
        hidden = depth.final_norm(depth.layer(depth.eh_proj(joined), **inputs))
        per_token = F.cross_entropy((hidden @ model.output.weight.T).flatten(0, 1), labels.flatten(), reduction="none")
        expected = 0.1 / 2 * (per_token * mask.flatten()).sum() / mask.sum()
        torch.testing.assert_close(loss.aux[f"mtp_loss/{k}"], expected, rtol=1e-5, atol=0)
    assert {"load_balancing/4", "load_balancing/5"} <= aux.keys() | loss.aux.keys()  # the depths' MoE blocks (seq-aux at 1e-4)
    (loss.total / loss.count + sum(loss.aux.values())).backward()
    assert model.mtp[1].eh_proj.weight.grad.norm() > 0 and model.mtp[0].layer.mlp.router.weight.grad.norm() > 0


def test_generation_and_the_main_loss_do_not_see_the_depths():
    """A weight depends on its name and the seed only, so the models with and without depths share
    every main weight; their logits, per-token losses and main loss sums are the same."""
    with_depths, without = _model(1), _model(0)
    batch = _batch()
    torch.testing.assert_close(with_depths(batch["tokens"]), without(batch["tokens"]), rtol=0, atol=0)
    torch.testing.assert_close(with_depths(batch["tokens"], labels=batch["labels"]), without(batch["tokens"], labels=batch["labels"]),
                               rtol=0, atol=0)  # fmt: skip
    main = with_depths.loss(batch, with_depths.run_stage(None, with_depths.prepare_batch(batch), list(with_depths.layers), True, True)[0])
    plain = without.loss(batch, without.run_stage(None, without.prepare_batch(batch), list(without.layers), True, True)[0])
    torch.testing.assert_close(main.total, plain.total, rtol=0, atol=0)
    assert {"mtp_loss/1", "load_balancing/4"} == set(main.aux) and plain.aux == {}


def test_depth_parameters_are_counted_apart():
    m = _config(1)
    depth = mtp_parameter_count(m, VOCAB, SEQ)
    assert depth == sum(p.numel() for p in _model(1).mtp.parameters()) > 0
    assert mtp_parameter_count(_config(0), VOCAB, SEQ) == 0


@pytest.mark.parametrize("flags, message", [
    (["--position-embedding-type", "learned_absolute"], "without learned positions"),
    (["--model-type", "bert", "--position-embedding-type", "rope"], "has no multi-token prediction"),
    (["--mtp-num-layers", "-1"], "must be 0"),
])  # fmt: skip
def test_flags_refused_with_the_fix(flags, message):
    cfg = build_config(None, ["--preset", "tiny-llama", "--vocab-size", "64", "--mtp-num-layers", "1", *flags])
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=1)


def test_megatron_flag_names_parse():
    cfg = build_config(None, ["--preset", "tiny-llama", "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"])
    assert (cfg.model.mtp_num_layers, cfg.model.mtp_loss_scaling_factor) == (2, 0.3)


def test_megatron_export_refuses_the_depths():
    from meshtron.checkpoint.checkpoint import CheckpointError
    from meshtron.models.megatron import check_exportable

    llama = build_config(None, ["--preset", "tiny-llama"]).model
    check_exportable(llama)
    with pytest.raises(CheckpointError, match="multi-token prediction depths"):
        check_exportable(dataclasses.replace(llama, mtp_num_layers=1))
