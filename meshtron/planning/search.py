"""The search: every candidate layout predicted, then checked best first until the top ones fit.

Checking a layout is ``validate`` (a refused one is never proposed) and ``estimate`` against the
machine's usable memory; both, and the pipeline split the run will use (refined on the schedule's
clock), cost far more than a prediction at deep pipelines, so candidates are first ranked on the
split's min-max start and checked in that order, stopping once ``top`` layouts fit and the next
candidate's prediction falls below the slowest of them. Layouts never checked are reported as
slower by prediction, not as fitting.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.config import Config
from meshtron.estimate import estimate
from meshtron.planning.hardware import Machine
from meshtron.planning.layouts import Layout, Space, apply, candidates, refusal
from meshtron.planning.step_time import Prediction, StepModel

GIB = 2**30


@dataclass
class Verdict:
    layout: Layout
    prediction: Prediction
    status: str  # "fits" (checked, fits) | "memory" | "refused" | "unchecked" (slower by prediction: not checked)
    memory_bytes: int = 0
    why: str = ""


@dataclass
class PlanResult:
    fits: list[Verdict]  # best first
    others: list[Verdict]  # refused, out of memory, or slower by prediction
    considered: int
    usable_bytes: float


def _one_line(why: str) -> str:
    return why.replace("invalid config:\n  - ", "").replace("\n  - ", "; ")


def usable_bytes(machine: Machine) -> float:
    return machine.memory_gib * machine.memory_usable * GIB


def check(cfg: Config, layout: Layout, machine: Machine) -> tuple[str, int, str]:
    """(status, bytes, why) of ``layout``: refused by validation, over the usable memory by
    ``estimate``, or fitting."""
    why = refusal(cfg, layout)
    if why:
        return "refused", 0, _one_line(why)
    need = estimate(apply(cfg, layout), layout.world).total_bytes
    if need > usable_bytes(machine):
        return "memory", need, f"needs {need / GIB:.1f} GiB > {usable_bytes(machine) / GIB:.1f} GiB usable"
    return "fits", need, ""


def search(cfg: Config, world: int, gpus_per_node: int, machine: Machine, space: Space, top: int = 5) -> PlanResult:
    """The ``top`` fitting layouts of ``cfg`` on ``world`` GPUs, fastest first, and the rest."""
    model = StepModel(cfg, machine, gpus_per_node)
    ranked, others = [], []
    for layout in candidates(cfg, world, space):
        try:
            ranked.append((model.predict(layout), layout))
        except ValueError as exc:  # a schedule or split the pipeline cannot make, which validation refuses too
            others.append(Verdict(layout, Prediction(float("inf"), 0.0, 0.0, 0.0), "refused", 0, _one_line(str(exc))))
    ranked.sort(key=lambda item: -item[0].tokens_per_s_gpu)
    considered = len(ranked) + len(others)
    fits: list[Verdict] = []
    for rough, layout in ranked:
        if len(fits) >= top and rough.tokens_per_s_gpu < min(v.prediction.tokens_per_s_gpu for v in fits):
            others.append(Verdict(layout, rough, "unchecked"))
            continue
        status, need, why = check(cfg, layout, machine)
        prediction = model.predict(layout, exact_split=True) if status == "fits" else rough
        (fits if status == "fits" else others).append(Verdict(layout, prediction, status, need, why))
    fits.sort(key=lambda v: -v.prediction.tokens_per_s_gpu)
    return PlanResult(fits[:top], fits[top:] + others, considered, usable_bytes(machine))
