"""ICT end to end on the CPU: ``meshtron train --model-type ict`` on the embedded corpus (sentence
blocks with pseudo-queries), the in-batch loss falling below chance and top-k accuracies logged,
a checkpoint ``meshtron evaluate-retrieval`` scores on the held-out split, and ``--bert-load``
starting both towers from a BERT checkpoint of the same corpus."""

import math

import pytest

from test_bert_cli import _column, meshtron

pytestmark = pytest.mark.slow


def test_tiny_ict_trains_evaluates_retrieval_and_starts_from_bert(tmp_path):
    cache = ["--data-cache-path", str(tmp_path / "cache"), "--device", "cpu"]
    common = ["--preset", "tiny-ict", *cache, "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "3e-3",
              "--no-retriever-score-scaling", "--lr-warmup-iters", "10", "--retriever-report-topk-accuracies", "1", "5"]  # fmt: skip
    out = meshtron("train", *common, "--log-interval", "20", "--eval-interval", "40", "--eval-iters", "4", "--train-iters", "80",
                   "--save", str(tmp_path / "ict"), cwd=tmp_path).stdout  # fmt: skip
    top1, top5 = _column(out, "top1_acc"), _column(out, "top5_acc")
    assert len(top1) == len(top5) == 4 and all(0 <= a <= b <= 1 for a, b in zip(top1, top5)), out
    valid = [float(line.split("| loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("validation")]
    chance = math.log(8)  # 8 candidates per query: a micro batch's blocks
    # From scratch the loss sits near chance for 20-40 iterations, then falls and flattens (1.90-1.99 at 80 seen;
    # the iteration-40 value may already be as low): the last validation below chance, not below the first.
    assert len(valid) == 2 and valid[-1] < chance - 0.05, out

    retrieval = meshtron("evaluate-retrieval", "--load", str(tmp_path / "ict"), "--topk", "1", "20", "--device", "cpu", cwd=tmp_path).stdout
    line = next(ln for ln in retrieval.splitlines() if ln.startswith("retrieval over"))
    blocks = int(line.split()[2])
    top1_pct, top20_pct = (float(line.split(f"{name} ")[1].split("%")[0]) for name in ("top1_acc", "top20_acc"))
    assert blocks > 50 and top1_pct <= top20_pct and top20_pct > 100 * 20 / blocks, line  # above chance at top-20

    meshtron("train", "--preset", "tiny-bert", *cache, "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "1",
             "--save", str(tmp_path / "bert"), cwd=tmp_path)  # fmt: skip
    started = meshtron("train", *common, "--train-iters", "2", "--eval-interval", "0", "--bert-load", str(tmp_path / "bert"), cwd=tmp_path).stdout
    assert "started towers.query, towers.context from the BERT checkpoint of iteration 1" in started, started
