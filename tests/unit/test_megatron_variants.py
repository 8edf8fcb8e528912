"""``megatron-import`` of the Megatron model kinds beyond GPT/Llama/SequentialMLP: latent attention
(MLA) and grouped experts, held to Megatron's own checkpoints and logits.

The data (``tests/data/megatron``): ``mla_yarn_dist`` and ``mla_tp2_torch`` written by
Megatron-Core 0.19.2 (``make_checkpoints.py``), ``grouped_tp2_dist`` and ``grouped_tp2_torch`` by
0.16.1's GroupedMLP (``make_grouped_checkpoints.py``); ``test_megatron_convert.py`` imports each to
Megatron's logits and ``test_megatron_export.py`` exports them back. Here: that those checkpoints
exercise what they are meant to (YaRN and its temperatures move the logits), how Megatron's MLA
reads its args, the names Transformer Engine's spec gives MLA, and TE's grouped experts' legacy
names, which no CPU can write (TEGroupedMLP needs Transformer Engine): moe_ep2_torch's experts
renamed as TE's ``GroupedLinear`` names them in its state dict (``weight0``, ``weight1``, ...).
And virtual pipeline stages in legacy files (``llama_pp2vpp2_torch``, ``make_vpp_checkpoint.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint.checkpoint import load_checkpoint, read_meta
from meshtron.checkpoint.megatron_files import open_megatron
from meshtron.checkpoint.megatron_pickle import load_megatron_pickle
from meshtron.config import Config
from meshtron.errors import CheckpointError
from meshtron.models import build_model
from meshtron.models.megatron import check_exportable, model_config_from_args
from tests.unit.test_megatron_convert import (
    DATA,
    _copy,
    _import,
    _import_dir,
    _logits,
)
from tests.unit.test_megatron_export import _export, _legacy_files, _legacy_flags


def _reference(case: str) -> dict[str, torch.Tensor]:
    return torch.load(DATA / case / "reference.pt")


def _args(case: str) -> dict:
    return open_megatron(DATA / case).common["args"].fields()


def _plain(fields: dict) -> argparse.Namespace:
    return argparse.Namespace(**{k: v for k, v in fields.items() if isinstance(v, (int, float, str, bool, type(None)))})


def test_mla_checkpoint_exercises_yarn_and_its_temperatures(tmp_path):
    """Imported as plain RoPE, or without YaRN's attention temperature, the logits move: the test
    data's 4x YaRN with mscale 0.8 / 0.6 is read, not defaulted."""
    out = _import("mla_yarn_dist", tmp_path / "mt")
    reference = _reference("mla_yarn_dist")
    for wrong in ({"rope_scaling": ""}, {"rope_mscale_all_dim": 0.0}, {"rope_mscale": 1.0}):
        assert (_logits(out, reference["tokens"], **wrong) - reference["logits"]).abs().max() > 0.1, wrong


def test_mla_args_read_as_megatron_builds_its_config():
    fields = _args("mla_yarn_dist")
    m = model_config_from_args(fields, "args")
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (True, 12, 16, 8, 8, 8)
    assert (m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_position_embeddings) == ("yarn", 4.0, 4096)
    assert (m.kv_channels, m.num_query_groups, m.qk_layernorm) == (0, 0, True)
    unset = model_config_from_args({**fields, "rope_type": None}, "args")  # MLATransformerConfig's default: YaRN
    assert unset.rope_scaling == "yarn"
    plain = model_config_from_args(_args("mla_tp2_torch"), "args")
    assert (plain.rope_scaling, plain.q_lora_rank, plain.rotary_base, plain.position_embedding_type) == ("", 0, 500, "rope")
    # plain RoPE, yet Megatron's MLA still scales attention by YaRN's mscale_all_dim temperature
    with pytest.raises(CheckpointError, match="args.rope_type = 'rope' with rotary_scaling_factor 4.0"):
        model_config_from_args({**fields, "rope_type": "rope"}, "args")
    with pytest.raises(CheckpointError, match="args.position_embedding_type = 'learned_absolute'"):
        model_config_from_args({**fields, "position_embedding_type": "learned_absolute"}, "args")


@pytest.mark.parametrize(("field", "value"), [("mla_down_proj_fusion", True), ("moe_single_grouped_weight", True),
                                              ("moe_mlp_glu_interleave_size", 32)])  # fmt: skip
def test_grouped_and_mla_layouts_not_read_are_refused_by_name(field, value):
    with pytest.raises(CheckpointError, match=f"args.{field} = {value!r} is not supported by megatron-import"):
        model_config_from_args({**_args("mla_yarn_dist"), field: value}, "args")


def test_mla_under_transformer_engines_spec(tmp_path):
    """TE's MLA layer fuses the latent norms into the up-projections and keeps the input norm
    apart (torch_dist); its legacy state holds the down-projections whole on every tensor rank.
    Both read back to Megatron's logits."""
    dist = _export(_import("mla_yarn_dist", tmp_path / "yarn"), tmp_path / "yarn_te", "--transformer-impl", "transformer_engine")
    keys = open_megatron(dist).shapes
    assert {"decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight", "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight",
            "decoder.layers.input_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight"} <= keys.keys()  # fmt: skip
    assert not any("q_layernorm" in key or "kv_layernorm" in key for key in keys)
    rope = _import("mla_tp2_torch", tmp_path / "rope")
    legacy = _export(rope, tmp_path / "rope_te", "--transformer-impl", "transformer_engine", *_legacy_flags((2, 1, 1)))
    ranks = [files["model"] for files in _legacy_files(legacy).values()]
    down = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    assert ranks[0][down].shape == (16 + 8, 32) and torch.equal(ranks[0][down], ranks[1][down])
    for case, exported in (("mla_yarn_dist", dist), ("mla_tp2_torch", legacy)):
        again = _import_dir(exported, tmp_path / f"{case}_again")
        reference = _reference(case)
        torch.testing.assert_close(_logits(again, reference["tokens"]), reference["logits"], atol=1e-5, rtol=1e-5)


def _rename_experts_as_te(root: Path) -> None:
    """Each rank's ``mlp.experts.local_experts.K.linear_fcN.weight`` as TE's ``GroupedLinear`` keeps
    it (``mlp.experts.linear_fcN.weightK``), args saying grouped GEMM under TE's spec."""
    for path in sorted((root / "iter_0000007").glob("mp_rank_*/model_optim_rng.pt")):
        state = load_megatron_pickle(path, str(path))
        model = {}
        for key, value in state["model"].items():
            head, _, tail = key.partition(".mlp.experts.local_experts.")
            if tail:
                expert, _, linear = tail.partition(".")
                key = f"{head}.mlp.experts.{linear}{expert}"
            model[key] = value
        args = _plain({**state["args"].fields(), "moe_grouped_gemm": True, "transformer_impl": "transformer_engine"})
        torch.save({**state, "args": args, "model": model}, path)


def test_te_grouped_experts_legacy_names_import_to_megatrons_logits(tmp_path):
    root = _copy("moe_ep2_torch", tmp_path)
    _rename_experts_as_te(root)
    first = load_megatron_pickle(root / "iter_0000007" / "mp_rank_00_001" / "model_optim_rng.pt", "rank 1")["model"]
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight1" in first and not any("local_experts" in k for k in first)
    out = _import_dir(root, tmp_path / "mt")
    reference = _reference("moe_ep2_torch")
    torch.testing.assert_close(_logits(out, reference["tokens"]), reference["logits"], atol=1e-5, rtol=1e-5)


def test_grouped_checkpoints_are_megatrons_packed_layout():
    """The legacy GroupedMLP case holds the packed weights (so its import reads them, not
    SequentialMLP's names), and its args say grouped GEMM."""
    files = _legacy_files(DATA / "grouped_tp2_torch")
    model = files["mp_rank_00"]["model"]
    assert model["decoder.layers.0.mlp.experts.weight1"].shape == (16, 4 * 2 * 8 // 2)  # [h, experts * 2f / tp]
    assert model["decoder.layers.0.mlp.experts.weight2"].shape == (4 * 8 // 2, 16)
    assert files["mp_rank_00"]["args"].fields()["moe_grouped_gemm"] is True


def test_mla_yarn_context_megatron_cannot_express_is_refused_on_export():
    """Megatron's MLA takes its YaRN context from its config's default (4096), no arg: another is refused."""
    m = model_config_from_args(_args("mla_yarn_dist"), "args")
    check_exportable(m)
    with pytest.raises(CheckpointError, match="would read rope_original_max_position_embeddings otherwise .*4096"):
        check_exportable(replace(m, rope_original_max_position_embeddings=8192))


def test_virtual_pipeline_chunks_are_read_in_megatrons_interleaved_order(tmp_path):
    """``llama_pp2vpp2_torch`` (``make_vpp_checkpoint.py``): each rank's file holds ``model0`` and
    ``model1``, rank p's chunks being layers p and p + 2. Imported, the logits are Megatron's; the
    chunks' weights differ, so reading them rank by rank instead (layers 1 and 2 swapped) moves them."""
    files = _legacy_files(DATA / "llama_pp2vpp2_torch")
    assert {k for k in files["mp_rank_00_001"] if k.startswith("model")} == {"model0", "model1"}
    assert "output_layer.weight" in files["mp_rank_00_001"]["model1"] and "output_layer.weight" not in files["mp_rank_00_001"]["model0"]
    out = _import("llama_pp2vpp2_torch", tmp_path / "mt")
    reference = _reference("llama_pp2vpp2_torch")
    torch.testing.assert_close(_logits(out, reference["tokens"]), reference["logits"], atol=1e-5, rtol=1e-5)
    meta = read_meta(out)
    model = build_model(Config.from_dict(meta["config"]).model, meta["vocab_size"], 16).eval()
    load_checkpoint(out, model, load_rng=False, log=lambda _: None)
    model.layers[1], model.layers[2] = model.layers[2], model.layers[1]
    with torch.no_grad():
        assert (model(reference["tokens"]) - reference["logits"]).abs().max() > 0.1


def test_the_post_layernorm_flag_of_a_core_checkpoint_is_not_read(tmp_path):
    """Megatron-Core's TransformerLayer never reads ``apply_residual_connection_post_layernorm``: a
    Core run saved with it ran pre-LN, so gpt_tp2_torch with the flag set in its args still imports
    to Megatron's logits; the export refuses a post-LN model, which Megatron-Core would run pre-LN."""
    root = _copy("gpt_tp2_torch", tmp_path)
    for path in sorted((root / "iter_0000007").glob("mp_rank_*/model_optim_rng.pt")):
        state = load_megatron_pickle(path, str(path))
        torch.save({**state, "args": _plain({**state["args"].fields(), "apply_residual_connection_post_layernorm": True})}, path)
    out = _import_dir(root, tmp_path / "mt")
    reference = _reference("gpt_tp2_torch")
    torch.testing.assert_close(_logits(out, reference["tokens"]), reference["logits"], atol=1e-5, rtol=1e-5)
    post = _logits(out, reference["tokens"], apply_residual_connection_post_layernorm=True)
    assert (post - reference["logits"]).abs().max() > 0.1  # read as meshtron's post-LN, the logits would move
    m = model_config_from_args({**_args("gpt_tp2_torch"), "apply_residual_connection_post_layernorm": True}, "args", "legacy-gpt")
    assert m.apply_residual_connection_post_layernorm  # the pre-Core model honours it
    with pytest.raises(CheckpointError, match="post-LN model .* would run pre-LN in Megatron-Core"):
        check_exportable(m)
