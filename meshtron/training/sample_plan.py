"""The order of the training samples across resumes that change ``--train-iters`` (or the batch).

A dataset's order is drawn for the number of samples it is built for (Megatron's GPT indices: how
many shuffled epochs of documents, and the shuffle over samples, both depend on it), so a resume
that built it for another count would read another order from its first step: samples already
trained on come again and others are never seen. The checkpoint therefore records the counts its
order was drawn for (``train_samples``, one per draw), and a resume builds the same datasets: a
shorter run reads a prefix of them, a longer one appends a draw of its extra samples after them
(a seed of its own, ``part_seed``), and both say so. The schedule's change is named too.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.data import ConcatDataset

SEED_STRIDE = 1000  # draw k of a plan uses seed + 1000 k: clear of the splits' seed + 0, 1, 2 (mock data)


def part_seed(seed: int, part: int) -> int:
    return seed + SEED_STRIDE * part


def plan_samples(meta: dict[str, Any] | None, wanted: int, seed: int) -> tuple[list[int], str | None]:
    """The sample counts to build the training data for (one dataset per count, read one after
    the other), and a note for the log when the run's ``wanted`` samples differ from the
    checkpoint's plan. A run that resumes no consumed samples draws afresh."""
    if not meta or not meta.get("consumed_samples"):
        return [wanted], None
    plan = [int(n) for n in meta.get("train_samples") or [_planned_by_config(meta)]]
    planned = sum(plan)
    if wanted == planned:
        return plan, None
    at = meta["consumed_samples"]
    if wanted < planned:
        return plan, (f"note: this run trains {wanted} samples, the checkpoint's order was drawn for {planned}: "
                      f"that order is kept, the run goes on from sample {at} and stops earlier")  # fmt: skip
    return plan + [wanted - planned], (
        f"note: this run trains {wanted} samples, the checkpoint's order was drawn for {planned} (--train-iters x "
        f"--global-batch-size): samples 0-{planned - 1} keep that order (the run goes on from sample {at}), "
        f"samples {planned}-{wanted - 1} are a new draw of the same data (seed {part_seed(seed, len(plan))}); "
        f"a run started with this --train-iters would have read another order")  # fmt: skip


def _planned_by_config(meta: dict[str, Any]) -> int:
    """A checkpoint from before the plan was recorded: its run's own count."""
    train = meta.get("config", {}).get("train", {})
    return int(train.get("train_iters", 0)) * int(train.get("global_batch_size", 0)) or int(meta["consumed_samples"])


def schedule_note(saved: dict[str, Any] | None, current: dict[str, Any]) -> str | None:
    """What the learning-rate schedule changes from the checkpoint's (``LRSchedule.state_dict``);
    ``decay_iters`` follows ``--train-iters`` unless ``--lr-decay-iters`` is given."""
    if not saved:
        return None
    changed = [f"{k} {saved[k]} -> {v}" for k, v in current.items() if k in saved and saved[k] != v]
    if not changed:
        return None
    return (f"note: the learning-rate schedule differs from the checkpoint's ({', '.join(changed)}); "
            "pass the checkpoint's values (--lr-decay-iters for the decay span) to keep it")  # fmt: skip


def decoupled_schedule_note(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> str | None:
    """What ``--decoupled-lr``'s rates (the embeddings' and output layer's) change from the
    checkpoint's: given, dropped or changed (its spans are the main schedule's, which
    ``schedule_note`` reports)."""

    def rates(schedule: dict[str, Any] | None) -> str:
        return f"--decoupled-lr {schedule['max_lr']:g} --decoupled-min-lr {schedule['min_lr']:g}" if schedule else "--lr"

    if rates(saved) == rates(current):
        return None
    return f"note: the checkpoint trained the embeddings and output layer at {rates(saved)}; this run at {rates(current)}"


def planned_datasets(plan: list[int], seed: int, build: Callable[[int, int, bool], tuple]) -> tuple:
    """(train, valid, test) with the plan's draws read one after the other as the training data;
    ``build(train_samples, seed, first)`` is ``build_datasets`` (valid and test only when ``first``)."""
    train, valid, test = build(plan[0], seed, True)
    if len(plan) > 1 and train is not None:
        train = ConcatDataset([train, *(build(n, part_seed(seed, k), False)[0] for k, n in enumerate(plan[1:], 1))])
    return train, valid, test
