"""Multi-token prediction under every layout, as a user runs it: the trainer from flags, a tiny
DeepSeek-V3 (MLA, sigmoid routing with the expert bias over expert groups, seq-aux balancing,
one dense layer) with two prediction depths, against one process.

Same seed and mock data, fp32 on the CPU, clipping active: three steps' losses, grad norms and the
last step's auxiliary terms (each depth's ``mtp_loss/k``, the balancing terms of the depths' MoE
blocks too) agree with one process to 1e-5 relative (grad norms 1e-4), every final weight (the
depths', the shared embedding and output layer, the routers' expert biases) to 1e-5 relative or
2e-5 absolute. What each layout must get right: tp2 and tp2 + sp split the depths' blocks like
the model's and keep ``eh_proj`` and the depths' norms whole (sequence-partial gradients under
sp); pp2 puts the depths on the last stage with a copy of the embedding whose two gradients meet;
ep2 spreads the depths' experts; cp2 reads the shifted targets cut from the whole sequence and
sums each depth's loss and count over the cp ranks; dp2 and FSDP2 average the per-micro-batch
depth losses like any auxiliary term. The pp2 run's checkpoint (the embedding saved once, though
both stages hold it) loads into one process with every weight it trained, bit for bit.
"""

import math

import pytest
import torch

from meshtron.config import build_config
from meshtron.training.trainer import Trainer
from tests.distributed.full_weights import full_weights
from tests.distributed.launcher import run_distributed

STEPS = 3
BASE = [
    "--preset", "tiny-deepseek-v3", "--mtp-num-layers", "2", "--mock-data", "--vocab-size", "128",
    "--make-vocab-size-divisible-by", "1", "--seq-length", "16", "--global-batch-size", "8", "--train-iters", str(STEPS),
    "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "0.05", "--adam-eps", "1e-4", "--fp32",
    "--attention-backend", "math", "--eval-interval", "0", "--log-interval", "100", "--device", "cpu",
]
LAYOUTS = {
    "tp2": ["--tp", "2", "--micro-batch-size", "4"],
    "tp2_sp": ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "4"],
    "pp2": ["--pp", "2", "--micro-batch-size", "2"],
    "ep2": ["--ep", "2", "--micro-batch-size", "2"],
    "dp2_distopt": ["--use-distributed-optimizer", "--micro-batch-size", "2"],
    "cp2": ["--cp", "2", "--micro-batch-size", "4"],
    "fsdp_dp2": ["--fsdp", "--micro-batch-size", "2"],
}


def _run(flags: list[str]) -> dict:
    trainer = Trainer(build_config(None, BASE + flags), log=lambda _: None)
    result = trainer.run()
    return {"losses": result.losses, "grad_norms": result.grad_norms, "aux": dict(trainer.last_aux),
            "weights": full_weights(trainer.model, trainer.runner.metas, trainer.mesh)}  # fmt: skip


def _layouts(rank: int, world_size: int, tmp: str) -> dict | None:
    out = {name: _run(flags + (["--save", f"{tmp}/pp2"] if name == "pp2" else [])) for name, flags in LAYOUTS.items()}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def one_process() -> dict:
    return _run(["--micro-batch-size", "8"])


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("mtp_layouts")


@pytest.fixture(scope="module")
def runs(tmp) -> dict:
    return run_distributed(_layouts, 2, str(tmp), timeout=900)[0]


def _close(a, b, rel=1e-5) -> bool:
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-7) for x, y in zip(a, b, strict=True))


def test_one_process_trains_both_depths(one_process):
    aux = one_process["aux"]
    assert {"mtp_loss/1", "mtp_loss/2"} <= aux.keys(), sorted(aux)
    # Each depth's term is factor / depths x its cross-entropy: near 0.05 x ln(128) on random tokens.
    for k in (1, 2):
        assert 0.8 * 0.05 * math.log(128) < aux[f"mtp_loss/{k}"] < 1.2 * 0.05 * math.log(128), aux
    assert any(name.startswith("load_balancing/") and name.endswith(("/4", "/5")) for name in aux)  # the depths' MoE blocks
    assert len(set(one_process["losses"])) == STEPS
    assert any(n.startswith("mtp.1.eh_proj") for n in one_process["weights"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(runs, one_process, layout):
    got, ref = runs[layout], one_process
    assert _close(got["losses"], ref["losses"]), (got["losses"], ref["losses"])
    assert _close(got["grad_norms"], ref["grad_norms"], rel=1e-4), (got["grad_norms"], ref["grad_norms"])
    assert got["aux"].keys() == ref["aux"].keys()
    for name, value in ref["aux"].items():
        assert math.isclose(got["aux"][name], value, rel_tol=1e-5), (name, got["aux"][name], value)
    assert got["weights"].keys() == ref["weights"].keys()
    for name, weight in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], weight, rtol=1e-5, atol=2e-5, msg=lambda m, name=name: f"{layout}: {name}: {m}")


def test_pp2_checkpoint_loads_into_one_process(runs, tmp):
    trainer = Trainer(build_config(None, BASE + ["--micro-batch-size", "8", "--load", str(tmp / "pp2"), "--no-load-rng"]),
                      log=lambda _: None)  # fmt: skip
    assert trainer.run().iteration == STEPS  # nothing left to train: the loaded weights as they are
    loaded = full_weights(trainer.model, trainer.runner.metas, trainer.mesh)
    assert loaded.keys() == runs["pp2"]["weights"].keys()
    for name, weight in runs["pp2"]["weights"].items():
        assert torch.equal(loaded[name], weight), name
