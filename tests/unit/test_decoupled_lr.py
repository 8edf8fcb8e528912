"""Megatron's --decoupled-lr / --decoupled-min-lr: the word embeddings and the output layer train
on their own rate, with the main schedule's warm-up and decay; every other parameter as before.

One process on the CPU, fp32, the reference AdamW step (the fused kernel takes one rate)."""

from __future__ import annotations

import shlex

import pytest
import torch

from meshtron.config import build_config
from meshtron.errors import ConfigError
from meshtron.optim.lr_schedule import LRSchedule
from meshtron.training.trainer import Trainer
from meshtron.validation import validate

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 4 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 --eval-interval 0 --mock-data --vocab-size 128 "
        "--device cpu --fp32 --untie-embeddings-and-output-weights --attention-backend unfused")  # fmt: skip
DECOUPLED = {"embedding.weight", "output.weight"}  # the position table (a learned one here) is not among them, as in Megatron


def trained(flags: str, steps: int) -> tuple[Trainer, dict[str, torch.Tensor]]:
    trainer = Trainer(build_config(None, shlex.split(f"{TINY} {flags}")), log=lambda _: None)
    for _ in range(steps):
        trainer.train_step()
        trainer.iteration += 1
        trainer.consumed_samples += trainer.last_batch_size
    return trainer, {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def test_the_embeddings_and_output_layer_form_the_decoupled_groups():
    trainer, weights = trained("--decoupled-lr 1e-2 --decoupled-min-lr 1e-3", 0)
    own = {name for g in trainer.optimizer.param_groups if g["decoupled_lr"] for name in g["param_names"]}
    assert own == DECOUPLED and DECOUPLED < set(weights)


def test_decoupled_rates_equal_to_the_main_ones_change_nothing():
    _, plain = trained("", 3)
    _, same = trained("--decoupled-lr 1e-3 --decoupled-min-lr 1e-4", 3)
    for name, weight in plain.items():
        assert torch.equal(same[name], weight), name


def test_each_step_moves_the_decoupled_weights_at_their_own_rate():
    """AdamW's step is linear in the rate (the update and the decoupled weight decay): at ten times
    the rates, the embeddings and output layer move ten times as far in the first step (the moments
    see the same gradients); every other weight moves as without the flag."""
    _, before = trained("", 0)
    _, plain = trained("", 1)
    trainer, tenfold = trained("--decoupled-lr 1e-2 --decoupled-min-lr 1e-3", 1)
    for name, weight in before.items():
        if name in DECOUPLED:
            torch.testing.assert_close(tenfold[name] - weight, 10 * (plain[name] - weight), rtol=1e-4, atol=1e-7)  # fp32 rounding of p + delta, delta ~5e-3
        else:
            assert torch.equal(tenfold[name], plain[name]), name
    assert trainer.last_decoupled_lr == pytest.approx(10 * trainer.last_lr)


def test_the_decoupled_schedule_has_the_main_ones_shape():
    cfg = build_config(None, shlex.split(f"{TINY} --decoupled-lr 5e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine"))
    main, own = LRSchedule.from_config(cfg.train), LRSchedule.decoupled_from_config(cfg.train)
    assert {k: v for k, v in own.state_dict().items() if "lr" not in k} == {k: v for k, v in main.state_dict().items() if "lr" not in k}
    assert (own.lr_at(0), own.lr_at(3)) == (pytest.approx(2.5e-4), pytest.approx(4.5e-5))


@pytest.mark.parametrize("flags, message", [
    ("--decoupled-min-lr 1e-4", "--decoupled-min-lr takes effect only with --decoupled-lr"),
    ("--decoupled-lr 1e-4 --decoupled-min-lr 1e-3", "need 0 <= --decoupled-min-lr <= --decoupled-lr"),
    ("--decoupled-lr 1e-3 --optimizer-impl fused", "the fused AdamW step takes one learning rate"),
    ("--decoupled-lr 1e-3 --use-precision-aware-optimizer --exp-avg-dtype bf16", "whose moments are fp32"),
])  # fmt: skip
def test_what_the_decoupled_rate_cannot_run_with_is_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(build_config(None, shlex.split(f"{TINY} {flags}")), world_size=1)


def test_a_resumed_run_is_told_when_its_decoupled_rate_differs(tmp_path):
    ckpt, first = tmp_path / "ckpt", "--decoupled-lr 1e-2 --decoupled-min-lr 1e-3"

    def run(flags: str, iters: int) -> list[str]:
        lines: list[str] = []
        cfg = build_config(None, shlex.split(f"{TINY} --train-iters {iters} --save {ckpt} --load {ckpt} {flags}"))
        Trainer(cfg, log=lines.append).run()
        return [line for line in lines if "decoupled" in line]

    assert run(first, 2) == []
    assert run(first, 3) == []  # the same rates: nothing to say
    assert run("", 4) == ["note: the checkpoint trained the embeddings and output layer at --decoupled-lr 0.01 "
                          "--decoupled-min-lr 0.001; this run at --lr"]  # fmt: skip
    assert run("--decoupled-lr 2e-2 --decoupled-min-lr 1e-3", 5) == [
        "note: the checkpoint trained the embeddings and output layer at --lr; this run at --decoupled-lr 0.02 --decoupled-min-lr 0.001"]
    assert run(first, 6) == ["note: the checkpoint trained the embeddings and output layer at --decoupled-lr 0.02 "
                             "--decoupled-min-lr 0.001; this run at --decoupled-lr 0.01 --decoupled-min-lr 0.001"]  # fmt: skip
