"""``meshtron evaluate-retrieval``: the ICT retriever's top-k accuracy on held-out blocks.

The held-out blocks are one epoch of the ICT samples of a split the retriever did not train on
(``--split valid`` or ``test`` of the checkpoint's data, built by ``data/ict_dataset.py`` as in
training): each block once, with its pseudo-query sentence. The context tower embeds every block,
the query tower every query; a query is right at k when its own block is among its k
best-scoring blocks. It is the in-batch accuracy of training over a candidate set as large as the
split, the way Megatron's ICT evaluation embeds an evidence set and searches it.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from meshtron.checkpoint.saved_model import load_saved_model
from meshtron.data.builder import collate
from meshtron.models import spec_for
from meshtron.models.ict import ICT, retrieval_scores, topk_accuracies
from meshtron.training.trainer import setup_data_source

SPLITS = {"valid": 1, "test": 2}


@torch.no_grad()
def retrieval_accuracies(model: ICT, dataset, ks: list[int], batch_size: int = 64, device: str | torch.device = "cpu") -> dict[str, float]:
    """``{"top{k}_acc": fraction of ``dataset``'s queries whose own block is among their k best}``,
    every sample's context being one candidate."""
    model.eval()
    queries, contexts = [], []
    for start in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        batch = {k: v.to(device) for k, v in batch.items()}
        queries.append(model.encode("query", batch["query_tokens"], batch["query_padding_mask"]))
        contexts.append(model.encode("context", batch["context_tokens"], batch["context_padding_mask"]))
    scores = retrieval_scores(torch.cat(queries), torch.cat(contexts), model.cfg)
    accuracies = topk_accuracies(scores, torch.arange(len(scores), device=scores.device), ks)
    return {name: float(value) for name, value in accuracies.items()}


def held_out_blocks(saved, split: str, max_blocks: int = 0, log: Callable[[str], None] = print):
    """One epoch of the ICT samples of ``split`` of the checkpoint's data (at most ``max_blocks``;
    the epoch is shuffled, so a cut is a random subset)."""
    cfg = saved.config
    prefixes = setup_data_source(cfg, log)  # the embedded corpus, when the run trained on it

    def build(n: int):
        counts = [0, 0, 0]
        counts[SPLITS[split]] = n
        dataset = spec_for(cfg.model).datasets(cfg, saved.tokenizer, tuple(counts), cfg.train.seed, prefixes)[SPLITS[split]]
        if dataset is None:
            raise ValueError(f"the {split} split of the checkpoint's data holds no documents (see --split in its config)")
        return dataset

    blocks = len(build(1).sample_index)  # a mapping always holds whole epochs
    return build(min(blocks, max_blocks) if max_blocks else blocks)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshtron evaluate-retrieval", description="top-k retrieval accuracy of an ICT checkpoint on held-out blocks")
    parser.add_argument("--load", required=True, help="an ICT checkpoint directory (--save of an ict run)")
    parser.add_argument("--split", default="valid", choices=sorted(SPLITS), help="the held-out documents of the checkpoint's data")
    parser.add_argument("--retriever-report-topk-accuracies", "--topk", dest="topk", type=int, nargs="+", default=[1, 5, 20])
    parser.add_argument("--max-blocks", type=int, default=0, help="evaluate on at most this many blocks (0: all of the split)")
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    saved = load_saved_model(args.load, needs="ict")
    dataset = held_out_blocks(saved, args.split, args.max_blocks)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    accuracies = retrieval_accuracies(saved.model.to(device), dataset, args.topk, args.micro_batch_size, device)
    shown = " | ".join(f"{name} {100 * value:.2f}%" for name, value in accuracies.items())
    print(f"retrieval over {len(dataset)} held-out blocks ({args.split} split): {shown} (chance at top-1: {100 / len(dataset):.2f}%)")
    return 0
