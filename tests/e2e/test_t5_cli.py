"""T5 end to end on the CPU: ``meshtron train --model-type t5`` on the embedded corpus (split into
sentences, WordPiece vocabulary with 100 sentinels), the span-corruption loss falling, evaluation,
a checkpoint, a resume from it, and ``meshtron generate`` decoding a prompt with sentinels."""

import pytest

from test_bert_cli import _column, meshtron

pytestmark = pytest.mark.slow


def test_tiny_t5_trains_on_the_embedded_corpus_resumes_and_generates(tmp_path):
    common = ["--model-type", "t5", "--preset", "tiny-t5", "--data-cache-path", str(tmp_path / "cache"),
              "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "3e-3", "--lr-warmup-iters", "5",
              "--log-interval", "10", "--eval-interval", "30", "--eval-iters", "2", "--train-iters", "40",
              "--save", str(tmp_path / "ckpt"), "--device", "cpu"]  # fmt: skip
    out = meshtron("train", *common, "--exit-interval", "30", cwd=tmp_path)
    losses = _column(out.stdout, "loss")
    assert len(losses) == 3 and losses[-1] < losses[0] - 1.0, out.stdout
    assert "validation at iteration 30" in out.stdout
    resumed = meshtron("train", *common, "--load", str(tmp_path / "ckpt"), cwd=tmp_path)
    assert "resumed from" in resumed.stdout and "iteration      40/40" in resumed.stdout, resumed.stdout
    text = meshtron("generate", "--load", str(tmp_path / "ckpt"), "--prompt", "the sun <extra_id_0> in the east.",
                    "--max-new-tokens", "8", "--greedy", "--device", "cpu", cwd=tmp_path).stdout  # fmt: skip
    assert text.startswith("<extra_id_0>"), text  # every target starts with the first sentinel
