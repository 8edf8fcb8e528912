"""Generation: the KV cache changes nothing but speed; sampling filters do what they say."""

import dataclasses

import pytest
import torch

from meshtron.config import build_config
from meshtron.checkpoint.checkpoint import save_checkpoint
from meshtron.data.tokenizers import ByteTokenizer
from meshtron.inference.generate import generate_from_checkpoint
from meshtron.inference.sampling import generate, top_k_filter, top_p_filter
from meshtron.models import build_model

VOCAB = 96


def make(name: str, seq: int = 64):
    torch.manual_seed(0)
    cfg = build_config(overrides=["--model.preset", name]).model
    model = build_model(dataclasses.replace(cfg, init_method_std=0.2), VOCAB, seq)  # wide std: peaked logits
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def greedy_without_cache(model, prompt, n):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_cached_greedy_equals_recomputation(name):
    model = make(name).eval()
    prompt = [5, 17, 3, 88, 42]
    out = generate(model, prompt, 24, greedy=True)
    assert len(out) == 24
    assert out == greedy_without_cache(model, prompt, 24)
    assert len(set(out)) > 2  # not a degenerate constant stream


def test_top_k_one_equals_greedy_and_eval_mode_is_restored():
    model = make("tiny-llama")
    model.train()
    g = torch.Generator().manual_seed(0)
    assert generate(model, [1, 2, 3], 12, top_k=1, temperature=0.7, generator=g) == generate(model, [1, 2, 3], 12, greedy=True)
    assert model.training


def test_sampling_is_reproducible_with_a_generator():
    model = make("tiny-gpt")
    runs = [generate(model, [4, 4], 16, top_p=0.9, generator=torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]


def test_eod_stops_generation():
    model = make("tiny-llama")
    greedy = generate(model, [7, 8], 10, greedy=True)
    stop = greedy[3]
    assert generate(model, [7, 8], 10, greedy=True, eod=stop) == greedy[: greedy.index(stop)]


def test_generation_stops_at_the_position_limit():
    model = make("tiny-gpt", seq=16)
    assert len(generate(model, list(range(12)), 10, greedy=True)) == 16 - 12 + 1
    with pytest.raises(ValueError, match="exceeds"):
        generate(model, list(range(17)), 1)


def test_generate_from_checkpoint(tmp_path):
    cfg = build_config(overrides=["--model.preset", "tiny-llama", "--tokenizer-type", "ByteTokenizer"])
    torch.manual_seed(0)
    model = build_model(cfg.model, 384, cfg.data.seq_length)
    meta = {"config": cfg.to_dict(), "vocab_size": 384, "tokenizer": {"tokenizer_type": "ByteTokenizer"}}
    save_checkpoint(tmp_path, 5, model, None, meta, save_optim=False)
    torch.manual_seed(1)  # a different seed: the weights must come from the checkpoint
    text = generate_from_checkpoint(str(tmp_path), "Hi", 8, greedy=True, device="cpu")
    expected = generate(model, ByteTokenizer().encode("Hi"), 8, greedy=True, eod=ByteTokenizer.eod)
    assert text == "Hi" + ByteTokenizer().decode(expected) and len(text) > 2


def test_generate_from_checkpoint_refuses_negative_lengths_and_says_when_positions_cap_them(tmp_path, capsys):
    cfg = build_config(overrides=["--model.preset", "tiny-llama", "--tokenizer-type", "ByteTokenizer", "--seq-length", "16"])
    model = build_model(cfg.model, 384, cfg.data.seq_length)
    meta = {"config": cfg.to_dict(), "vocab_size": 384, "tokenizer": {"tokenizer_type": "ByteTokenizer"}}
    save_checkpoint(tmp_path, 1, model, None, meta, save_optim=False)
    with pytest.raises(ValueError, match="--max-new-tokens must be >= 0, got -5"):
        generate_from_checkpoint(str(tmp_path), "Hi", -5, device="cpu")
    generate_from_checkpoint(str(tmp_path), "Hi", 300, greedy=True, device="cpu")
    positions = model.max_positions
    assert f"note: the model has {positions} positions: at most {positions - 2} new tokens follow the 2-token prompt, not 300" in capsys.readouterr().err


def test_generate_names_a_missing_tokenizer_and_takes_one_by_flag(tmp_path, capsys):
    """A checkpoint of a --mock-data run without --tokenizer-type: the command says the checkpoint
    has no tokenizer and what to pass (it was `unknown --tokenizer-type ''`), then takes it."""
    from meshtron import cli

    cfg = build_config(overrides=["--model.preset", "tiny-llama", "--mock-data", "--vocab-size", "384", "--seq-length", "16"])
    model = build_model(cfg.model, 384, cfg.data.seq_length)
    save_checkpoint(tmp_path, 1, model, None, {"config": cfg.to_dict(), "vocab_size": 384, "tokenizer": {"tokenizer_type": ""}}, save_optim=False)
    argv = ["generate", "--load", str(tmp_path), "--prompt", "Hi", "--device", "cpu", "--greedy", "--max-new-tokens", "3"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"meshtron generate: error: {tmp_path} has no tokenizer: its run trained on --mock-data without --tokenizer-type" in err
    assert "--tokenizer-type ByteTokenizer, or --tokenizer-type NAME with --tokenizer-model PATH" in err and "Traceback" not in err
    assert cli.main([*argv, "--tokenizer-type", "ByteTokenizer"]) == 0
    assert capsys.readouterr().out.startswith("Hi")
    assert cli.main([*argv, "--tokenizer-type", "ByteTokenizer", "--max-new-tokens", "-5"]) == 2
    assert "meshtron generate: error: --max-new-tokens must be >= 0, got -5" in capsys.readouterr().err


def test_top_k_filter():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert torch.isinf(top_k_filter(logits, 2)).tolist() == [True, False, False, True]
    assert torch.equal(top_k_filter(logits, 0), logits)


@pytest.mark.parametrize("p, kept", [(0.3, 1), (0.49, 1), (0.51, 2), (0.79, 2), (0.81, 3), (0.96, 4), (1.0, 4)])
def test_top_p_keeps_smallest_set_reaching_p(p, kept):
    probs = torch.tensor([0.3, 0.05, 0.5, 0.15])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = probs.log()
    out = top_p_filter(logits, p)
    keep = torch.isfinite(out)
    assert int(keep.sum()) == kept
    assert probs[keep].min() >= max(probs[~keep].tolist(), default=0.0)  # kept are the most likely
    assert torch.equal(out[keep], logits[keep])
