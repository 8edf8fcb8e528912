"""BERT in one process: bidirectional attention that ignores padding, the heads and their
losses, parameter counts against the built model and Hugging Face's, and the config rules."""


import pytest
import torch

from meshtron.config import ConfigError, build_config
from meshtron.models import build_model, num_parameters, parameter_count
from meshtron.models.bert import SOP_LOSS
from meshtron.validation import validate

VOCAB, SEQ = 96, 12
TINY = ["--model-type", "bert", "--preset", "tiny-bert", "--num-layers", "2", "--hidden-size", "32"]


def _model(*flags: str):
    cfg = build_config(overrides=[*TINY, *flags]).model
    torch.manual_seed(0)
    return build_model(cfg, VOCAB, SEQ).eval()


def _inputs():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    padding_mask = torch.ones(2, SEQ, dtype=torch.bool)
    padding_mask[0, 7:] = False
    types = (torch.arange(SEQ) >= 4).long().expand(2, SEQ)
    return tokens, types, padding_mask


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_attention_is_bidirectional_and_ignores_padding(backend):
    model = _model("--attention-backend", backend)
    tokens, types, padding_mask = _inputs()
    out = model(tokens, types, padding_mask)
    changed_padding = tokens.clone()
    changed_padding[0, 7:] = (tokens[0, 7:] + 1) % VOCAB
    same = model(changed_padding, types, padding_mask)
    torch.testing.assert_close(same["lm"][0, :7], out["lm"][0, :7], rtol=0, atol=0)
    torch.testing.assert_close(same["sop"], out["sop"], rtol=0, atol=0)
    changed_last = tokens.clone()
    changed_last[1, -1] = (tokens[1, -1] + 1) % VOCAB
    assert not torch.allclose(model(changed_last, types, padding_mask)["lm"][1, 0], out["lm"][1, 0])  # the first token sees the last


def test_loss_is_masked_lm_sum_over_masked_tokens_plus_sentence_order_mean():
    model = _model()
    tokens, types, padding_mask = _inputs()
    labels = torch.full_like(tokens, -100)
    labels[:, 2] = tokens[:, 2]
    batch = {"tokens": tokens, "types": types, "padding_mask": padding_mask, "labels": labels,
             "loss_mask": (labels >= 0).float(), "is_random": torch.tensor([0, 1])}  # fmt: skip
    out, _ = model.run_stage(None, batch, list(model.layers), True, True)
    loss = model.loss(batch, out)
    logits = model(tokens, types, padding_mask)
    expected_lm = torch.nn.functional.cross_entropy(logits["lm"][:, 2], tokens[:, 2], reduction="sum")
    torch.testing.assert_close(loss.total, expected_lm)
    assert loss.count == 2 == model.loss_count(batch)
    torch.testing.assert_close(loss.aux[SOP_LOSS], torch.nn.functional.cross_entropy(logits["sop"], batch["is_random"]))


def test_no_binary_head_drops_pooler_token_types_and_sentence_order():
    model = _model("--bert-no-binary-head")
    assert model.pooler is None and model.binary_head is None and model.tokentype_embedding is None
    tokens, _, padding_mask = _inputs()
    assert set(model(tokens, padding_mask=padding_mask)) == {"lm"}


def test_token_types_without_binary_head():
    """``--bert-tokentypes`` keeps token types without the sentence-order head (HF's BertForMaskedLM)."""
    model = _model("--bert-no-binary-head", "--bert-tokentypes", "3")
    assert model.binary_head is None and model.tokentype_embedding.weight.shape == (3, 32)
    tokens, types, padding_mask = _inputs()
    assert not torch.allclose(model(tokens, types, padding_mask)["lm"], model(tokens, None, padding_mask)["lm"])


@pytest.mark.parametrize("flags", [[], ["--bert-no-binary-head"], ["--untie-embeddings-and-output-weights"],
                                   ["--normalization", "RMSNorm"], ["--bert-no-binary-head", "--bert-tokentypes", "2"]])  # fmt: skip
def test_parameter_count_matches_built_model(flags):
    cfg = build_config(overrides=[*TINY, *flags]).model
    assert num_parameters(build_model(cfg, VOCAB, SEQ)) == parameter_count(cfg, VOCAB, SEQ)


def test_parameter_count_equals_hugging_face_bert_for_pretraining():
    transformers = pytest.importorskip("transformers")
    cfg = build_config(overrides=TINY).model
    hf = transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        intermediate_size=4 * cfg.hidden_size, max_position_embeddings=cfg.max_position_embeddings))  # fmt: skip
    assert parameter_count(cfg, VOCAB, SEQ) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("flags, message", [
    (["--model-type", "t6"], "--model-type must be one of"),
    (["--cp", "2"], "--context-parallel-size 1"),
    (["--mock-data", "--tokenizer-type", "GPT2BPETokenizer"], "--mock-data needs no tokenizer"),
    (["--position-embedding-type", "rope"], "learned absolute positions"),
    (["--generate-prompt", "Hi"], "drop --generate-prompt"),
    (["--seq-length", "4", "--max-position-embeddings", "8"], "--seq-length >= 5"),
    (["--bert-tokentypes", "1"], "--bert-tokentypes 1: use 0"),
])  # fmt: skip
def test_config_rules_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(build_config(overrides=[*TINY, *flags]), world_size=2)


def test_sequence_parallel_is_accepted():
    validate(build_config(overrides=[*TINY, "--sequence-parallel", "--tp", "2"]), world_size=2)


def test_presets_are_bert():
    for name, layers, hidden in (("bert-base", 12, 768), ("bert-large", 24, 1024)):
        cfg = build_config(overrides=["--preset", name])
        validate(cfg, world_size=1)
        assert (cfg.model.model_type, cfg.model.num_layers, cfg.model.hidden_size, cfg.data.seq_length) == ("bert", layers, hidden, 512)
    assert build_config().model.model_type == "gpt"
