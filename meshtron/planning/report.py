"""What ``meshtron plan`` prints: the top layouts with their predictions and exact commands (and,
for a layout bound by the host's launches, that its prediction is the least certain), then why the
others lost, each named by the part of the step that grew most against the winner's."""

from __future__ import annotations

import shlex
from collections import Counter

from meshtron.planning.search import GIB, PlanResult, Verdict
from meshtron.planning.step_time import COMMUNICATION, HOST_WAITS, Prediction

# The step's parts grouped into the reasons a layout loses.
REASONS = {
    "bubble": ("bubble",),
    "communication": COMMUNICATION,
    "recompute": ("recompute",),
    "compute efficiency (smaller GEMMs, attention)": ("gemm", "attention", "elementwise"),
    "optimizer step": ("optimizer",),
    "host overhead": ("overhead", "host wait", "host sync"),
}


def train_command(base_args: list[str], verdict: Verdict) -> str:
    """The command that runs ``verdict``'s layout: the planner's model flags, then the layout's."""
    world = verdict.layout.world
    launcher = "meshtron train" if world == 1 else f"torchrun --nproc-per-node {min(world, 8)} -m meshtron train"
    return " ".join([launcher, *map(shlex.quote, base_args + verdict.layout.flags())])


def why_slower(loser: Prediction, winner: Prediction) -> str:
    """The reason whose parts add the most time per token against the winner's, with its share."""
    def per_token(p: Prediction, names: tuple[str, ...]) -> float:  # seconds of these parts per token of one GPU
        return sum(p.parts.get(n, 0.0) for n in names) / (p.tokens_per_s_gpu * p.step_s)

    grown = {reason: per_token(loser, names) - per_token(winner, names) for reason, names in REASONS.items()}
    reason = max(grown, key=grown.get)
    return f"{reason}: {100 * loser.share(REASONS[reason]):.0f}% of its step (winner {100 * winner.share(REASONS[reason]):.0f}%)"


def reason(verdict: Verdict, winner: Prediction | None) -> str:
    if verdict.status == "refused":
        return f"refused: {verdict.why}"
    if verdict.status == "memory":
        return f"memory: {verdict.why}"
    if winner is None or not verdict.prediction.tokens_per_s_gpu:
        return verdict.why or verdict.status
    behind = 1 - verdict.prediction.tokens_per_s_gpu / winner.tokens_per_s_gpu
    checked = "fits" if verdict.status == "fits" else "memory not checked"
    return f"slower by {100 * behind:.1f}% ({checked}); {why_slower(verdict.prediction, winner)}"


def table(result: PlanResult, base_args: list[str]) -> str:
    lines = [f"{'#':>2}  {'layout':<44} {'tokens/s/GPU':>12} {'MFU':>6} {'GiB':>6} {'step ms':>8} {'bubble':>7} {'comm':>5}"]
    for i, v in enumerate(result.fits, 1):
        p = v.prediction
        lines.append(f"{i:>2}  {v.layout.short():<44} {p.tokens_per_s_gpu:>12,.0f} {100 * p.mfu:>5.1f}% {v.memory_bytes / GIB:>6.1f} "
                     f"{1e3 * p.step_s:>8.0f} {100 * p.bubble:>6.1f}% {100 * p.share(COMMUNICATION):>4.0f}%")  # fmt: skip
        lines.append(f"    {train_command(base_args, v)}")
        if p.host_bound:
            lines.append(f"    host-bound: the GPU waits for the host's launches {100 * p.share(HOST_WAITS):.0f}% of the step, so it runs at "
                         "the host CPU's speed (one such layout: 10,241 to 14,126 tokens/s on three hosts of one kind); the least "
                         "certain prediction, unless --calibration was measured on this machine (--calibrate)")  # fmt: skip
    if not result.fits:
        lines.append("    no layout fits: add GPUs, shorten the sequence, or allow more recompute / parallelism")
    return "\n".join(lines)


def losers(result: PlanResult, show_all: bool, per_kind: int = 3) -> str:
    """Counts of each verdict, then the best few of each (every layout with ``show_all``)."""
    winner = result.fits[0].prediction if result.fits else None
    counts = Counter(v.status for v in result.others)
    names = {"fits": "fit but slower", "unchecked": "slower by prediction (memory not checked)", "memory": "over memory",
             "refused": "refused by validation"}  # fmt: skip
    lines = ["why the others lost: " + ", ".join(f"{counts[k]} {names[k]}" for k in names if counts[k])]
    shown: Counter = Counter()
    for v in sorted(result.others, key=lambda v: -v.prediction.tokens_per_s_gpu):
        if show_all or shown[v.status] < per_kind:
            shown[v.status] += 1
            lines.append(f"  {v.layout.short():<44} {v.prediction.tokens_per_s_gpu:>10,.0f}  {reason(v, winner)}")
    return "\n".join(lines)
