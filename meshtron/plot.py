"""``meshtron plot RUN_DIR``: one PNG of a run from its TensorBoard events (``--tensorboard-dir``):
loss (train and validation), learning rate, gradient norm, tokens/s per device, memory and step
time, each against the iteration.

matplotlib is optional (``pip install 'meshtron[plot]'``); without it the command says so and
exits 2. Memory is the GPU's peak allocation when the run had one, else the process's peak
resident memory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from meshtron.errors import ConfigError

# (panel title, [(tag, label)]): the first tag present in a panel's list is drawn, all of them for loss.
PANELS = [
    ("loss", [("train/loss", "train"), ("valid/loss", "validation")]),
    ("learning rate", [("train/lr", "lr")]),
    ("gradient norm", [("train/grad_norm", "grad norm")]),
    ("tokens/s per device", [("perf/tokens_per_s_per_device", "tokens/s")]),
    ("memory (GiB)", [("perf/gpu_mem_gib", "GPU peak allocated"), ("perf/host_peak_rss_gib", "host peak resident")]),
    ("ms per iteration", [("perf/ms_per_iter", "ms/iter")]),
]


def event_dir(run_dir: Path) -> Path:
    """``run_dir`` itself if it holds TensorBoard event files, else the newest folder under it that does."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory; give the run's --tensorboard-dir")
    found = sorted(run_dir.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no TensorBoard events under {run_dir}; train with --tensorboard-dir {run_dir}")
    return run_dir if any(p.parent == run_dir for p in found) else found[-1].parent


def read_scalars(directory: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar series of the events in ``directory``: tag -> (steps, values), by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    out = {}
    for tag in events.Tags()["scalars"]:
        points = {e.step: e.value for e in events.Scalars(tag)}  # a resumed run's later point wins
        steps = sorted(points)
        out[tag] = (steps, [points[s] for s in steps])
    return out


def plot_run(run_dir: str, output: str = "") -> Path:
    directory = event_dir(Path(run_dir))  # a wrong directory is named first: it needs no matplotlib
    scalars = read_scalars(directory)
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("meshtron plot needs matplotlib: pip install 'meshtron[plot]' (or pip install matplotlib)") from None
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, series) in zip(axes.flat, PANELS):
        present = [(tag, label) for tag, label in series if tag in scalars]
        for tag, label in present if title == "loss" else present[:1]:
            steps, values = scalars[tag]
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, label=label)
        if not present:
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes)
        elif len(present) > 1 or title == "memory (GiB)":
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    fig.suptitle(str(directory))
    fig.tight_layout()
    path = Path(output) if output else directory / "plot.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshtron plot", description="a PNG of a run's loss, lr, grad norm, throughput and memory")
    parser.add_argument("run_dir", help="the run's --tensorboard-dir (or a folder holding it)")
    parser.add_argument("--output", default="", help="PNG path (default: RUN_DIR/plot.png)")
    args = parser.parse_args(argv)
    print(f"wrote {plot_run(args.run_dir, args.output)}")
    return 0
