"""Sentence splitting for ``meshtron preprocess --split-sentences``: NLTK's Punkt, offline.

Megatron splits with ``nltk.load("tokenizers/punkt/english.pickle")``: Punkt's algorithm with
parameters learned from English news text. We never load that pickle (loading one runs code) and
download nothing, so the parameters come from two sources instead:

- abbreviations (the words whose period does not end a sentence: "Mr.", "e.g.", "Jan.") from the
  curated English list below, shipped with the code;
- the orthographic context (how often a word is seen capitalized or lower case, at a sentence start
  or inside one) and the frequent sentence starters, learned by ``PunktTrainer`` from the embedded
  corpus (the Python standard library's docstrings, see ``corpus.py``) on first use and cached as
  JSON (plain data, nothing executed on load) under ``~/.cache/meshtron/punkt``.

How it differs from the pickle: its abbreviation list is hand-picked rather than learned from news
(the corpus' own learned abbreviations are code identifiers such as "data_encoding", so we drop
them), it has no collocations (pairs such as "##number## Jan." that keep ordinals from ending a
sentence), and its orthographic statistics come from technical prose. Ordinary text splits the
same; the rare cases Punkt decides by those statistics (an abbreviation or initial followed by a
capitalized word) can differ. ``--keep-newlines`` keeps the whitespace after each sentence in the
sentence, with Megatron's own ``PunktLanguageVars`` override. NLTK is an optional dependency:
``pip install 'meshtron[sentences]'``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import defaultdict

ENGLISH_ABBREVIATIONS = (
    # titles and names
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "rev", "hon", "gen", "col", "lt", "sgt", "capt", "cmdr",
    "gov", "sen", "rep", "pres", "messrs", "mme", "mlle",
    # organisations and addresses
    "inc", "corp", "co", "ltd", "llc", "bros", "dept", "univ", "assn", "ave", "blvd", "rd", "mt", "ft", "no", "nos",
    # months and days
    "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec",
    "mon", "tue", "tues", "wed", "thu", "thur", "thurs", "fri", "sat", "sun",
    # Latin and scholarly
    "e.g", "i.e", "etc", "vs", "viz", "cf", "al", "ca", "approx", "ibid", "op", "vol", "vols", "pp", "ed", "eds",
    "fig", "figs", "eq", "eqs", "ch", "sec", "ref", "refs", "esp", "est", "max", "min",
    # places and units
    "u.s", "u.s.a", "u.k", "u.n", "e.u", "d.c", "a.m", "p.m", "b.c", "a.d", "ph.d", "m.d", "b.a", "m.a", "b.sc", "m.sc",
    "calif", "conn", "fla", "ill", "mass", "mich", "minn", "penn", "tenn", "tex", "va", "wash", "wis",
)
_FORMAT = 1
_TRAIN_BYTES = 1_000_000  # of the embedded corpus: enough for the statistics, trains in seconds
_MAX_CHARS = 1_000_000  # Megatron feeds Punkt pieces this long


def _require_nltk():
    try:
        import nltk.tokenize.punkt as punkt
    except ImportError:
        raise SystemExit("--split-sentences needs NLTK's Punkt: pip install 'meshtron[sentences]' (or pip install nltk)") from None
    return punkt


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "meshtron", "punkt")


def _learned_statistics(cache_dir: str) -> dict:
    """Orthographic context and sentence starters from the embedded corpus, trained once and cached."""
    punkt = _require_nltk()
    import nltk

    from meshtron.data.corpus import embedded_corpus_documents

    key = json.dumps([_FORMAT, _TRAIN_BYTES, nltk.__version__, sys.version_info[:2]])
    path = os.path.join(cache_dir, f"english-{hashlib.md5(key.encode()).hexdigest()[:12]}.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    trainer = punkt.PunktTrainer()
    trainer.train("\n\n".join(embedded_corpus_documents(max_bytes=_TRAIN_BYTES)), finalize=True)
    params = trainer.get_params()
    stats = {"ortho_context": dict(sorted(params.ortho_context.items())), "sent_starters": sorted(params.sent_starters)}
    try:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(stats, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs retraining next time
    return stats


class SentenceSplitter:
    """``split(text)`` -> sentences, as Megatron's preprocessing splits them (module docstring)."""

    def __init__(self, keep_newlines: bool = False, cache_dir: str | None = None):
        punkt = _require_nltk()
        stats = _learned_statistics(cache_dir or default_cache_dir())
        params = punkt.PunktParameters()
        params.abbrev_types = set(ENGLISH_ABBREVIATIONS)
        params.sent_starters = set(stats["sent_starters"])
        params.ortho_context = defaultdict(int, stats["ortho_context"])
        lang_vars = _keep_newlines_vars(punkt)() if keep_newlines else None
        self._tokenizer = punkt.PunktSentenceTokenizer(params, lang_vars=lang_vars)

    def split(self, text: str) -> list[str]:
        return [s for i in range(0, len(text), _MAX_CHARS) for s in self._tokenizer.tokenize(text[i : i + _MAX_CHARS])]


def _keep_newlines_vars(punkt):
    class KeepNewlines(punkt.PunktLanguageVars):
        """Megatron's ``--keep-newlines`` context: whitespace after a sentence end stays with the sentence."""

        _period_context_fmt = r"""
            \S*                          # some word material
            %(SentEndChars)s             # a potential sentence ending
            \s*                          # the whitespace after it, newlines included
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)        # or the next token
            ))"""

    return KeepNewlines
