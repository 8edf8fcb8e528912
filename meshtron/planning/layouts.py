"""The layouts ``meshtron plan`` considers: every way to run one config on ``world`` GPUs that the
search space allows and ``validation.validate`` accepts.

A ``Layout`` is the parallel sizes (tp, pp, virtual stages, cp, ep, etp; dp is what remains), how
data-parallel ranks share state (the distributed optimizer or FSDP2), the micro batch, recompute,
bf16 Adam moments and FP8 linears. It turns into ``meshtron train`` flags (``flags``) and into the
config those flags give (``apply``), so what the planner predicts and checks is what the printed
command runs. Tensor parallelism always comes with sequence parallelism (Megatron's advice, and
the layouts benchmarked in ``benchmarks/RESULTS.md``); dp x cp > 1 always shards the optimizer
state (the distributed optimizer or FSDP2: replicated state only costs memory).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from meshtron.config import Config, parse_overrides
from meshtron.errors import ConfigError
from meshtron.models import num_blocks
from meshtron.validation import validate

SHARDINGS = ("distributed-optimizer", "fsdp", "none")
RECOMPUTES = ("", "selective", "full")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vp: int  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    cp: int
    ep: int
    etp: int
    dp: int
    sharding: str  # one of SHARDINGS: how dp x cp ranks share parameters and optimizer state
    micro_batch: int
    recompute: str = ""  # one of RECOMPUTES
    bf16_moments: bool = False
    fp8: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def flags(self) -> list[str]:
        """The ``meshtron train`` flags of this layout (Megatron's names)."""
        out = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        out += ["--sequence-parallel"] if self.tp > 1 else []
        out += ["--virtual-pipeline-model-parallel-size", str(self.vp)] if self.vp > 1 else []
        out += ["--context-parallel-size", str(self.cp)] if self.cp > 1 else []
        out += ["--expert-model-parallel-size", str(self.ep)] if self.ep > 1 else []
        out += ["--expert-tensor-parallel-size", str(self.etp)] if self.etp > 1 else []
        out += {"distributed-optimizer": ["--use-distributed-optimizer"], "fsdp": ["--use-torch-fsdp2"], "none": []}[self.sharding]
        out += ["--micro-batch-size", str(self.micro_batch)]
        out += ["--recompute-granularity", self.recompute] if self.recompute else []
        out += ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"] if self.bf16_moments else []
        out += ["--fp8-format", "hybrid", "--compile"] if self.fp8 else []  # eager FP8 is slower than bf16 (RESULTS.md B2)
        return out

    def short(self) -> str:
        """One column of the report: ``tp2 pp4v2 cp1 dp8 mbs1 dist-opt sel``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}" + (f"v{self.vp}" if self.vp > 1 else ""), f"dp{self.dp}"]
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.etp}"] if self.etp > 1 else []
        parts += [f"mbs{self.micro_batch}", {"distributed-optimizer": "dist-opt", "fsdp": "fsdp", "none": "-"}[self.sharding]]
        parts += [{"selective": "rc-sel", "full": "rc-full"}[self.recompute]] if self.recompute else []
        parts += ["bf16-moments"] if self.bf16_moments else []
        parts += ["fp8"] if self.fp8 else []
        return " ".join(parts)


def apply(cfg: Config, layout: Layout) -> Config:
    """A copy of ``cfg`` with the fields ``layout.flags()`` set (parsed as the trainer parses them);
    each section is copied, the values inside them shared (no layout flag sets a list)."""
    out = Config(**{f.name: copy.copy(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)})
    for dotted, value in parse_overrides(layout.flags()).items():
        section, name = dotted.split(".")
        setattr(getattr(out, section), name, type(getattr(getattr(out, section), name))(value))
    return out


@dataclass(frozen=True)
class Space:
    """The search space: upper bounds of each size and which options to try."""

    max_tp: int = 8  # tensor parallelism stays inside a node (the CLI sets it to the GPUs per node)
    max_cp: int = 8
    max_pp: int = 16
    max_virtual: int = 8
    max_micro_batch: int = 8
    recomputes: tuple[str, ...] = RECOMPUTES
    bf16_moments: tuple[bool, ...] = (False, True)
    fp8: tuple[bool, ...] = (False,)
    fsdp: bool = True


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: Config, world: int, space: Space) -> Iterator[Layout]:
    """Every layout of ``space`` whose sizes multiply to ``world`` and divide what they split (the
    global batch, the experts); ``validate`` still decides (``refusal``)."""
    m, batch = cfg.model, cfg.train.global_batch_size
    blocks = num_blocks(m)
    experts = divisors(m.num_experts) if m.num_experts else [1]  # ep, and etp > 1, need experts (validation)
    for tp, cp in itertools.product(divisors(world), repeat=2):
        if tp > space.max_tp or cp > space.max_cp or world % (tp * cp):
            continue
        for pp in divisors(world // (tp * cp)):
            dp = world // (tp * cp * pp)
            if pp > min(blocks, space.max_pp) or batch % dp:
                continue
            stage = tp * cp * dp
            expert_tp = divisors(stage) if m.num_experts else [1]
            for vp, ep, etp in itertools.product(range(1, space.max_virtual + 1) if pp > 1 else [1], experts, expert_tp):
                if pp * vp > blocks + 1 or stage % (ep * etp) or etp > space.max_tp:
                    continue
                for mbs in divisors(batch // dp):
                    if mbs > space.max_micro_batch:
                        continue
                    yield from _options(tp, pp, vp, cp, ep, etp, dp, mbs, space)


def _options(tp: int, pp: int, vp: int, cp: int, ep: int, etp: int, dp: int, mbs: int, space: Space) -> Iterator[Layout]:
    shardings = ["none"] if dp * cp == 1 else ["distributed-optimizer"] + (["fsdp"] if space.fsdp and tp == pp == 1 else [])
    for sharding, recompute, moments, fp8 in itertools.product(shardings, space.recomputes, space.bf16_moments, space.fp8):
        if not (moments and sharding == "fsdp"):  # FSDP2 keeps fp32 moments
            yield Layout(tp, pp, vp, cp, ep, etp, dp, sharding, mbs, recompute, moments, fp8)


def refusal(cfg: Config, layout: Layout) -> str | None:
    """Why ``validate`` refuses ``layout`` for ``cfg`` (None: accepted)."""
    try:
        validate(apply(cfg, layout), world_size=layout.world)
    except (ConfigError, ValueError) as exc:
        return str(exc)
    return None

