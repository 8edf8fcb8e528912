"""`meshtron preprocess` and the embedded corpus: exact outputs, worker invariance, clear errors."""

import json
import os

import numpy as np
import pytest

from meshtron.data import preprocess
from meshtron.data.corpus import MIN_DOC_CHARS, embedded_corpus_documents
from meshtron.data import default_data
from meshtron.data.default_data import prepare_default_data
from meshtron.data.indexed import IndexedDataset

DOCS = [
    {"text": "hello", "title": "A"},
    {"text": "", "title": "B"},  # empty text: a document with no sequence, no eod
    {"text": ["one", "", "two"], "title": "C"},  # pre-split sentences: one sequence each
    {"text": "naïve", "title": "D"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run(tmp_path, rows, *extra, name="out"):
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    return preprocess.main(["--input", src, "--output-prefix", str(tmp_path / name), "--tokenizer-type", "ByteTokenizer", "--quiet", *extra])


def test_byte_tokenizer_output_exact(tmp_path):
    prefixes = run(tmp_path, DOCS, "--append-eod", "--json-keys", "text", "title", "--chunk-size", "3")
    assert prefixes == [str(tmp_path / "out_text_document"), str(tmp_path / "out_title_document")]
    text = IndexedDataset(prefixes[0])
    assert text.dtype == np.uint16
    assert [text[i].tolist() for i in range(len(text))] == [
        list(b"hello") + [256],
        list(b"one"),
        list(b"two") + [256],
        list("naïve".encode()) + [256],
    ]
    assert text.document_indices.tolist() == [0, 1, 1, 3, 4]
    title = IndexedDataset(prefixes[1])
    assert [title[i].tolist() for i in range(len(title))] == [[ord(c), 256] for c in "ABCD"]


def test_without_eod_and_workers_agree(tmp_path):
    rows = [{"text": f"document {i} " * (i % 7)} for i in range(200)]
    one = run(tmp_path, rows, "--chunk-size", "7", name="w1")[0]
    two = run(tmp_path, rows, "--workers", "2", "--chunk-size", "5", name="w2")[0]
    for ext in (".bin", ".idx"):
        assert open(one + ext, "rb").read() == open(two + ext, "rb").read()
    ds = IndexedDataset(one)
    assert ds[0].tolist() == list(b"document 1 ")  # no eod without --append-eod
    assert ds.document_indices[:3].tolist() == [0, 0, 1]  # document 0 is empty


def test_errors_name_file_line_and_flag(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "a"}\n\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"in.jsonl line 3: not valid JSON"):
        preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "ByteTokenizer", "--quiet"])
    with pytest.raises(ValueError, match=r"line 1: no key 'body'.*--json-keys"):
        run(tmp_path, DOCS, "--json-keys", "body")
    with pytest.raises(FileNotFoundError, match="--input"):
        preprocess.main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", "x", "--tokenizer-type", "ByteTokenizer"])
    with pytest.raises(SystemExit, match="--keep-newlines only applies with --split-sentences"):
        run(tmp_path, DOCS, "--keep-newlines")
    with pytest.raises(ValueError, match="unknown --tokenizer-type"):
        preprocess.main(["--input", str(src), "--output-prefix", "x", "--tokenizer-type", "Bytes"])


def test_prints_summary(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    preprocess.main(["--input", src, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "ByteTokenizer"])
    out = capsys.readouterr().out
    assert "4 documents, 17 tokens" in out and "tokens/s" in out


def test_embedded_corpus_is_deterministic():
    a = embedded_corpus_documents(max_bytes=60_000)
    assert a == embedded_corpus_documents(max_bytes=60_000)
    assert sum(len(d.encode()) for d in a) >= 60_000 and min(map(len, a)) >= MIN_DOC_CHARS


def test_prepare_default_data_builds_then_reuses(tmp_path, monkeypatch):
    # The corpus's first 300 kB (parsing all of it takes seconds per build; the e2e default run
    # builds the whole one): what is built, reused and rebuilt is the same.
    docs, builds = embedded_corpus_documents(max_bytes=300_000), []
    monkeypatch.setattr(default_data, "embedded_corpus_documents", lambda: builds.append(1) or docs)
    prefix, tok_path = prepare_default_data(str(tmp_path), vocab_size=512)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) > 50 and ds.dtype == np.uint16
    from meshtron.data.tokenizers import build_tokenizer

    tok = build_tokenizer("HuggingFaceTokenizer", tok_path)
    assert tok.vocab_size == 512 and int(ds[0][-1]) == tok.eod
    mtime = os.path.getmtime(prefix + ".bin")
    assert prepare_default_data(str(tmp_path), vocab_size=512) == (prefix, tok_path)
    assert os.path.getmtime(prefix + ".bin") == mtime and len(builds) == 1
    os.remove(prefix + ".idx")
    prepare_default_data(str(tmp_path), vocab_size=512)
    assert IndexedDataset(prefix).sequence_lengths.tolist() == ds.sequence_lengths.tolist() and len(builds) == 2


@pytest.mark.parametrize("content, message", [
    ("", "has no documents"),
    ("\n  \n", "has no documents"),
    ('{"text": ""}\n{"text": ""}\n', "every 'text' of its 2 documents is empty"),
    ('{"text": "fine"}\nnot json\n', "line 2: not valid JSON"),
])  # fmt: skip
def test_bad_input_exits_nonzero_and_leaves_no_files(tmp_path, capsys, content, message):
    """A new user's empty or broken jsonl: a clear message and exit 2 from the CLI, and no .bin/.idx
    (not even a 0-byte one) for training to trip over later."""
    from meshtron.cli import main as cli_main

    (tmp_path / "in.jsonl").write_text(content)
    rc = cli_main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"),
                   "--tokenizer-type", "ByteTokenizer", "--quiet"])  # fmt: skip
    assert rc == 2 and message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def _megatron_reference(rows, encode, eod, dtype_code=8):
    """.bin/.idx bytes as Megatron-LM's preprocess_data.py writes them (its Encoder.encode and
    IndexedDatasetBuilder.add_document/finalize, with --append-eod), written here independently."""
    import struct

    tokens, lengths, docs = [], [], [0]
    for row in rows:
        doc, sentence_lens = [], []
        for sentence in row["text"] if isinstance(row["text"], list) else [row["text"]]:
            ids = encode(sentence)
            if ids:
                doc.extend(ids)
                sentence_lens.append(len(ids))
        if doc:
            doc.append(eod)
            sentence_lens[-1] += 1
        tokens.extend(doc)
        lengths.extend(sentence_lens)
        docs.append(len(lengths))
    pointers = np.concatenate([[0], np.cumsum(np.asarray(lengths[:-1], np.int64) * 2)]).astype(np.int64)
    idx = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, dtype_code, len(lengths), len(docs))
    idx += np.asarray(lengths, np.int32).tobytes() + pointers.tobytes() + np.asarray(docs, np.int64).tobytes()
    return np.asarray(tokens, np.uint16).tobytes(), idx


@pytest.mark.parametrize("split", [False, True])
def test_gpt2_bpe_byte_identical_to_megatron(tmp_path, split):
    """GPT-2 BPE on the tiktoken engine, 1 and 2 workers, special-token text in documents: the files
    equal Megatron's, encoding with transformers' GPT-2 tokenizer as Megatron-LM does (or, with
    --split-special-tokens, with the bare merge list as its older GPT2BPETokenizer did)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    from meshtron.data.tokenizers import train_bpe_tokenizer

    code = [f"def f{i}(x):\n    return x * {i}  # it's {i}<|endoftext|>\n\n" * (i % 4) for i in range(60)]
    rows = [{"text": t} for t in code] + [{"text": ["<|endoftext|>", "", "naïve 東京 🙂"]}, {"text": "<|endoftext|>"}]
    hf = Tokenizer.from_file(train_bpe_tokenizer(code[:20], 400, str(tmp_path / "tokenizer.json")))
    vocab, merges = hf.model.save(str(tmp_path))
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}))
    if split:
        plain = Tokenizer(models.BPE.from_file(vocab, merges))
        plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        encode = lambda text: plain.encode(text).ids  # noqa: E731
    else:
        reference = AutoTokenizer.from_pretrained(str(tmp_path))
        encode = lambda text: reference(text).input_ids  # noqa: E731
    expected = _megatron_reference(rows, encode, eod=hf.token_to_id("<|endoftext|>"))
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--chunk-size", "7"]
    flags += ["--split-special-tokens"] if split else []
    for workers in ("1", "2"):
        src = write_jsonl(tmp_path / "in.jsonl", rows)
        prefix = preprocess.main(["--input", src, "--output-prefix", str(tmp_path / f"w{workers}"), "--workers", workers, "--quiet", *flags])[0]
        assert (open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()) == expected


@pytest.mark.parametrize("eod", [None, 7])
def test_pack_matches_per_document_rule(eod):
    """The vectorised packing against the rule written out per document: drop empty sequences,
    end each document that kept any with eod (counted in its last sequence)."""
    rng = np.random.default_rng(0)
    seqs_per_doc = rng.integers(0, 4, 200)
    lengths = rng.integers(0, 3, int(seqs_per_doc.sum())) * rng.integers(0, 2, int(seqs_per_doc.sum()))
    flat = rng.integers(100, 200, int(lengths.sum()))
    tokens, kept_lengths, kept_per_doc = preprocess._pack(flat, lengths, seqs_per_doc, eod)
    ref_tokens, ref_lengths, ref_docs, pos, seq = [], [], [], 0, 0
    for n in seqs_per_doc:
        kept = 0
        for length in lengths[seq : seq + n]:
            if length:
                ref_tokens.extend(flat[pos : pos + length].tolist())
                ref_lengths.append(int(length))
                kept += 1
            pos += length
        seq += n
        if kept and eod is not None:
            ref_tokens.append(eod)
            ref_lengths[-1] += 1
        ref_docs.append(kept)
    assert (tokens.tolist(), kept_lengths.tolist(), kept_per_doc.tolist()) == (ref_tokens, ref_lengths, ref_docs)
