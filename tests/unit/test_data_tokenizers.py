"""Each --tokenizer-type on files the test makes itself: round trips, eod and vocab size."""

import base64

import pytest

from meshtron.data.tokenizers import TikTokenizer, build_tokenizer, llama3_special_tokens, train_bpe_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Return the number of items in the container; raise ValueError when empty.",
    "def main():\n    print('hello, world')\n",
    "Unicode: naïve café, 東京, emoji 🙂.",
] * 5
SAMPLE = "The lazy fox returns the café items.\n"


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    assert train_bpe_tokenizer(TEXTS, 320, str(path)) == str(path)
    return path


def test_hf_tokenizer_file_and_folder(bpe_json):
    for model in (str(bpe_json), str(bpe_json.parent)):
        tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=model)
        ids = tok.encode(SAMPLE)
        assert tok.decode(ids) == SAMPLE
        assert len(ids) < len(SAMPLE.encode())  # merges were learned
        assert tok.vocab_size == 320 and max(ids) < tok.vocab_size
        assert tok.eod == 0  # the only special token comes first
        assert tok.encode_batch([SAMPLE, "x"]) == [ids, tok.encode("x")]


def test_gpt2_bpe_from_exported_vocab_and_merges(bpe_json, tmp_path):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(bpe_json))
    vocab, merges = hf.model.save(str(tmp_path))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert tok.encode(SAMPLE) == hf.encode(SAMPLE).ids
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert tok.eod == hf.token_to_id("<|endoftext|>")
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=str(tmp_path / "nope.txt"))
    with pytest.raises(ValueError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", merge_file=merges)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("spm")
    text = d / "corpus.txt"
    text.write_text("\n".join(TEXTS * 4))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(d / "m"), vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, minloglevel=2, hard_vocab_limit=False,
    )
    return str(d / "m.model")


def test_sentencepiece_and_llama2(spm_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=spm_model)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model)
    ids = tok.encode(SAMPLE.strip())
    assert tok.decode(ids) == SAMPLE.strip()
    assert tok.eod == sp.eos_id() >= 0 and tok.vocab_size == sp.vocab_size() > max(ids)
    assert tok.encode_batch(["a b", "fox"]) == [tok.encode("a b"), tok.encode("fox")]
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=spm_model)
    assert llama.encode(SAMPLE.strip()) == [sp.bos_id()] + ids


def _tiktoken_file(path, merges):
    ranks = [bytes([b]) for b in range(256)] + merges
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    return str(path)


def test_tiktoken_llama3_layout(tmp_path):
    merges = [b"th", b"he", b"the", b" the", b"ox"]
    tok = build_tokenizer("TikTokenizer", tokenizer_model=_tiktoken_file(tmp_path / "r.tiktoken", merges))
    assert tok.encode(" the") == [256 + 3]
    assert tok.encode("the fox") == [258, 32, ord("f"), 256 + 4]
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    specials = llama3_special_tokens()
    assert len(specials) == 256 and specials[1] == "<|end_of_text|>" and specials[-1] == "<|reserved_special_token_250|>"
    assert tok.vocab_size == 256 + len(merges) + 256
    assert tok.eod == 256 + len(merges) + 1
    assert tok.encode("a<|end_of_text|>") == [ord("a"), tok.eod]  # as Megatron's TikTokenizer (allowed_special="all")
    split = build_tokenizer("TikTokenizer", tokenizer_model=_tiktoken_file(tmp_path / "r.tiktoken", merges), split_special_tokens=True)
    assert tok.eod not in split.encode("a<|end_of_text|>") and split.decode(split.encode("<|end_of_text|>")) == "<|end_of_text|>"


def _llama3_cuts(s, max_run):
    """Meta's reference loop for splitting overlong (non-)whitespace runs."""
    out, run, is_space, start = [], 0, s[0].isspace(), 0
    for i, ch in enumerate(s):
        if is_space ^ ch.isspace():
            run, is_space = 1, ch.isspace()
        else:
            run += 1
            if run > max_run:
                out.append(s[start:i])
                start, run = i, 1
    out.append(s[start:])
    return out


def test_tiktoken_long_runs_cut_like_llama3(tmp_path):
    tok = TikTokenizer(_tiktoken_file(tmp_path / "r.tiktoken", [b"aa"]))
    text = "x " + "a" * 60_000 + " " * 30_000 + "b" * 25_000 + " end"
    assert tok._pieces(text) == _llama3_cuts(text, 25_000)
    assert tok.decode(tok.encode(text)) == text


def test_byte_tokenizer():
    tok = build_tokenizer("ByteTokenizer")
    ids = tok.encode("naïve 🙂")
    assert ids == list("naïve 🙂".encode()) and tok.decode(ids + [tok.eod]) == "naïve 🙂"
    assert (tok.vocab_size, tok.eod) == (257, 256)


def test_errors_name_the_flag_and_suggest():
    with pytest.raises(ValueError, match="Did you mean 'HuggingFaceTokenizer'") as err:
        build_tokenizer("HuggingfaceTokenizer")
    assert "TikTokenizer" in str(err.value)
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(FileNotFoundError, match="--tokenizer-model /no/such"):
        build_tokenizer("TikTokenizer", tokenizer_model="/no/such")
