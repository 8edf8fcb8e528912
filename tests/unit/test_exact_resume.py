"""Resume is exact: 20 steps straight equal 10 steps + resume + 10 steps, bit for bit (CPU, fp32).

Each run is its own process, as after a crash: whatever a process sets up on its first step (a
probe, a cache) must not move the random streams the checkpoint restores. The mixture-of-experts
case carries what only it has across the resume: the auxiliary-loss-free expert bias (updated
from the step's token counts, not by the optimizer), the router's input jitter (random), shared
experts, and the balancing and z-loss terms in the objective.
"""

import json
import subprocess
import sys

import pytest

from meshtron.data.preprocess import main as preprocess

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-shared-expert-intermediate-size", "32",
       "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid", "--moe-input-jitter-eps", "0.01",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]  # fmt: skip
RUN = """
import json, sys
from meshtron.config import build_config
from meshtron.training.trainer import Trainer
result = Trainer(build_config(None, json.loads(sys.argv[1])), log=lambda _: None).run()
print(json.dumps({"iteration": result.iteration, "losses": result.losses}))
"""


def _train(flags: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(flags)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", [["--preset", "tiny-gpt"], pytest.param(["--preset", "tiny-llama", *MOE], marks=pytest.mark.slow)], ids=["gpt", "moe"])
def test_resume_is_bit_exact(tmp_path, model):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1)}) + "\n" for i in range(200)))
    preprocess(["--input", str(jsonl), "--output-prefix", str(tmp_path / "d"), "--tokenizer-type", "ByteTokenizer", "--append-eod"])
    common = [*model, "--data-path", str(tmp_path / "d_text_document"), "--tokenizer-type", "ByteTokenizer",
              "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "20",
              "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--lr-warmup-iters", "4", "--eval-interval", "5",
              "--eval-iters", "1", "--fp32", "--log-interval", "100"]  # fmt: skip

    straight = _train(common + ["--save", str(tmp_path / "a")])
    first = _train(common + ["--save", str(tmp_path / "b"), "--exit-interval", "10"])
    assert first["iteration"] == 10
    second = _train(common + ["--load", str(tmp_path / "b"), "--save", str(tmp_path / "b")])
    assert second["iteration"] == 20
    assert len(straight["losses"]) == 20
    assert first["losses"] + second["losses"] == straight["losses"]
    assert len(set(straight["losses"])) > 10  # the losses move: the comparison is not between constants
