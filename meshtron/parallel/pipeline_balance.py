"""Which layers each pipeline chunk holds, chosen by modeled cost.

A chunk's work is its transformer blocks plus, on the first chunk, the embedding (a lookup: free)
and, on the last, the output layer with its loss. At a 128 K vocabulary the output layer costs
about two Llama-3-8B layers (``6 V h`` FLOPs per token against ``6 P_layer + 6 S h``), so an even
split of the layers leaves the last chunk doing the most work, and every other rank waits for it
once per micro batch. ``pipeline_split`` starts from the split that minimizes the most expensive
chunk (exact, by dynamic programming) and then moves one layer at a time while the schedule, run on the clock by ``pipeline_schedules.modeled_bubble``, gets faster: under
interleaving two splits with the same costliest chunk can differ by several points of bubble.

The costs come from the model's family (``models.pipeline_costs``, by ``models.flops``'s count); a
family that models none declares the even split. Megatron's explicit split flags
(``--decoder-first/last-pipeline-num-layers``, ``--account-for-embedding/loss-in-pipeline-split``)
and ``--pipeline-split uniform`` override it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshtron.config import ParallelConfig
from meshtron.parallel.pipeline_schedules import chunk_place, modeled_bubble, split_layers


@dataclass
class PipelineCosts:
    """Training FLOPs per token of the pieces a pipeline cuts the model into (forward and backward):
    the embedding pieces (``embed``), each block, the head pieces."""

    embed: float
    blocks: list[float]
    head: float

    def chunk_costs(self, ranges: list[range]) -> list[float]:
        """The cost of each chunk of a split (``ranges``, in model order)."""
        costs = [sum(self.blocks[i] for i in r) for r in ranges]
        costs[0] += self.embed
        costs[-1] += self.head
        return costs


def pipeline_split(p: ParallelConfig, num_blocks: int, virtual: int, costs: PipelineCosts | None,
                   kind: str = "1f1b", num_micro_batches: int = 0) -> list[range]:  # fmt: skip
    """The blocks of each model chunk (``pp * virtual`` ranges in model order) for ``p``: Megatron's
    explicit flags when given; else, under ``--pipeline-split cost`` with ``costs`` known, the
    cost-balanced split (refined on the clock of schedule ``kind`` when ``num_micro_batches`` is
    given); else the even split."""
    explicit = (p.first_pipeline_stage_layers, p.last_pipeline_stage_layers,
                p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)  # fmt: skip
    pp = p.pipeline_parallel
    if any(explicit) or p.pipeline_split == "uniform" or costs is None or pp == 1:
        return split_layers(num_blocks, pp, virtual, p.first_pipeline_stage_layers or None, p.last_pipeline_stage_layers or None,
                            p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)  # fmt: skip
    sizes = min_max_split(costs, pp * virtual)
    if num_micro_batches:
        sizes = _refine_on_the_clock(tuple(sizes), costs.embed, tuple(costs.blocks), costs.head, kind, pp, min(num_micro_batches, 2 * pp))
    return _ranges(list(sizes))


def min_max_split(costs: PipelineCosts, chunks: int) -> list[int]:
    """Layers per chunk minimizing the costliest chunk, then the sum of squared chunk costs (the
    more even of equally bad splits). Every chunk but the last holds a layer (the last may hold the
    output layer alone)."""
    n = len(costs.blocks)
    if n < chunks - 1:
        raise ValueError(f"{n} layers cannot fill {chunks} pipeline chunks (each but the last needs a layer); "
                         f"use fewer pipeline or virtual stages")  # fmt: skip
    prefix = [0.0]
    for c in costs.blocks:
        prefix.append(prefix[-1] + c)
    # best[k][i]: (costliest, sum of squares, sizes) of the first k chunks holding blocks [0, i)
    best: list[dict[int, tuple[float, float, list[int]]]] = [{0: (0.0, 0.0, [])}]
    for k in range(chunks):
        last, row = k == chunks - 1, {}
        for i, (worst, squares, sizes) in best[k].items():
            ends = [n] if last else range(i + 1, n - (chunks - k - 2) + 1)  # later chunks but the last need a layer
            for j in ends:
                cost = prefix[j] - prefix[i] + (costs.embed if k == 0 else 0.0) + (costs.head if last else 0.0)
                candidate = (max(worst, cost), squares + cost * cost, sizes + [j - i])
                if j not in row or candidate[:2] < row[j][:2]:
                    row[j] = candidate
        best.append(row)
    return best[chunks][n][2]


@functools.lru_cache(maxsize=256)
def _refine_on_the_clock(start: tuple[int, ...], embed: float, blocks: tuple[float, ...], head: float, kind: str, pp: int,
                         m: int) -> tuple[int, ...]:  # fmt: skip
    """Move one layer at a time, keeping the best move, while the modeled step gets faster (the
    costliest chunk breaks ties). The caller clocks at most ``2 pp`` micro batches (a multiple of
    pp, as interleaving needs): more add steady state, where only the busiest rank's load counts,
    and would make start-up slow at large pp. Cached (arguments as tuples): the estimate, the
    planner and every rank ask for the same split."""
    sizes, costs = list(start), PipelineCosts(embed, list(blocks), head)

    def score(s: list[int]) -> tuple[float, float]:
        chunk = costs.chunk_costs(_ranges(s))
        return modeled_bubble(kind, pp, m, chunk), max(chunk)

    chunks = len(sizes)
    rank = [chunk_place(kind, pp, c)[0] for c in range(chunks)]
    # a layer moves to a neighbouring chunk, or to another chunk of the same rank (its load unchanged)
    pairs = {(a, b) for a in range(chunks) for b in range(chunks) if a != b and (abs(a - b) == 1 or rank[a] == rank[b])}
    current = score(sizes)
    while True:
        moves = []
        for a, b in sorted(pairs):
            s = list(sizes)
            s[a], s[b] = s[a] - 1, s[b] + 1
            if min(s[:-1]) >= 1 and s[-1] >= 0:
                moves.append((score(s), s))
        if not moves or min(moves)[0] >= current:
            return tuple(sizes)
        current, sizes = min(moves)


def _ranges(sizes: list[int]) -> list[range]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(start, start + n) for start, n in zip(starts, sizes)]


def describe_split(ranges: list[range], costs: PipelineCosts | None, kind: str, pp: int, num_micro_batches: int) -> str:
    """The split for the start-up log: layers per model chunk and, when modeled, each chunk's and
    each rank's cost in units of the mean block, and the bubble of this split and of the even one
    on the schedule's clock."""
    line = f"pipeline split: layers per model chunk {[len(r) for r in ranges]}"
    if costs is None or not costs.blocks:
        return line + " (costs not modeled)"
    unit = sum(costs.blocks) / len(costs.blocks)
    chunk = costs.chunk_costs(ranges)
    per_rank = [0.0] * pp
    for c, cost in enumerate(chunk):
        per_rank[chunk_place(kind, pp, c)[0]] += cost
    line += (f"; modeled cost in layers per chunk [{', '.join(f'{c / unit:.2f}' for c in chunk)}], per rank "
             f"[{', '.join(f'{c / unit:.2f}' for c in per_rank)}] (output layer {costs.head / unit:.2f})")  # fmt: skip
    if pp > 1 and num_micro_batches:
        line += f"; modeled bubble {100 * modeled_bubble(kind, pp, num_micro_batches, chunk):.1f}%"
        n, chunks = len(costs.blocks), len(ranges)
        if n % chunks == 0:
            even = costs.chunk_costs(_ranges([n // chunks] * chunks))
            line += f" (even split: {100 * modeled_bubble(kind, pp, num_micro_batches, even):.1f}%)"
    return line
