"""T5's relative position buckets (``--position-embedding-type relative``): the bucket function
against a hand-written copy of T5's ``_relative_position_bucket`` (both directions), the bias
table's layout, the float mask through both attention backends, and the model: every block of a
stack gets its stack's bias (none in cross-attention), the encoder still ignores padding and the
decoder stays causal, cached decoding equals the full forward, parameter count and flag rules."""

import math

import pytest
import torch

from meshtron.config import ConfigError, build_config
from meshtron.layers.attention import CoreAttention, attention_mask, math_attention
from meshtron.layers.relative_position import RelativePositionBias, relative_position_bucket
from meshtron.models import build_model, num_parameters, parameter_count
from meshtron.validation import validate
from tests.unit.test_t5 import DEC, ENC, VOCAB, _inputs, assert_cached_decoding_equals_the_full_forward  # the same tiny inputs

RELATIVE = ["--model-type", "t5", "--preset", "tiny-t5", "--num-layers", "2", "--hidden-size", "32",
            "--position-embedding-type", "relative"]  # fmt: skip


def t5_bucket(relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's ``_relative_position_bucket`` for one integer, written out by hand."""
    bucket = 0
    n = relative_position
    if bidirectional:
        num_buckets //= 2
        if n > 0:
            bucket = num_buckets
        n = abs(n)
    else:
        n = max(-n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20), (16, 64)])
def test_bucket_matches_t5(bidirectional, num_buckets, max_distance):
    positions = torch.arange(-400, 401)
    got = relative_position_bucket(positions, bidirectional, num_buckets, max_distance)
    expected = [t5_bucket(int(p), bidirectional, num_buckets, max_distance) for p in positions]
    assert got.tolist() == expected
    assert got.max() == num_buckets - 1 and got.min() == 0


def test_bias_reads_the_table_by_bucket_per_head_and_places_a_chunk_after_its_prefix():
    torch.manual_seed(0)
    table = RelativePositionBias(8, 20, num_heads=3, bidirectional=False)
    table.weight.data.normal_()
    whole = table(10, 10)
    assert whole.shape == (1, 3, 10, 10)
    for q, k in [(0, 0), (9, 0), (4, 7), (9, 1)]:
        torch.testing.assert_close(whole[0, :, q, k], table.weight[t5_bucket(k - q, False, 8, 20)])
    torch.testing.assert_close(table(3, 10), whole[:, :, 7:])  # the last 3 queries against every key


@pytest.mark.parametrize("causal", [True, False])
def test_float_mask_adds_the_bias_under_the_boolean_rule_on_both_backends(causal):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    bias = torch.randn(1, 4, 6, 6, generator=g)
    padding = torch.ones(2, 6, dtype=torch.bool)
    padding[1, 4:] = False
    mask = attention_mask(6, 6, None, None, causal, padding, bias)
    allowed = attention_mask(6, 6, None, None, causal, padding)
    assert mask.dtype == torch.float32 and mask.shape == (2, 4, 6, 6)
    assert torch.equal(torch.isinf(mask), ~allowed.expand(2, 4, 6, 6))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(8) + bias
    expected = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(math_attention(q, k, v, mask), expected)
    torch.testing.assert_close(CoreAttention("sdpa", causal=causal)(q, k, v, mask, 0.0), expected, rtol=1e-5, atol=1e-5)


def _model(*flags: str):
    cfg = build_config(overrides=[*RELATIVE, *flags]).model
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB, 64).eval()
    with torch.no_grad():  # a table far from zero, so that positions matter
        model.encoder_relative_position.weight.normal_()
        model.decoder_relative_position.weight.normal_()
    return model


def test_every_block_gets_its_stacks_bias_and_no_absolute_positions():
    model = _model()
    assert model.position_embedding is None and model.encoder_relative_position.weight.shape == (32, 4)
    assert model.encoder_relative_position.bidirectional and not model.decoder_relative_position.bidirectional
    seen = []
    for i, block in enumerate(model.layers):
        block.self_attention.register_forward_pre_hook(lambda m, a, kw, i=i: seen.append((i, kw["position_bias"].shape)), with_kwargs=True)
        if hasattr(block, "cross_attention"):
            block.cross_attention.register_forward_pre_hook(lambda m, a, kw: seen.append(("cross", len(a) + len(kw))), with_kwargs=True)
    enc, dec, mask = _inputs()
    model(enc, dec, mask)
    heads = (1, 4)
    assert seen == [(0, (*heads, ENC, ENC)), (1, (*heads, ENC, ENC)), (2, (*heads, DEC, DEC)), ("cross", 4),
                    (3, (*heads, DEC, DEC)), ("cross", 4)]  # fmt: skip


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_encoder_ignores_padding_and_decoder_is_causal_and_positions_matter(backend):
    model = _model("--attention-backend", backend)
    enc, dec, mask = _inputs()
    out = model(enc, dec, mask)
    padded = enc.clone()
    padded[0, 7:] = (padded[0, 7:] + 1) % VOCAB
    torch.testing.assert_close(model(padded, dec, mask)[0], out[0], rtol=0, atol=0)
    later = dec.clone()
    later[1, 5:] = (later[1, 5:] + 1) % VOCAB
    changed = model(enc, later, mask)
    torch.testing.assert_close(changed[:, :5], out[:, :5], rtol=0, atol=0)
    assert not torch.allclose(changed[1, 5], out[1, 5])
    with torch.no_grad():
        model.decoder_relative_position.weight[3] += 1.0  # the bucket of keys 3 positions back
    assert not torch.allclose(model(enc, dec, mask)[:, 3:], out[:, 3:])


def test_cached_decoding_equals_the_full_forward():
    assert_cached_decoding_equals_the_full_forward(_model(), first_chunk=3)  # a chunk, then one token at a time


@pytest.mark.parametrize("flags", [[], ["--relative-attention-num-buckets", "16", "--untie-embeddings-and-output-weights"]])
def test_parameter_count_matches_the_built_model(flags):
    cfg = build_config(overrides=[*RELATIVE, *flags]).model
    model = build_model(cfg, VOCAB, 64)
    assert parameter_count(cfg, VOCAB, 64) == num_parameters(model)
    absolute = build_config(overrides=[*RELATIVE[:-2], *flags]).model
    assert num_parameters(model) == parameter_count(absolute, VOCAB, 64) - 64 * 32 + 2 * cfg.relative_attention_num_buckets * 4


def _errors(*flags: str, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as exc:
        validate(build_config(overrides=flags), world_size=world_size)
    return str(exc.value)


def test_config_rules_name_the_flag():
    validate(build_config(overrides=[*RELATIVE, "--relative-attention-max-distance", "64", "--tensor-model-parallel-size", "2",
                                     "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"]), world_size=4)  # fmt: skip
    assert "--model-type t5" in _errors("--position-embedding-type", "relative")
    assert "--decoder-first-pipeline-num-layers 2" in _errors(*RELATIVE, "--pipeline-model-parallel-size", "2", world_size=2)
    assert "--relative-attention-max-distance" in _errors(*RELATIVE, "--relative-attention-max-distance", "16")
