"""Resume is exact: 20 steps straight equal 10 steps + resume + 10 steps, bit for bit (CPU, fp32)."""

import json

from meshtron.config import build_config
from meshtron.data.preprocess import main as preprocess
from meshtron.training.trainer import Trainer


def test_resume_is_bit_exact(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1)}) + "\n" for i in range(200)))
    preprocess(["--input", str(jsonl), "--output-prefix", str(tmp_path / "d"), "--tokenizer-type", "ByteTokenizer", "--append-eod"])
    common = ["--preset", "tiny-gpt", "--data-path", str(tmp_path / "d_text_document"), "--tokenizer-type", "ByteTokenizer",
              "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "20",
              "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--lr-warmup-iters", "4", "--eval-interval", "5",
              "--eval-iters", "1", "--fp32", "--log-interval", "100"]
    quiet = lambda _: None  # noqa: E731

    straight = Trainer(build_config(None, common + ["--save", str(tmp_path / "a")]), log=quiet).run()
    first = Trainer(build_config(None, common + ["--save", str(tmp_path / "b"), "--exit-interval", "10"]), log=quiet).run()
    assert first.iteration == 10
    second = Trainer(build_config(None, common + ["--load", str(tmp_path / "b"), "--save", str(tmp_path / "b")]), log=quiet).run()
    assert second.iteration == 20
    assert len(straight.losses) == 20
    assert first.losses + second.losses == straight.losses
    assert len(set(straight.losses)) > 10  # the losses move: the comparison is not between constants
