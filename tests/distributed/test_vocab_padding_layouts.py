"""A vocabulary that pads differently under tp gives the one-process result: 300 tokens with the
default ``--make-vocab-size-divisible-by 128`` are 384 rows in one process and 512 under tp2 and
tp4 (where the last rank's shard is padding only). Model level (one launch of 4 ranks): GPT tied,
Llama untied, Llama with the unfused per-token loss, BERT (WordPiece-like: a biased, tied head on the
labelled rows) and T5 (biased head) under tp4 and tp2 x dp2 with sequence parallelism: loss and
every gradient equal one process's (fp32, 1e-5 relative), padded rows without gradient. Trainer
level: checkpoints move between tp sizes (one process -> tp4, tp2 x dp2 -> one process, and
``convert reshard``) and continue as the uninterrupted one-process run does.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from launcher import by_name, run_distributed
from meshtron.checkpoint.reshard import reshard
from meshtron.checkpoint.safe_metadata import read_metadata
from meshtron.config import ModelConfig, ParallelConfig, TrainConfig, build_config
from meshtron.models import build_model, padded_vocab_size
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import gather_full
from meshtron.parallel.setup import runner_for
from meshtron.training.trainer import Trainer

TOKENS, SEQ, MICRO_BATCHES, RTOL = 300, 16, 2, 1e-5
LLAMA = dataclasses.replace(build_config(overrides=["--model.preset", "tiny-llama"]).model, num_layers=2)
ENCODER = dict(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0)
FAMILIES = {
    "gpt_tied": dataclasses.replace(LLAMA, tie_embeddings=True),
    "llama_untied": LLAMA,
    "llama_per_token": dataclasses.replace(LLAMA, fused_kernels="off"),
    "bert": ModelConfig(model_type="bert", **ENCODER),
    "t5": ModelConfig(model_type="t5", **ENCODER),
}
LAYOUTS = {  # name: (mesh sizes, parallel config)
    "tp4": (dict(tp=4), ParallelConfig(tensor_parallel=4)),
    "tp2_dp2_sp": (dict(tp=2, dp=2), ParallelConfig(tensor_parallel=2, sequence_parallel=True)),
}


def _micro_batches(family: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(MICRO_BATCHES):
        ids = lambda: torch.randint(0, TOKENS, (2, SEQ), generator=g)  # noqa: E731
        labels, mask = ids(), (torch.rand(2, SEQ, generator=g) < 0.5).float()
        labels[:, 1] = TOKENS - 1  # the last real row, on the last tp2 rank's shard
        mask[:, 1] = 1.0
        ones = torch.ones(2, SEQ, dtype=torch.bool)
        if family == "t5":
            out.append({"encoder_tokens": ids(), "decoder_tokens": ids(), "labels": labels, "loss_mask": mask,
                        "encoder_padding_mask": ones, "decoder_padding_mask": ones})  # fmt: skip
        elif family == "bert":
            out.append({"tokens": ids(), "types": torch.zeros(2, SEQ, dtype=torch.long), "labels": labels.masked_fill(mask == 0, -100),
                        "loss_mask": mask, "padding_mask": ones, "is_random": torch.tensor([0, 1])})  # fmt: skip
        else:
            out.append({"tokens": ids(), "labels": labels, "loss_mask": mask})
    return out


def _model(family: str, tp: int):
    torch.manual_seed(1234)
    return build_model(FAMILIES[family], TOKENS, SEQ, padded_vocab_size(TOKENS, 128, tp))


@functools.lru_cache
def _reference(family: str) -> dict:
    """One process, 384 rows: each micro batch's loss sum over the whole batch's count, summed."""
    model, batches = _model(family, 1), _micro_batches(family)
    count = sum(b["loss_mask"].sum() for b in batches)
    total = torch.zeros(())
    for b in batches:
        out, _ = model.run_stage(None, b, list(model.blocks()), True, True)
        loss = model.loss(b, out)
        (loss.total / count + sum(loss.aux.values()) / MICRO_BATCHES).backward()
        total += loss.total.detach()
    return {"loss": (total / count).item(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def _model_worker(rank: int, world_size: int) -> dict:
    out = {}
    for name, (sizes, parallel) in LAYOUTS.items():
        mesh = Mesh(**sizes, rank=rank)
        mesh.init_process_groups()
        for family in FAMILIES:
            batches = _micro_batches(family)
            runner = runner_for(_model(family, mesh.tp), mesh, parallel, TrainConfig(), torch.float32)
            runner.optimizer.zero_grad()
            loss = runner.forward_backward(batches[mesh.dp_rank :: mesh.dp])
            runner.finalize_grads()
            grads = {n: gather_full(p.main_grad.clone(), runner.metas[n], mesh) for n, p in runner.model.named_parameters()}
            out[f"{family}/{name}"] = {"loss": (loss.total / loss.count).item(), "grads": grads}
    return out


# ---------------------------------------------------------------------- the trainer: checkpoints across tp

STEPS, SAVED = 5, 3
BASE = [
    "--mock-data", "--vocab-size", str(TOKENS), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "2",
    "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1", "--adam-eps", "1e-4", "--fp32", "--eval-interval", "0",
    "--log-interval", "100", "--device", "cpu", "--train-iters", str(STEPS),
]  # fmt: skip


def _train(*flags: str) -> list[float]:
    return Trainer(build_config(None, BASE + list(flags)), log=lambda _: None).run().losses


def _worker(rank: int, world_size: int, from_one: str, to_one: str) -> dict:
    """Both levels in one launch: the models under each layout, then the trainer loading one
    process's checkpoint under tp4 and saving one under tp2 x dp2."""
    out = _model_worker(rank, world_size)
    out["continued_tp4"] = _train("--tp", "4", "--load", from_one, "--no-load-rng")
    _train("--tp", "2", "--save", to_one, "--exit-interval", str(SAVED))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("vocab_padding")
    whole = _train()
    _train("--save", str(tmp / "one"), "--exit-interval", str(SAVED))
    out = by_name(run_distributed(_worker, 4, str(tmp / "one"), str(tmp / "tp2"), timeout=600.0))
    out["whole"], out["tmp"] = whole, tmp
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_padded_layout_matches_one_process(runs, family, layout):
    ref = _reference(family)
    for rank, r in enumerate(runs[f"{family}/{layout}"]):
        assert abs(r["loss"] - ref["loss"]) <= RTOL * ref["loss"], f"{family} {layout} rank {rank}: loss {r['loss']} != {ref['loss']}"
        for name, want in ref["grads"].items():
            got = r["grads"][name]
            if got.shape != want.shape:  # a vocabulary tensor: 512 rows against 384
                assert got.shape[0] == 512 and want.shape[0] == 384, name
                assert got[TOKENS:].abs().max() == 0 and want[TOKENS:].abs().max() == 0, f"{name}: padded rows got a gradient"
                got, want = got[:TOKENS], want[:TOKENS]
            err = (got - want).norm() / want.norm().clamp_min(1e-30)
            assert err <= RTOL, f"{family} {layout} rank {rank} grad of {name}: relative error {err:.2e}"


def _close(a: list[float], b: list[float]) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a, b, strict=True))


def test_checkpoints_move_between_tp_sizes(runs):
    whole, tmp = runs["whole"], runs["tmp"]
    for rank, continued in enumerate(runs["continued_tp4"]):
        assert _close(continued, whole[SAVED:]), (rank, continued, whole)
    assert _close(_train("--load", str(tmp / "tp2"), "--no-load-rng"), whole[SAVED:])
    # Offline: the tp2 checkpoint rewritten for one process stores the real rows, and continues alike.
    final = reshard(str(tmp / "tp2"), str(tmp / "resharded"))
    stored = read_metadata(final / ".metadata").state_dict_metadata
    assert list(stored["model.embedding.weight"].size) == list(stored["model.output.weight"].size) == [TOKENS, 64]
    assert list(stored["optimizer.state.output.weight.exp_avg"].size) == [TOKENS, 64]
    assert _close(_train("--load", str(tmp / "resharded"), "--no-load-rng"), whole[SAVED:])
