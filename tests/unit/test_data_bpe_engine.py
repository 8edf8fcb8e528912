"""The tiktoken engine for GPT-2-style BPE: same ids as the merge list (and as Hugging Face's GPT-2
tokenizer that Megatron-LM encodes with), refused where it would differ, special-token text mapped."""

import json
import random

import pytest

from meshtron.data.bpe_engine import tiktoken_engine
from meshtron.data.tokenizers import build_tokenizer, train_bpe_tokenizer

CORPUS = [
    "def main(argv=None):\n    parser = argparse.ArgumentParser()\n    return 0\n",
    "    # It's what we'd do; they'll see it, I'm sure. DON'T SHOUT.\n\n\n",
    "for i in range(10):\n\tprint(i * 12345, 3.14159, 0x1F, -42)\r\n",
    "Unicode: naïve café, 東京タワー, Ελληνικά, emoji 🙂🙂, ½ ² ①.",
    "x = {'a': [1, 2, 3], \"b\": None}  # trailing   spaces   \n",
] * 6
SAMPLES = [
    *CORPUS[:5],
    "",
    " ",
    "\n\n\n    \n",
    "a" * 5000 + " " + "ab" * 3000,
    "   leading and trailing   ",
    "unseen words: zyxwvut qqqq ßßß ﬁ",
    "text<|endoftext|>more <|endoftext|><|endoftext|> end",
    "<|endoftext",
]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A trained byte-level BPE saved as GPT-2 files, plus the tokenizer_config that makes the folder
    load in transformers' AutoTokenizer (the way Megatron-LM builds its GPT2BPETokenizer)."""
    from tokenizers import Tokenizer

    d = tmp_path_factory.mktemp("gpt2")
    hf = Tokenizer.from_file(train_bpe_tokenizer(CORPUS, 600, str(d / "tokenizer.json")))
    vocab, merges = hf.model.save(str(d))
    config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "model_max_length": 1 << 30,
              "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}  # fmt: skip
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "tokenizer.json").unlink()  # AutoTokenizer then builds from vocab.json and merges.txt
    return d, vocab, merges


def _random_texts(tok, n=300, seed=0):
    """Concatenations of vocabulary pieces: the inputs where merge-list and rank rules could part ways."""
    rng = random.Random(seed)
    pieces = [tok.decode([i]) for i in range(tok.vocab_size) if i != tok.eod]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def test_engine_matches_merge_list_and_transformers(gpt2_files):
    from transformers import AutoTokenizer

    folder, vocab, merges = gpt2_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert tok._fast is not None
    texts = SAMPLES + _random_texts(tok)
    reference = AutoTokenizer.from_pretrained(str(folder))
    expected = [reference(t).input_ids for t in texts]
    assert tok.encode_batch(texts) == expected
    assert [tok._tok.encode(t).ids for t in texts] == expected  # the tokenizers path agrees too
    flat, lengths = tok.encode_batch_flat(texts)
    assert flat.tolist() == [i for ids in expected for i in ids] and lengths.tolist() == list(map(len, expected))
    assert tok.encode("a<|endoftext|>") == tok.encode("a") + [tok.eod]


def test_split_special_tokens_encodes_them_as_text(gpt2_files):
    from tokenizers import Tokenizer, models, pre_tokenizers

    _, vocab, merges = gpt2_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges, split_special_tokens=True)
    plain = Tokenizer(models.BPE.from_file(vocab, merges))  # no added tokens: Megatron's older GPT-2 tokenizer
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = SAMPLES[-2]
    assert tok.encode(text) == plain.encode(text).ids and tok.eod not in tok.encode(text)
    tok._fast = None  # the tokenizers path honours the flag as well
    assert tok.encode(text) == plain.encode(text).ids


def _bpe(vocab_extra: dict, merges: list, normalizer=None):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from meshtron.data.bpe_engine import byte_decoder

    vocab = {ch: i for i, ch in enumerate(sorted(byte_decoder(), key=byte_decoder().get))}
    vocab.update({t: 256 + i for i, t in enumerate(vocab_extra)})
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if normalizer:
        tok.normalizer = normalizers.Lowercase()
    return tok


def test_engine_refused_where_it_would_differ():
    # ids follow the merges and 'abc' is a token, but the merge list alone never builds it from
    # "abc" (b+c merges first): tiktoken would return [abc], the merge list [a, bc].
    unreachable = _bpe(["bc", "ab", "abc"], [("b", "c"), ("a", "b"), ("ab", "c")])
    assert unreachable.encode("abc").ids == [ord("a"), 256]
    assert tiktoken_engine(unreachable) is None
    out_of_order = _bpe(["ab", "bc"], [("b", "c"), ("a", "b")])  # merge 0 makes id 257, merge 1 id 256
    assert tiktoken_engine(out_of_order) is None
    assert tiktoken_engine(_bpe(["ab"], [("a", "b")], normalizer=True)) is None
    assert tiktoken_engine(_bpe(["ab"], [("a", "b")])) is not None


def test_hf_tokenizer_json_uses_engine_and_falls_back(gpt2_files, tmp_path):
    from meshtron.data.tokenizers import HuggingFaceTokenizer

    folder, _, _ = gpt2_files
    path = train_bpe_tokenizer(CORPUS, 500, str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
    assert tok._fast is not None
    texts = SAMPLES + _random_texts(tok, 100)
    assert tok.encode_batch(texts) == [tok._tok.encode(t).ids for t in texts]
    odd = HuggingFaceTokenizer(_bpe(["bc", "ab", "abc"], [("b", "c"), ("a", "b"), ("ab", "c")]), name="odd", eod=0)
    assert odd._fast is None and odd.encode("abc") == [ord("a"), 256]
