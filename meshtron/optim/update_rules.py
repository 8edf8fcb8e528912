"""The update rules parameter groups choose from (``--optimizer``): AdamW, SGD, Muon.

Each group of ``build_param_groups`` names its rule (``"optimizer"``); the optimizer container
(``MixedPrecisionOptimizer``) owns the masters, gradients, clipping and loss scaling, and hands
each rule's groups to that rule's torch optimizer. ``--optimizer adam`` and ``sgd`` give every
group that rule; ``muon`` gives linear layers' weights (``ParamMeta.matrix``) to Muon and the rest
(embeddings, output layer, routers, norms, biases) to AdamW, as Megatron-Core does.

Every rule's state is allocated before the first step (zero moments or momentum and a 0-d
``step``, as the first step would make them), so a checkpoint loads into it in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from meshtron.optim.muon import MatrixPlan, Muon, MuonSettings

OPTIMIZERS = ("adam", "sgd", "muon")


@dataclass(frozen=True)
class RuleSettings:
    """The rules' own hyper-parameters beside AdamW's (``--sgd-momentum``, the ``--muon-*`` flags)."""

    sgd_momentum: float = 0.9
    muon: MuonSettings = field(default_factory=MuonSettings)


def rule_of_param(optimizer: str, matrix: bool) -> str:
    """The rule a parameter takes under ``--optimizer``: Muon's non-matrices take AdamW."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {optimizer}: one of {' | '.join(OPTIMIZERS)}")
    return "adam" if optimizer == "muon" and not matrix else optimizer


def build_rules(master_groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], eps: float,
                settings: RuleSettings, plan_of: Callable[[str, torch.Tensor], MatrixPlan]) -> dict[str, torch.optim.Optimizer]:  # fmt: skip
    """``{rule: torch optimizer}`` over the groups of masters naming that rule (empty groups left
    out). AdamW's state is the container's to allocate (its moments may be views of flat
    tensors); SGD's and Muon's are allocated here. ``plan_of(name, master)``: Muon's plan of a matrix."""
    by_rule: dict[str, list[dict[str, Any]]] = {}
    for group in master_groups:
        if group["params"]:
            by_rule.setdefault(group["optimizer"], []).append(group)
    rules: dict[str, torch.optim.Optimizer] = {}
    if "adam" in by_rule:
        masters = [m for g in by_rule["adam"] for _, m in g["params"]]
        fused = True if all(m.is_cuda for m in masters) else None
        rules["adam"] = torch.optim.AdamW(by_rule["adam"], lr=lr, betas=betas, eps=eps, fused=fused)
    if "sgd" in by_rule:
        sgd = rules["sgd"] = torch.optim.SGD(by_rule["sgd"], lr=lr, momentum=settings.sgd_momentum)
        for group in sgd.param_groups:
            for master in group["params"]:
                # A zero buffer makes the first step's ``m * buf + grad`` torch's ``clone(grad)``.
                momentum = {"momentum_buffer": torch.zeros_like(master)} if settings.sgd_momentum else {}
                sgd.state[master] = {"step": torch.zeros((), dtype=torch.float32), **momentum}
    if "muon" in by_rule:
        plans = {id(m): plan_of(name, m) for g in by_rule["muon"] for name, m in g["params"]}
        rules["muon"] = Muon(by_rule["muon"], lr=lr, settings=settings.muon, plans=plans)
    return rules


def run_rules(rules: dict[str, torch.optim.Optimizer], lr: float, decoupled_lr: float | None = None) -> None:
    """One step of every rule at ``lr``, the groups marked ``"decoupled_lr"`` at ``decoupled_lr``
    (SGD's ``step`` counters, which torch does not keep, advanced here)."""
    for rule in rules.values():
        for group in rule.param_groups:
            group["lr"] = decoupled_lr if group.get("decoupled_lr") and decoupled_lr is not None else lr
        rule.step()
    if "sgd" in rules:
        torch._foreach_add_([s["step"] for s in rules["sgd"].state.values()], 1.0)
