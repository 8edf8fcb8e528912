"""Sharded checkpoints reshard: a chain of runs, each continuing the previous one's checkpoint under
another layout, gives the losses of one process training straight through.

tp2 x dp2 (distributed optimizer) -> pp2 with virtual stages -> one process -> FSDP2 dp2 ->
tp2 x pp2 with sequence parallelism, two steps each, fp32 on the CPU. The model has one kv head
for two tp ranks, so the k/v rows every tp rank copies are written once and read by both. Adam's
moments shape every later step, so a moment put back in the wrong place (or a slice of the
distributed optimizer's flat buffers misread) changes the losses. Tolerance: the layout tests'.

The first run also checks what a 4-rank save writes: 4 data files, each rank handing DCP no more
bytes than it holds, and every element of every tensor written exactly once (the ranks' bytes add
up to the checkpoint's); the last, written by 4 ranks, is read into a one-process CPU model as
``generate`` and ``hf-export`` read it.
"""

import math

import pytest
import torch

from meshtron.checkpoint.checkpoint import load_checkpoint, read_dcp_metadata
from meshtron.checkpoint.sharded import save_state, state_bytes
from meshtron.config import build_config
from meshtron.models import build_model
from meshtron.training.trainer import Trainer
from tests.distributed.launcher import run_distributed
from tests.distributed.test_trainer_layouts import BASE

TOTAL, LEG = 10, 2
CHAIN = [  # (world size, flags)
    (4, ["--tp", "2", "--micro-batch-size", "4", "--use-distributed-optimizer", "--ddp-bucket-size", "3000"]),
    (2, ["--pp", "2", "--virtual-pipeline-model-parallel-size", "2", "--micro-batch-size", "2"]),
    (1, ["--micro-batch-size", "8"]),
    (2, ["--fsdp", "--micro-batch-size", "4"]),
    (4, ["--tp", "2", "--pp", "2", "--sequence-parallel", "--micro-batch-size", "2"]),
]
MODEL = ["--num-query-groups", "1", "--train-iters", str(TOTAL)]


def _leg(rank, world_size, index, tmp):
    flags = BASE + MODEL + CHAIN[index][1] + ["--exit-interval", str(LEG), "--save", f"{tmp}/leg{index}"]
    if index:
        flags += ["--load", f"{tmp}/leg{index - 1}", "--no-load-rng"]
    trainer = Trainer(build_config(None, flags), log=lambda _: None)
    losses = trainer.run().losses
    out = {"losses": losses}
    if index == 0:  # what each rank hands DCP, against what it holds
        state = save_state(trainer.model, trainer.optimizer, trainer.mesh, True, trainer.runner.metas)
        held = sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values())
        held += trainer.optimizer.memory_bytes() + 4 * len(trainer.optimizer.param_states()) + 8
        out.update(handed=state_bytes(state), held=held)
    return out


def _checkpoint_bytes(directory):
    entries = read_dcp_metadata(directory).state_dict_metadata.values()
    return sum(math.prod(e.size) * e.properties.dtype.itemsize for e in entries)


@pytest.mark.slow
def test_chain_of_layouts_continues_like_one_process(tmp_path):
    straight = Trainer(build_config(None, BASE + MODEL + ["--micro-batch-size", "8"]), log=lambda _: None)
    reference = straight.run().losses
    assert len(reference) == TOTAL and len(set(reference)) == TOTAL

    got = []
    for index, (world, _) in enumerate(CHAIN):
        if world == 1:
            got += _leg(0, 1, index, tmp_path)["losses"]
            continue
        results = run_distributed(_leg, world, index, str(tmp_path), timeout=600)
        got += results[0]["losses"]
        if index == 0:
            directory = tmp_path / "leg0" / f"iter_{LEG:07d}"
            assert sorted(p.name for p in directory.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
            for r in results:
                assert 0 < r["handed"] <= r["held"], r
            assert sum(r["handed"] for r in results) == _checkpoint_bytes(directory)  # each element once
    assert len(got) == TOTAL
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7) for a, b in zip(got, reference)), (got, reference)
    # Not trivially equal: the legs resumed mid-schedule with the optimizer state of the previous layout.
    assert torch.tensor(got[LEG:]).ne(torch.tensor(got[:-LEG])).all()
    # The last checkpoint (4 ranks, tp2 x pp2) read into a one-process CPU model, as generate and
    # hf-export do (no process group): the weights of training straight through.
    model = build_model(straight.cfg.model, straight.vocab_size, straight.cfg.data.seq_length)
    assert load_checkpoint(tmp_path / f"leg{len(CHAIN) - 1}", model, load_rng=False)["iteration"] == TOTAL
    for name, weight in straight.model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], weight, rtol=1e-5, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")
