"""BERT import/export (``meshtron/models/hf_bert.py``) held to transformers' own BERT on tiny
random models (no download), fp32 on the CPU, with token types and a padding mask.

Imported through ``meshtron convert hf-import``, meshtron's post-LN BERT gives the logits of
``BertForMaskedLM`` / ``BertForPreTraining`` (masked-LM and next-sentence); exported back, the
folder loads in transformers and gives them again. Tolerance: 1e-5 (fp32 rounding of two
implementations of the same sums). A BERT trained in meshtron exports with its padded vocabulary
cropped and its missing token types written as zero rows, and still matches.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from meshtron.checkpoint.checkpoint import CheckpointError, load_checkpoint, read_meta, save_checkpoint  # noqa: E402
from meshtron.cli import main as cli_main  # noqa: E402
from meshtron.config import Config, build_config  # noqa: E402
from meshtron.models import build_model  # noqa: E402
from meshtron.models.hf import export_hf, import_hf  # noqa: E402
from tests.unit.test_hf_convert import _random_init  # noqa: E402

VOCAB, SEQ = 120, 20
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=40, type_vocab_size=2, layer_norm_eps=1e-12)  # fmt: skip
ATOL = RTOL = 1e-5


def _inputs():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    types = (torch.arange(SEQ) >= 8).long().expand(2, SEQ).clone()
    padding_mask = torch.ones(2, SEQ, dtype=torch.long)
    padding_mask[1, 13:] = 0
    return tokens, types, padding_mask


def _hf_model(cls, **overrides):
    model = cls(transformers.BertConfig(**{**TINY, **overrides}, attn_implementation="eager")).eval()
    _random_init(model)
    return model


def _hf_outputs(model, tokens, types, padding_mask) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=tokens, token_type_ids=types, attention_mask=padding_mask)
    if hasattr(out, "seq_relationship_logits"):
        return {"lm": out.prediction_logits, "sop": out.seq_relationship_logits}
    return {"lm": out.logits}


def _meshtron_outputs(save_dir, tokens, types, padding_mask) -> dict[str, torch.Tensor]:
    meta = read_meta(save_dir)
    cfg = Config.from_dict(meta["config"])
    model = build_model(cfg.model, meta["vocab_size"], cfg.data.seq_length).eval()
    load_checkpoint(save_dir, model, load_rng=False)
    with torch.no_grad():
        return model(tokens, types, padding_mask.bool())


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("cls, act, tied", [("BertForMaskedLM", "gelu", True), ("BertForPreTraining", "gelu", True),
                                            ("BertForMaskedLM", "gelu_pytorch_tanh", False)])  # fmt: skip
def test_import_export_match_transformers(tmp_path, cls, act, tied):
    hf_model = _hf_model(getattr(transformers, cls), hidden_act=act, tie_word_embeddings=tied)
    hf_model.save_pretrained(tmp_path / "hf")
    inputs = _inputs()
    expected = _hf_outputs(hf_model, *inputs)

    args = ["--dtype", "fp32"]
    assert cli_main(["convert", "hf-import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"), *args]) == 0
    m = read_meta(tmp_path / "ckpt")["config"]["model"]
    assert (m["model_type"], m["apply_residual_connection_post_layernorm"], m["bert_tokentypes"]) == ("bert", True, 2)
    assert m["bert_binary_head"] == (cls == "BertForPreTraining") and m["tie_embeddings"] == tied
    _assert_same(_meshtron_outputs(tmp_path / "ckpt", *inputs), expected)

    assert cli_main(["convert", "hf-export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "out"), *args]) == 0
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "out" / "model.safetensors")).keys() == load_file(str(tmp_path / "hf" / "model.safetensors")).keys()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [cls]
    reloaded = getattr(transformers, cls).from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    _assert_same(_hf_outputs(reloaded, *inputs), expected)


def test_meshtron_post_ln_bert_exports_cropped_with_zero_token_types(tmp_path, capsys):
    """A BERT as meshtron trains it: a WordPiece vocab.txt of 118 tokens (the tokenizer adds
    [BOS] and [EOS]: 120), padded to 128 rows, no binary head hence no token types. The export
    crops to the tokenizer's 120 rows, writes two zero token-type rows and the vocab.txt that
    transformers' AutoTokenizer reads; transformers' logits equal meshtron's, and so do they
    after importing the export back."""
    (tmp_path / "ckpt" / "tokenizer").mkdir(parents=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(VOCAB - 7))]
    (tmp_path / "ckpt" / "tokenizer" / "vocab.txt").write_text("\n".join(words) + "\n")
    flags = ["--model-type", "bert", "--preset", "tiny-bert", "--num-layers", "2", "--hidden-size", "32",
             "--apply-residual-connection-post-layernorm", "--bert-no-binary-head", "--make-vocab-size-divisible-by", "64",
             "--seq-length", str(SEQ)]  # fmt: skip
    cfg = build_config(overrides=flags)
    torch.manual_seed(0)
    model = build_model(cfg.model, 128, SEQ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms and biases off their init values
    tokenizer = {"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": "tokenizer/vocab.txt"}
    meta = {"iteration": 3, "consumed_samples": 0, "config": cfg.to_dict(), "vocab_size": 128, "tokenizer": tokenizer}
    save_checkpoint(tmp_path / "ckpt", 3, model, None, meta, save_optim=False)
    tokens, types, padding_mask = _inputs()
    with torch.no_grad():
        expected = model(tokens, None, padding_mask.bool())["lm"][..., :VOCAB]

    export_hf(tmp_path / "ckpt", tmp_path / "out", dtype="fp32")
    notes = capsys.readouterr().out
    assert "cropped from the 128 padded rows to the tokenizer's 120" in notes and "2 zero rows" in notes
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["vocab_size"], config["type_vocab_size"], config["architectures"]) == (VOCAB, 2, ["BertForMaskedLM"])
    reloaded = transformers.BertForMaskedLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    _assert_same(_hf_outputs(reloaded, tokens, types, padding_mask), {"lm": expected})
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert hf_tokenizer("W3 w5")["input_ids"] == [2, 8, 10, 3]  # lower-cased, [CLS] ... [SEP]

    import_hf(tmp_path / "out", tmp_path / "back", dtype="fp32")  # round trip: the 120 rows, token types zero
    _assert_same(_meshtron_outputs(tmp_path / "back", tokens, types, padding_mask), {"lm": expected})


def test_legacy_norm_names_import(tmp_path):
    """Old checkpoints name LayerNorm parameters gamma/beta and carry position_ids; both read."""
    from safetensors.torch import save_file

    hf_model = _hf_model(transformers.BertForPreTraining)
    hf_model.save_pretrained(tmp_path / "hf")
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v.clone()
             for k, v in hf_model.state_dict().items() if k != "cls.predictions.decoder.weight"}  # fmt: skip
    state["bert.embeddings.position_ids"] = torch.arange(TINY["max_position_embeddings"])[None]
    save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    import_hf(tmp_path / "hf", tmp_path / "ckpt", dtype="fp32")
    inputs = _inputs()
    _assert_same(_meshtron_outputs(tmp_path / "ckpt", *inputs), _hf_outputs(hf_model, *inputs))


def test_what_hugging_face_bert_cannot_express_is_refused(tmp_path):
    hf_model = _hf_model(transformers.BertModel)  # no masked-LM head
    hf_model.save_pretrained(tmp_path / "bare")
    with pytest.raises(CheckpointError, match="no masked-LM head"):
        import_hf(tmp_path / "bare", tmp_path / "ckpt")
    _hf_model(transformers.BertForMaskedLM, position_embedding_type="relative_key").save_pretrained(tmp_path / "relative")
    with pytest.raises(CheckpointError, match="position_embedding_type='relative_key' is not supported"):
        import_hf(tmp_path / "relative", tmp_path / "ckpt")

    cfg = build_config(overrides=["--model-type", "bert", "--preset", "tiny-bert", "--num-layers", "1", "--hidden-size", "32"])
    model = build_model(cfg.model, 64, 16)
    save_checkpoint(tmp_path / "pre_ln", 1, model, None, {"iteration": 1, "config": cfg.to_dict(), "vocab_size": 64}, save_optim=False)
    with pytest.raises(CheckpointError, match="pre-LN BERT .* --apply-residual-connection-post-layernorm"):
        export_hf(tmp_path / "pre_ln", tmp_path / "out")
