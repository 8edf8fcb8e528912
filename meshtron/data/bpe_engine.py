"""tiktoken's BPE engine for GPT-2-style byte-level BPE tokenizers, used only where it is provably exact.

A ``tokenizers`` BPE merges the listed pair of lowest merge rank; tiktoken merges the adjacent pair
whose concatenation has the lowest token id, and returns a whole pre-tokenized piece at once when it
is a token. Both give the same ids when (1) each merge's token id grows with the merge's rank and
(2) every token, encoded alone by the merge list, comes out as itself: a pair that is not the listed
merge of its concatenation T could then only form where the merge list would leave T's bytes
unmergeable, which (2) rules out. ``tiktoken_engine`` checks both (and that the pipeline is plain
GPT-2: no normalizer, a ``ByteLevel`` pre-tokenizer with its regex, no post-processor adding ids)
and returns None otherwise, so such tokenizers keep the ``tokenizers`` path. tiktoken is several
times faster on the same text; that is where ``meshtron preprocess`` gets its speed.
"""

from __future__ import annotations

import json
from functools import lru_cache

# GPT-2's pre-tokenizer split, which the ByteLevel pre-tokenizer applies with use_regex=True.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_PLAIN_BPE = {"dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
              "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}  # fmt: skip


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _plain_gpt2_pipeline(spec: dict) -> bool:
    pre, post, model = spec.get("pre_tokenizer") or {}, spec.get("post_processor"), spec.get("model") or {}
    return (
        spec.get("normalizer") is None
        and spec.get("truncation") is None
        and spec.get("padding") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
        and (post is None or post.get("type") == "ByteLevel")
        and model.get("type") == "BPE"
        and all(model.get(k, v) == v for k, v in _PLAIN_BPE.items())
        and all(t["special"] and not (t["lstrip"] or t["rstrip"] or t["single_word"]) for t in spec.get("added_tokens", []))
    )


def _merges(model: dict) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def mergeable_ranks(spec: dict) -> dict[bytes, int] | None:
    """Token bytes -> id for the 256 bytes and every merge result, when ids grow with merge rank."""
    vocab, decode = spec["model"]["vocab"], byte_decoder()
    try:
        ranks = {bytes([decode[ch]]): vocab[ch] for ch in decode}
    except KeyError:
        return None  # a byte without a token: the merge list cannot spell every text
    last = max(ranks.values())
    for left, right in _merges(spec["model"]):
        token_id = vocab.get(left + right)
        if token_id is None or token_id <= last:
            return None
        ranks[bytes(decode[ch] for ch in left + right)] = last = token_id
    return ranks


def _tokens_encode_as_themselves(spec: dict) -> bool:
    """Condition (2): the merge list alone (no pre-tokenizer) turns each merged token into itself."""
    from tokenizers import Tokenizer, models

    model = spec["model"]
    bare = Tokenizer(models.BPE(model["vocab"], _merges(model)))
    tokens = [left + right for left, right in _merges(model)]
    encoded = bare.encode_batch_fast(tokens)
    return all(e.ids == [model["vocab"][t]] for e, t in zip(encoded, tokens))


def tiktoken_engine(hf_tokenizer):
    """A ``tiktoken.Encoding`` that encodes exactly as ``hf_tokenizer``, or None where that is not proven."""
    try:
        import tiktoken
    except ImportError:
        return None
    spec = json.loads(hf_tokenizer.to_str())
    if not _plain_gpt2_pipeline(spec):
        return None
    ranks = mergeable_ranks(spec)
    if ranks is None or not _tokens_encode_as_themselves(spec):
        return None
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    if set(specials.values()) & set(ranks.values()):
        return None  # an added token that is also a mergeable token: keep the library's own rules
    return tiktoken.Encoding(name="gpt2-style-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
