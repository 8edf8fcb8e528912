"""Progress bars on long CPU-side work: on stderr when forced (or on a terminal), silent off rank 0
and in captured logs, and the work's results are the same with a bar as without."""

from __future__ import annotations

import numpy as np
import pytest

from meshtron.data import masked_lm, sft_dataset
from meshtron.data.corpus import embedded_corpus_documents
from meshtron.data.gpt_dataset import GPTDataset
from meshtron.data.indexed import IndexedDataset, IndexedDatasetBuilder
from meshtron.data.masked_lm import build_mapping, mt19937_64, shuffle_rows
from meshtron.data.sft_dataset import pack_documents, tokenize_file
from meshtron.data.tokenizers import ByteTokenizer
from meshtron.progress import ENV, progress


def sentence_documents(num_docs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = np.concatenate(([0], np.cumsum(rng.integers(1, 12, num_docs))))
    return docs, rng.integers(3, 40, docs[-1]).astype(np.int32)


def test_bar_shows_only_when_forced_and_on_rank_zero(monkeypatch, capsys):
    def run():
        with progress(10, "some work", unit="doc") as bar:
            for _ in range(5):
                bar.update(2)
        return capsys.readouterr().err

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert run() == ""  # captured stderr is no terminal
    monkeypatch.setenv(ENV, "1")
    err = run()
    assert "some work" in err and "10/10" in err
    monkeypatch.setenv("RANK", "1")
    assert run() == ""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(ENV, "0")
    assert run() == ""


def test_work_past_the_total_ends_the_bar_at_what_was_done(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "1")
    with progress(10, "epochs") as bar:
        bar.update(14)
    assert "14/14" in capsys.readouterr().err


@pytest.mark.parametrize("n", [1, 2, 5, 6, 11, 23])
def test_chunked_shuffle_is_the_one_fisher_yates(monkeypatch, n):
    """Chunks of 5 swaps (the library's chunk made small) give the swaps of one plain loop."""
    monkeypatch.setattr(masked_lm, "CHUNK", 5)
    rows = np.arange(n * 2).reshape(n, 2)
    perm = list(range(n))
    if n > 1:
        js = (mt19937_64(8, n - 1) % np.arange(n, 1, -1, dtype=np.uint64)).tolist()
        for i, j in zip(range(n - 1, 0, -1), js):
            perm[i], perm[j] = perm[j], perm[i]
    assert np.array_equal(shuffle_rows(rows, 7), rows[perm])


def test_sentence_mapping_shows_a_bar_and_the_same_rows(monkeypatch, capsys):
    docs, sizes = sentence_documents(400)
    monkeypatch.setattr(masked_lm, "CHUNK", 64)
    monkeypatch.setenv(ENV, "0")
    quiet = build_mapping(docs, sizes, 900, 64, 0.1, 1234, 2)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(ENV, "1")
    shown = build_mapping(docs, sizes, 900, 64, 0.1, 1234, 2)
    err = capsys.readouterr().err
    assert np.array_equal(quiet, shown) and len(shown) >= 900
    assert "sample mapping: 100%" in err and f"{len(shown)}/{len(shown)}" in err and "shuffling samples" in err


def test_sft_tokenizing_and_packing_show_bars_and_the_same_arrays(monkeypatch, capsys, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "response": "{"a" * (i % 9 + 1)}"}}\n' for i in range(50)))
    monkeypatch.setattr(sft_dataset, "CHUNK", 7)  # updates inside the loops, and a remainder after them
    outputs = {}
    for forced in ("0", "1"):
        monkeypatch.setenv(ENV, forced)
        tokens = tokenize_file(str(path), ByteTokenizer(), None)
        positions = np.diff(tokens["offsets"]) - 1
        outputs[forced] = (tokens, pack_documents(positions, np.arange(50), 30, 24, seed=5))
        outputs[forced + "err"] = capsys.readouterr().err
    assert outputs["0err"] == ""
    assert "tokenizing conversations: 100%" in outputs["1err"] and "50/50" in outputs["1err"]
    assert "packing conversations: 100%" in outputs["1err"] and "30/30" in outputs["1err"]
    for quiet, shown in zip(outputs["0"], outputs["1"]):
        assert quiet.keys() == shown.keys() and all(np.array_equal(quiet[k], shown[k]) for k in quiet)


def test_embedded_corpus_shows_a_bar_and_the_same_documents(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "0")
    quiet = embedded_corpus_documents(max_bytes=30_000)
    monkeypatch.setenv(ENV, "1")
    assert embedded_corpus_documents(max_bytes=30_000) == quiet
    assert "embedded corpus" in capsys.readouterr().err


def test_gpt_indices_count_their_three_steps_and_are_the_same(monkeypatch, capsys, tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.int32)
    for d in range(40):
        builder.add_document(list(range(1, 5 + d % 17)) + [0])
    builder.finalize(str(tmp_path / "d.idx"))
    indexed = IndexedDataset(str(tmp_path / "d"))
    built = {}
    for forced in ("0", "1"):
        monkeypatch.setenv(ENV, forced)
        ds = GPTDataset(indexed, (0, 40), 200, 16, 3, str(tmp_path / f"cache{forced}"), 0)
        built[forced] = (ds.document_index, ds.sample_index, ds.shuffle_index)
        built[forced + "err"] = capsys.readouterr().err
    assert built["0err"] == "" and "train indices: 100%" in built["1err"] and "3/3" in built["1err"]
    assert all(np.array_equal(a, b) for a, b in zip(built["0"], built["1"]))
