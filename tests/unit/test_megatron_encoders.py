"""``megatron-import`` of Megatron-Core's BERT and T5, held to Megatron's own checkpoints and outputs.

The data (``tests/data/megatron``, ``make_encoder_checkpoints.py``, Megatron-Core 0.19.2 on the CPU):
``bert_tp1_dist`` (torch_dist, the sentence-order head and token types), ``bert_tp2_torch`` (legacy
files of two tensor-parallel ranks, no binary head), ``t5_tp1_dist`` and ``t5_tp2_torch`` (two
encoder and two decoder layers). Each ``reference.pt`` holds the inputs and Megatron's outputs; a
second sequence ends in padding, whose positions Megatron and meshtron treat differently (Megatron
masks the padded queries' rows too), so BERT is compared at the real tokens only; T5's decoder
positions are all real.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint.checkpoint import load_checkpoint, read_meta
from meshtron.checkpoint.megatron_files import open_megatron
from meshtron.checkpoint.megatron_pickle import load_megatron_pickle
from meshtron.config import Config
from meshtron.errors import CheckpointError
from meshtron.models import build_model
from meshtron.models.megatron import megatron_family, model_config_from_args
from tests.unit.test_megatron_convert import DATA, _copy, _expect_error, _import

TOLERANCE = 1e-5  # as the GPT cases: fp32 on the CPU, the same sums in another order


def _model(out: Path) -> torch.nn.Module:
    meta = read_meta(out)
    cfg = Config.from_dict(meta["config"])
    model = build_model(cfg.model, meta["vocab_size"], cfg.data.seq_length).eval()
    load_checkpoint(out, model, load_rng=False, log=lambda _: None)
    return model


@pytest.mark.parametrize("case", ["bert_tp1_dist", "bert_tp2_torch"])
def test_bert_import_gives_megatrons_logits(case, tmp_path):
    reference = torch.load(DATA / case / "reference.pt")
    model = _model(_import(case, tmp_path / "mt"))
    assert model.cfg.model_type == "bert" and (model.binary_head is not None) == ("sop" in reference)
    real = reference["padding_mask"]
    with torch.no_grad():
        out = model(reference["tokens"], reference.get("types"), real)
    torch.testing.assert_close(out["lm"][real], reference["logits"][real], atol=TOLERANCE, rtol=TOLERANCE)
    if "sop" in reference:
        torch.testing.assert_close(out["sop"], reference["sop"], atol=TOLERANCE, rtol=TOLERANCE)
    assert (read_meta(tmp_path / "mt")["iteration"], read_meta(tmp_path / "mt")["consumed_samples"]) == (7, 112)


@pytest.mark.parametrize("case", ["t5_tp1_dist", "t5_tp2_torch"])
def test_t5_import_gives_megatrons_logits(case, tmp_path):
    reference = torch.load(DATA / case / "reference.pt")
    model = _model(_import(case, tmp_path / "mt"))
    assert (model.cfg.model_type, model.num_encoder_layers, model.num_decoder_layers) == ("t5", 2, 2)
    with torch.no_grad():
        logits = model(reference["encoder_tokens"], reference["decoder_tokens"], reference["encoder_padding_mask"])
    torch.testing.assert_close(logits, reference["logits"], atol=TOLERANCE, rtol=TOLERANCE)


def test_the_checkpoints_exercise_what_they_cover(tmp_path):
    """Token types, the encoder's final norm and its padding mask each move the outputs, so a
    mistake in their mapping shows."""
    bert = torch.load(DATA / "bert_tp1_dist" / "reference.pt")
    model = _model(_import("bert_tp1_dist", tmp_path / "bert"))
    with torch.no_grad():
        plain = model(bert["tokens"], None, bert["padding_mask"])
    assert (plain["lm"] - bert["logits"]).abs().max() > 0.1
    t5 = torch.load(DATA / "t5_tp1_dist" / "reference.pt")
    model = _model(_import("t5_tp1_dist", tmp_path / "t5"))
    with torch.no_grad():
        unmasked = model(t5["encoder_tokens"], t5["decoder_tokens"])
        model.layers[1].final_norm.weight.fill_(1.0)
        unnormed = model(t5["encoder_tokens"], t5["decoder_tokens"], t5["encoder_padding_mask"])
    assert (unmasked - t5["logits"]).abs().max() > 0.1 and (unnormed - t5["logits"]).abs().max() > 0.1


def test_the_family_comes_from_the_stacks_and_args_it_cannot_read_are_refused():
    assert [megatron_family(open_megatron(DATA / c).names) for c in ("bert_tp2_torch", "t5_tp1_dist", "llama_tp1_dist")] == ["bert", "t5", "gpt"]
    t5 = open_megatron(DATA / "t5_tp1_dist").common["args"].fields()
    with pytest.raises(CheckpointError, match="untied T5 head has no vocabulary bias"):
        model_config_from_args({**t5, "untie_embeddings_and_output_weights": True}, "args", "t5")
    bert = open_megatron(DATA / "bert_tp1_dist").common["args"].fields()
    with pytest.raises(CheckpointError, match="BERT with learned absolute positions only"):
        model_config_from_args({**bert, "position_embedding_type": "rope"}, "args", "bert")


def test_a_legacy_t5_split_over_pipeline_stages_is_refused_by_name(tmp_path, capsys):
    """Its stages would split the encoder and decoder stacks: refused, naming the format that works."""
    root = _copy("t5_tp2_torch", tmp_path)
    for path in sorted((root / "iter_0000007").glob("mp_rank_*/model_optim_rng.pt")):
        state = load_megatron_pickle(path, str(path))
        fields = {k: v for k, v in state["args"].fields().items() if isinstance(v, (int, float, str, bool, type(None)))}
        torch.save({**state, "args": argparse.Namespace(**{**fields, "pipeline_model_parallel_size": 2})}, path)
    _expect_error(capsys, root, "a legacy T5 checkpoint saved with pipeline parallelism is not read", "--ckpt-format torch_dist")
