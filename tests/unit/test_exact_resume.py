"""Resume is exact: 20 steps straight equal 10 steps + resume + 10 steps, bit for bit (CPU, fp32).

The resumed run is its own process, as after a crash: whatever a process sets up on its first
step (a probe, a cache) must not move the random streams the checkpoint restores. The straight run
and the first 10 steps share one process (a process costs seconds of imports): the second run
there finds that set-up done, so it also equals a fresh run only if the set-up moves nothing. The mixture-of-experts
case carries what only it has across the resume: the auxiliary-loss-free expert bias (updated
from the step's token counts, not by the optimizer), the router's input jitter (random), shared
experts, and the balancing and z-loss terms in the objective.
"""

import json
import subprocess
import sys

import pytest

from meshtron.data.preprocess import main as preprocess
from meshtron.training.sample_plan import plan_samples, schedule_note

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-shared-expert-intermediate-size", "32",
       "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid", "--moe-input-jitter-eps", "0.01",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]  # fmt: skip
RUN = """
import json, sys
from meshtron.config import build_config
from meshtron.training.trainer import Trainer
for flags in json.loads(sys.argv[1]):
    lines = []
    result = Trainer(build_config(None, flags), log=lines.append).run()
    print(json.dumps({"iteration": result.iteration, "losses": result.losses, "log": lines}))
"""


def _train(*runs: list[str]) -> dict | list[dict]:
    """Each run's iteration, losses and log, the runs one after another in one new process."""
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(runs)], capture_output=True, text=True, check=True)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"iteration"')]
    assert len(results) == len(runs), done.stdout[-3000:]
    return results[0] if len(runs) == 1 else results


def _corpus(tmp_path, documents: int = 200) -> list[str]:
    """Real documents as flags: their sample order depends on the count the indices are built for
    once it spans another number of epochs (10 documents: 32 samples of 32 tokens per epoch)."""
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1)}) + "\n" for i in range(documents)))
    preprocess(["--input", str(jsonl), "--output-prefix", str(tmp_path / "d"), "--tokenizer-type", "ByteTokenizer", "--append-eod"])
    return ["--data-path", str(tmp_path / "d_text_document"), "--tokenizer-type", "ByteTokenizer"]


@pytest.mark.parametrize("model", [["--preset", "tiny-gpt"], pytest.param(["--preset", "tiny-llama", *MOE], marks=pytest.mark.slow)], ids=["gpt", "moe"])
def test_resume_is_bit_exact(tmp_path, model):
    common = [*model, *_corpus(tmp_path),
              "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "20",
              "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--lr-warmup-iters", "4", "--eval-interval", "5",
              "--eval-iters", "1", "--fp32", "--log-interval", "100"]  # fmt: skip

    straight, first = _train(common + ["--save", str(tmp_path / "a")], common + ["--save", str(tmp_path / "b"), "--exit-interval", "10"])
    assert first["iteration"] == 10
    second = _train(common + ["--load", str(tmp_path / "b"), "--save", str(tmp_path / "b")])
    assert second["iteration"] == 20
    assert len(straight["losses"]) == 20
    assert first["losses"] + second["losses"] == straight["losses"]
    assert len(set(straight["losses"])) > 10  # the losses move: the comparison is not between constants


@pytest.mark.slow
def test_a_resume_with_other_train_iters_keeps_the_checkpoints_sample_order(tmp_path):
    """--train-iters 10 -> 6 or 16 at iteration 4: the iterations up to 10 read the samples (and
    so give the losses) of the uninterrupted run, not a reshuffle drawn for 6 x 4 or 16 x 4
    samples (other epochs: other orders from sample 0); the extra samples follow, and the log
    says what changed."""
    common = ["--preset", "tiny-gpt", *_corpus(tmp_path, documents=10), "--seq-length", "32", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--lr-warmup-iters", "2", "--lr-decay-iters", "10", "--eval-interval", "0", "--fp32",
              "--log-interval", "100"]  # fmt: skip
    straight = _train([*common, "--train-iters", "10", "--save", str(tmp_path / "b"), "--save-interval", "4"])
    at_4 = ["--load", str(tmp_path / "b"), "--ckpt-step", "4"]
    shorter = _train([*common, "--train-iters", "6", *at_4])
    assert shorter["losses"] == straight["losses"][4:6]
    assert "note: this run trains 24 samples, the checkpoint's order was drawn for 40: that order is kept" in "\n".join(shorter["log"])
    longer = _train([*common, "--train-iters", "16", *at_4])
    assert longer["losses"][:6] == straight["losses"][4:] and len(longer["losses"]) == 12
    assert ("note: this run trains 64 samples, the checkpoint's order was drawn for 40 (--train-iters x --global-batch-size): "
            "samples 0-39 keep that order (the run goes on from sample 16), samples 40-63 are a new draw") in "\n".join(longer["log"])  # fmt: skip
    assert "note: the learning-rate schedule differs" not in "\n".join(longer["log"] + shorter["log"])  # --lr-decay-iters holds it


def test_the_sample_plan_grows_only_by_the_extra_samples_and_names_a_changed_schedule():
    meta = {"consumed_samples": 16, "train_samples": [32, 16], "config": {"train": {"train_iters": 12, "global_batch_size": 4}}}
    assert plan_samples(meta, 48, 1234) == ([32, 16], None)
    assert plan_samples(meta, 64, 1234)[0] == [32, 16, 16] and "(seed 3234)" in plan_samples(meta, 64, 1234)[1]
    assert plan_samples({"consumed_samples": 16, "config": {"train": {"train_iters": 8, "global_batch_size": 4}}}, 48, 0)[0] == [32, 16]
    assert plan_samples({"consumed_samples": 0, "train_samples": [32]}, 48, 0) == ([48], None)  # weights only: a fresh draw
    saved = {"max_lr": 1e-3, "decay_iters": 8}
    assert schedule_note(saved, {"max_lr": 1e-3, "decay_iters": 8}) is None
    assert "(decay_iters 8 -> 12); pass the checkpoint's values (--lr-decay-iters" in schedule_note(saved, {"max_lr": 1e-3, "decay_iters": 12})
