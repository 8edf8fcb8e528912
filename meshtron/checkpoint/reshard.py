"""``meshtron convert reshard --load A --save B``: rewrite a checkpoint offline, in one process.

Every ``--load`` already reshards (each rank reads the boxes it needs from whatever layout wrote
the checkpoint), so this is for the checkpoint itself: consolidating many ranks' shard files into
one, or moving a checkpoint to a new directory verified and with a fresh completion marker. The
model and its optimizer are built as the run's config describes, on the CPU, in the dtype the
checkpoint's weights were saved in; the whole state is held in host memory at once, so the
machine running it needs the checkpoint's size in RAM. RNG states are not carried (they belong
to the writing run's ranks): resume from the rewritten checkpoint with ``--no-load-rng``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from meshtron.checkpoint.checkpoint import checkpoint_dir, load_checkpoint, read_meta, save_checkpoint
from meshtron.checkpoint.safe_metadata import read_metadata
from meshtron.config import Config, ParallelConfig
from meshtron.models import build_model
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.setup import runner_for
from meshtron.progress import progress


def saved_weight_dtype(directory: Path) -> torch.dtype:
    """The dtype the checkpoint's model weights were written in (bf16 for a bf16 run)."""
    metadata = read_metadata(directory / ".metadata")
    dtypes = {m.properties.dtype for key, m in metadata.state_dict_metadata.items() if key.startswith("model.")}
    floating = sorted((d for d in dtypes if d.is_floating_point), key=str)
    return floating[0] if len(floating) == 1 else torch.float32


def reshard(load_dir: str, save_dir: str, iteration: int | None = None) -> Path:
    """Load the tracker's (or ``iteration``'s) checkpoint of ``load_dir`` into one process and
    write it to ``save_dir``; returns the new checkpoint's directory."""
    meta = read_meta(load_dir, iteration)
    cfg = Config.from_dict(meta["config"])
    dtype = saved_weight_dtype(checkpoint_dir(load_dir, meta["iteration"]))
    # Each step is one library call with no loop of ours inside, so the bar counts steps and names the one running.
    with progress(3, "reshard", unit="step") as bar:
        bar.set_postfix_str("building the model")
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.model, meta["vocab_size"], cfg.data.seq_length)
        runner = runner_for(model, Mesh(), ParallelConfig(), cfg.train, dtype)
        bar.update(1)
        bar.set_postfix_str(f"loading {load_dir}")
        load_checkpoint(load_dir, runner.model, runner.optimizer, iteration=meta["iteration"], load_rng=False, metas=runner.metas)
        tokenizer = Path(load_dir) / "tokenizer"
        if tokenizer.is_dir():  # the files the meta's tokenizer paths name, beside the weights
            shutil.copytree(tokenizer, Path(save_dir) / "tokenizer", dirs_exist_ok=True)
        bar.update(1)
        bar.set_postfix_str(f"saving {save_dir}")
        final = save_checkpoint(save_dir, meta["iteration"], runner.model, runner.optimizer, meta, Mesh(), metas=runner.metas, save_rng=False)
        bar.update(1)
    return final


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshtron convert reshard", description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="checkpoint directory written by --save (any layout)")
    parser.add_argument("--save", required=True, help="directory to write the one-process checkpoint into")
    parser.add_argument("--ckpt-step", type=int, default=None, help="iteration to rewrite (default: the newest)")
    args = parser.parse_args(argv)
    print(f"wrote {reshard(args.load, args.save, args.ckpt_step)} (resume from it with --no-load-rng)")
    return 0
