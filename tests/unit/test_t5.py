"""T5 in one process: the encoder ignores its padding and sees both ways, the decoder is causal
and reads the encoder, generation (encoder once, decoder step by step with its KV cache) equals
the argmax of full forwards, parameter counts against the built model, the flags and the rules."""

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import ConfigError, build_config, encoder_decoder_layers
from meshtron.data.tokenizers import BertWordPieceTokenizer
from meshtron.inference.sampling import encode_with_sentinels, generate_encoder_decoder
from meshtron.models import build_model, num_parameters, parameter_count
from meshtron.models.t5 import T5DecoderBlock, T5EncoderBlock
from meshtron.validation import validate

VOCAB, ENC, DEC = 96, 12, 8
TINY = ["--model-type", "t5", "--preset", "tiny-t5", "--num-layers", "2", "--hidden-size", "32"]


def _model(*flags: str):
    cfg = build_config(overrides=[*TINY, *flags]).model
    torch.manual_seed(0)
    return build_model(cfg, VOCAB, 64).eval()


def _inputs():
    g = torch.Generator().manual_seed(3)
    enc = torch.randint(0, VOCAB, (2, ENC), generator=g)
    dec = torch.randint(0, VOCAB, (2, DEC), generator=g)
    mask = torch.ones(2, ENC, dtype=torch.bool)
    mask[0, 7:] = False
    return enc, dec, mask


def _changed(t: torch.Tensor, row: int, cols: slice) -> torch.Tensor:
    out = t.clone()
    out[row, cols] = (t[row, cols] + 1) % VOCAB
    return out


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_encoder_ignores_padding_and_decoder_is_causal_and_reads_the_encoder(backend):
    model = _model("--attention-backend", backend)
    enc, dec, mask = _inputs()
    out = model(enc, dec, mask)
    torch.testing.assert_close(model(_changed(enc, 0, slice(7, None)), dec, mask)[0], out[0], rtol=0, atol=0)
    # the encoder's last token reaches the first decoder token
    assert not torch.allclose(model(_changed(enc, 1, slice(-1, None)), dec, mask)[1, 0], out[1, 0])
    later = model(enc, _changed(dec, 1, slice(5, None)), mask)
    torch.testing.assert_close(later[:, :5], out[:, :5], rtol=0, atol=0)
    assert not torch.allclose(later[1, 5], out[1, 5])


def test_blocks_are_encoder_then_decoder_and_the_last_encoder_block_holds_its_final_norm():
    model = _model("--encoder-num-layers", "3", "--decoder-num-layers", "2")
    kinds = [type(b) for b in model.layers]
    assert kinds == [T5EncoderBlock] * 3 + [T5DecoderBlock] * 2
    assert [b.final_norm is not None for b in model.layers[:3]] == [False, False, True]
    assert [b.self_attention.layer_number for b in model.layers] == [0, 1, 2, 0, 1]  # a decoder block's KV-cache slot


def test_loss_is_the_masked_decoder_cross_entropy():
    model = _model()
    enc, dec, mask = _inputs()
    labels = torch.randint(0, VOCAB, dec.shape)
    loss_mask = torch.ones(dec.shape)
    loss_mask[0, 5:] = 0
    batch = {"encoder_tokens": enc, "decoder_tokens": dec, "encoder_padding_mask": mask, "labels": labels.masked_fill(loss_mask == 0, -100),
             "loss_mask": loss_mask}  # fmt: skip
    out, _ = model.run_stage(None, batch, list(model.layers), True, True)
    loss = model.loss(batch, out)
    logits = model(enc, dec, mask)
    expected = (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none") * loss_mask.flatten()).sum()
    torch.testing.assert_close(loss.total, expected)
    assert loss.count == loss_mask.sum() == model.loss_count(batch)
    assert model.output.bias is not None and model.output.weight is None  # Megatron's T5LMHead: tied, with a bias


def assert_cached_decoding_equals_the_full_forward(model, first_chunk: int = 1) -> None:
    """Decoding with the kv cache, a first chunk of ``first_chunk`` tokens then one at a time,
    gives the full forward's logits."""
    enc, dec, mask = _inputs()
    full = model(enc, dec, mask)
    memory = model.cross_attention_memory(model.encode(enc, mask))
    cache = model.new_kv_cache(2, DEC, torch.float32, torch.device("cpu"))
    first = model.decode(dec[:, :first_chunk], memory, mask, kv_cache=cache)
    steps = torch.cat([first, *(model.decode(dec[:, i : i + 1], memory, mask, kv_cache=cache) for i in range(first_chunk, DEC))], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)


def test_cached_decoding_equals_the_full_forward():
    assert_cached_decoding_equals_the_full_forward(_model())


def test_greedy_generation_is_the_argmax_of_full_forwards_step_by_step():
    model = _model("--init-method-std", "1.0")  # large weights: a small random model repeats one token
    enc = _inputs()[0][1].tolist()
    bos = 5
    out = generate_encoder_decoder(model, enc, max_new_tokens=10, start=bos, greedy=True)
    assert len(out) == 10 and len(set(out)) > 1
    with torch.no_grad():
        for i in range(len(out)):
            logits = model(torch.tensor([enc]), torch.tensor([[bos, *out[:i]]]))
            assert int(logits[0, -1].argmax()) == out[i], f"step {i}"
    first_new = next(i for i in range(1, len(out)) if out[i] not in out[:i])  # a token not produced before it
    assert generate_encoder_decoder(model, enc, 10, bos, end=out[first_new], greedy=True) == out[:first_new]  # stops at the end token


def test_prompt_sentinels_become_sentinel_ids(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "fox", "runs"]) + "\n")
    tok = BertWordPieceTokenizer(str(vocab), lower_case=True, vocab_extra_ids=3)
    s = tok.additional_special_tokens_ids
    assert encode_with_sentinels(tok, "The <extra_id_0> runs<extra_id_2>") == [tok.vocab["the"], s[0], tok.vocab["runs"], s[2]]
    with pytest.raises(ValueError, match="--vocab-extra-ids"):
        encode_with_sentinels(tok, "the <extra_id_3>")


@pytest.mark.parametrize("flags", [[], ["--untie-embeddings-and-output-weights"], ["--encoder-num-layers", "3", "--decoder-num-layers", "1"],
                                   ["--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm"]])  # fmt: skip
def test_parameter_count_matches_the_built_model(flags):
    cfg = build_config(overrides=[*TINY, *flags]).model
    assert parameter_count(cfg, VOCAB, 64) == num_parameters(build_model(cfg, VOCAB, 64))


def test_t5_base_is_megatrons_220m_and_flags_follow_megatron():
    cfg = build_config(overrides=["--preset", "t5-base"])
    assert encoder_decoder_layers(cfg.model) == (12, 12) and cfg.data.decoder_seq_length == 128 and cfg.data.seq_length == 512
    assert 215e6 < parameter_count(cfg.model, 30592, 512) < 225e6  # a BERT-cased WordPiece vocabulary + 100 sentinels, padded
    cfg = build_config(overrides=[*TINY, "--encoder-num-layers", "3", "--decoder-seq-length", "16", "--encoder-seq-length", "48"])
    assert encoder_decoder_layers(cfg.model) == (3, 2) and cfg.data.seq_length == 48  # Megatron: the sequence is the encoder's


def _errors(*flags: str, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as exc:
        validate(build_config(overrides=[*TINY, *flags]), world_size=world_size)
    return str(exc.value)


def test_config_rules_name_the_flag():
    validate(build_config(overrides=[*TINY, "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                     "--sequence-parallel"]), world_size=4)  # fmt: skip
    assert "--context-parallel-size 1" in _errors("--context-parallel-size", "2", world_size=2)
    assert "--num-query-groups" in _errors("--num-query-groups", "2")
    assert "--generate-prompt" in _errors("--generate-prompt", "x")
    assert "--max-position-embeddings" in _errors("--decoder-seq-length", "128")
    assert "--encoder-seq-length" in _errors("--encoder-seq-length", "32", "--seq-length", "64")
    assert "pipeline stage split" in _errors("--pipeline-model-parallel-size", "8", world_size=8)  # 4 blocks, 8 stages
    assert "--sequence-parallel" in _errors("--decoder-seq-length", "31", "--tensor-model-parallel-size", "2", "--sequence-parallel", world_size=2)


def test_flops_per_token_matches_torch_flop_counter():
    """Forward and backward of the whole model counted by torch (math attention computes the full
    causal square, so the estimate adds the masked half back); the estimate also counts the norms
    and biases, which torch does not: 1.5 %."""
    from torch.utils.flop_counter import FlopCounterMode

    from meshtron.models import model_flops_per_token

    cfg = build_config(overrides=[*TINY, "--hidden-size", "128", "--encoder-num-layers", "3", "--attention-backend", "math"]).model
    vocab, t, s, b = 512, 64, 32, 2
    torch.manual_seed(0)
    model = build_model(cfg, vocab, 64)
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, vocab, (b, t)), torch.randint(0, vocab, (b, s)), labels=torch.randint(0, vocab, (b, s))).sum().backward()
    masked_half = 6.0 * 2 * s * s * 128 * b  # decoder self-attention, 2 layers
    estimate = model_flops_per_token(cfg, vocab, t, s) * b * (t + s) + masked_half
    assert abs(estimate / counter.get_total_flops() - 1) < 0.015
