"""The family registry (``meshtron/models/registry.py``): ``--model-type`` names a registered
family or, as ``package.module:name``, one that module registers; an unknown one is refused naming
the registered families. A family outside ``meshtron/`` (``tests/families/token_shift``: its folder
and one registration) trains through the Trainer, saves, reshards, and is sized by the estimator,
with no line of meshtron naming it."""

from __future__ import annotations

import math

import pytest
import torch

from meshtron.checkpoint.checkpoint import load_checkpoint, read_meta
from meshtron.checkpoint.reshard import main as reshard_main
from meshtron.config import build_config
from meshtron.errors import ConfigError
from meshtron.estimate import estimate, model_parameters, stage_parameters
from meshtron.models import build_model, family, family_names, model_flops_per_token
from meshtron.training.trainer import Trainer
from meshtron.validation import validate

TOKEN_SHIFT = "tests.families.token_shift:token_shift"
FLAGS = ["--model-type", TOKEN_SHIFT, "--mock-data", "--vocab-size", "100", "--num-layers", "3", "--hidden-size", "32",
         "--num-attention-heads", "4", "--swiglu", "--normalization", "RMSNorm", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-2", "--fp32", "--device", "cpu", "--eval-interval", "0", "--log-interval", "100"]  # fmt: skip


@pytest.mark.parametrize("model_type, message", [
    ("t6", r"--model-type must be one of \[.*'gpt'.*\], got 't6' \(a family outside meshtron: --model-type package.module:name\)"),
    ("tests.families.nowhere:x", "--model-type tests.families.nowhere:x: cannot import tests.families.nowhere"),
    ("tests.families.token_shift:other", "importing tests.families.token_shift registered no family 'other'"),
])  # fmt: skip
def test_an_unknown_family_is_refused_naming_the_registered_ones(model_type, message):
    with pytest.raises(ConfigError, match=message):
        validate(build_config(None, [*FLAGS, "--model-type", model_type]))


def test_module_name_imports_and_registers_the_family():
    spec = family(TOKEN_SHIFT)
    assert spec.name == "token_shift" and "token_shift" in family_names() and family("token_shift") is spec
    assert {"gpt", "bert", "t5", "ict"} <= set(family_names())


def test_the_family_checks_its_layout():
    with pytest.raises(ConfigError, match="token_shift reads each token's predecessor"):
        validate(build_config(None, [*FLAGS, "--tp", "2", "--sequence-parallel"]), world_size=2)
    with pytest.raises(ConfigError, match="token_shift splits its MLP width 96 over tp"):
        validate(build_config(None, [*FLAGS, "--ffn-hidden-size", "96", "--tp", "64"]), world_size=64)


def test_token_shift_trains_saves_reshards_and_is_estimated(tmp_path):
    saved, rewritten = tmp_path / "saved", tmp_path / "rewritten"
    trainer = Trainer(build_config(None, [*FLAGS, "--train-iters", "6", "--save", str(saved)]), log=lambda _: None)
    losses = trainer.run().losses
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]

    assert reshard_main(["--load", str(saved), "--save", str(rewritten)]) == 0
    one_process = build_model(trainer.cfg.model, read_meta(rewritten)["vocab_size"], 16)
    load_checkpoint(rewritten, one_process, load_rng=False)
    loaded = one_process.state_dict()
    trained = trainer.model.state_dict()
    assert loaded.keys() == trained.keys()
    for name, tensor in trained.items():  # the checkpoint keeps the tokens' rows of the padded table
        assert torch.equal(loaded[name], tensor[: loaded[name].shape[0]]), name

    cfg = trainer.cfg
    built = sum(p.numel() for p in trainer.model.parameters())
    assert stage_parameters(cfg).total == model_parameters(cfg)[0] == built
    assert estimate(cfg).param_bytes == 4 * built
    assert trainer.flops_per_token == model_flops_per_token(cfg.model, trainer.padded_vocab_size, 16) == 6.0 * built  # no attention
