"""What a run frees between steps, through the trainer.

--manual-gc: the automatic collector is off while training, full collections happen at start-up,
every --manual-gc-interval iterations and around each evaluation (not with --no-manual-gc-eval),
what start-up left alive is frozen for the later ones, and the collector's state is restored
afterwards. --empty-unused-memory-level: the CUDA cache is emptied where Megatron empties it. A
dropped trainer frees its parameters (``--calibrate`` builds several in one process)."""

from __future__ import annotations

import gc
import shlex
import weakref

import pytest
import torch

from meshtron.config import build_config
from meshtron.errors import ConfigError
from meshtron.training.trainer import Trainer
from meshtron.validation import validate

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 6 --log-interval 1 --eval-interval 3 --eval-iters 1 --mock-data --vocab-size 128 --device cpu "
        "--attention-backend unfused")  # fmt: skip


def collections_of_a_run(flags: str) -> tuple[list[tuple[int, bool, bool]], bool]:
    """Each collection during a tiny run as (generation, collector enabled then, objects frozen
    then), and whether the collector was enabled after it. Only collections from inside ``run``
    count."""
    cfg = build_config(None, shlex.split(TINY + " " + flags))
    trainer = Trainer(cfg, log=lambda _: None)
    seen: list[tuple[int, bool, bool]] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append((info["generation"], gc.isenabled(), gc.get_freeze_count() > 0))

    gc.collect()  # start from no pending garbage, so the run's own counts decide
    gc.callbacks.append(record)
    try:
        trainer.run()
    finally:
        gc.callbacks.remove(record)
    return seen, gc.isenabled()


def test_manual_gc_collects_at_start_every_interval_and_around_evaluations():
    seen, enabled_after = collections_of_a_run("--manual-gc --manual-gc-interval 2")
    # start-up 1 (before the freeze), iterations 2, 4 and 6: 3, evaluations at 3 and 6: 2 each
    assert seen == [(2, False, False)] + [(2, False, True)] * 7
    assert enabled_after and gc.get_freeze_count() == 0


def test_no_manual_gc_eval_skips_the_evaluation_collections():
    seen, _ = collections_of_a_run("--manual-gc --manual-gc-interval 2 --no-manual-gc-eval")
    assert seen == [(2, False, False)] + [(2, False, True)] * 3


def test_without_manual_gc_the_collector_stays_automatic():
    seen, enabled_after = collections_of_a_run("")
    assert all(enabled and not frozen for _, enabled, frozen in seen) and enabled_after


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        _, enabled_after = collections_of_a_run("--manual-gc")
        assert not enabled_after
    finally:
        gc.enable()


@pytest.mark.parametrize("level, empties", [(0, 0), (1, 6 + 2), (2, 6 + 6 + 2)])
def test_empty_unused_memory_level_empties_the_cache_where_megatron_does(monkeypatch, level, empties):
    """Level 1: after each of the 6 forward-backwards and the 2 evaluation steps; 2: also after
    each of the 6 optimizer steps."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    Trainer(build_config(None, shlex.split(f"{TINY} --empty-unused-memory-level {level}")), log=lambda _: None).run()
    assert len(calls) == empties


@pytest.mark.parametrize("flags, message", [
    ("--manual-gc-interval 10", "takes effect only with --manual-gc"),
    ("--manual-gc --manual-gc-interval -1", "--manual-gc-interval must be >= 0"),
    ("--empty-unused-memory-level 3", "--empty-unused-memory-level must be 0, 1 or 2"),
])  # fmt: skip
def test_wrong_manual_gc_flags_are_refused_before_training(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(build_config(None, shlex.split(TINY + " " + flags)), world_size=1)


@pytest.mark.parametrize("extra", ["", "--use-distributed-optimizer --recompute-granularity full"])
def test_a_dropped_trainer_frees_its_parameters(extra):
    """After a step, deleting the trainer and collecting frees every parameter: the gradient
    buffer's hooks (held by autograd, unseen by the collector) do not keep it alive. It fails with
    the hook bound to the buffer."""
    trainer = Trainer(build_config(None, shlex.split(TINY + " " + extra)), log=lambda _: None)
    trainer.train_step()
    params = [weakref.ref(p) for p in trainer.model.parameters()]
    del trainer
    gc.collect()
    assert params and all(ref() is None for ref in params)
