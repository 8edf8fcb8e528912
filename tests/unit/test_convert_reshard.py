"""``meshtron convert reshard``: a checkpoint rewritten in one process holds the same weights and
optimizer state, passes its checksums, and a run resumed from it continues exactly as one resumed
from the original."""

from __future__ import annotations

import torch

from meshtron.checkpoint.checkpoint import checkpoint_dir
from meshtron.checkpoint.info import main as info_main
from meshtron.checkpoint.reshard import main as reshard_main
from meshtron.config import build_config
from meshtron.training.trainer import Trainer

FLAGS = ["--mock-data", "--preset", "tiny-llama", "--vocab-size", "128", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--eval-interval", "0", "--log-interval", "100", "--device", "cpu", "--fp32"]  # fmt: skip


def _trainer(*flags: str) -> Trainer:
    return Trainer(build_config(None, FLAGS + list(flags)), log=lambda _: None)


def test_rewritten_checkpoint_resumes_like_the_original(tmp_path, capsys, monkeypatch):
    original, rewritten = tmp_path / "original", tmp_path / "rewritten"
    _trainer("--train-iters", "3", "--save", str(original)).run()
    monkeypatch.setenv("MESHTRON_PROGRESS", "1")  # the bar of its three steps, shown though stderr is captured
    assert reshard_main(["--load", str(original), "--save", str(rewritten)]) == 0
    assert "reshard: 100%" in capsys.readouterr().err
    assert len(list(checkpoint_dir(rewritten, 3).glob("*.distcp"))) == 1
    assert info_main(["info", str(rewritten)]) == 0 and "verified OK" in capsys.readouterr().out

    states = []
    for source in (original, rewritten):
        trainer = _trainer("--train-iters", "5", "--load", str(source), "--no-load-rng")
        state = {f"model.{n}": t.clone() for n, t in trainer.model.state_dict().items()}
        for ps in trainer.optimizer.param_states():
            state.update({f"{ps.name}.{k}": t.clone() for k, t in ps.tensors.items()})
        states.append((state, trainer.run().losses))
    (before, losses_before), (after, losses_after) = states
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert losses_before == losses_after and len(losses_after) == 2
