"""BERT, T5 and ICT data: sentence files, WordPiece tokenizers, mappings, masking, SOP, span corruption, ICT blocks,
and their mock data (``--mock-data``)."""

import json
import struct

import numpy as np
import pytest
import torch

from meshtron.config import Config, ConfigError, DataConfig, build_config, parse_overrides
from meshtron.data import preprocess
from meshtron.data.bert_dataset import BERTDataset
from meshtron.data.builder import MicroBatchIterator
from meshtron.data.ict_dataset import ICTDataset
from meshtron.data.indexed import IndexedDataset, IndexedDatasetBuilder
from meshtron.data.mock_sentences import MockBERTDataset, MockICTDataset, MockT5Dataset, MockVocabulary
from meshtron.data.masked_lm import (
    SpecialIds,
    build_blocks_mapping,
    build_mapping,
    continuation_table,
    create_masked_lm_predictions,
    masked_data_config_errors,
    mt19937_64,
    t5_data_errors,
)
from meshtron.data.t5_dataset import T5Dataset
from meshtron.data.tokenizers import build_tokenizer
from meshtron.models import family
from meshtron.validation import validate

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the quick brown fox jump over lazy dog mr smith went to washington he arrived on time it rain walk cat sat mat "
         "big small red blue green house tree sun moon star").split()
PIECES = ["##s", "##ing", "##ed", "##er", "##ly"]
VOCAB = SPECIALS + WORDS + PIECES + [".", ",", "!", "?"]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("\n".join(VOCAB) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tok(vocab_file):
    return build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab_file, vocab_extra_ids=20)


def _sentence(rng, n_words):
    """Word ids, a third of them followed by one or two ``##`` pieces (multi-piece words)."""
    word_ids = np.arange(len(SPECIALS), len(SPECIALS) + len(WORDS))
    piece_ids = np.arange(len(SPECIALS) + len(WORDS), len(SPECIALS) + len(WORDS) + len(PIECES))
    out = []
    for _ in range(n_words):
        out.append(int(rng.choice(word_ids)))
        if rng.random() < 0.33:
            out.extend(int(x) for x in rng.choice(piece_ids, size=rng.integers(1, 3)))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A sentence-level dataset: 120 documents of 1-7 sentences, and a titles dataset, one title each."""
    d = tmp_path_factory.mktemp("sent")
    rng = np.random.default_rng(0)
    docs = [[_sentence(rng, int(rng.integers(3, 12))) for _ in range(int(rng.integers(1, 8)))] for _ in range(120)]
    b = IndexedDatasetBuilder(str(d / "c_text_sentence.bin"), np.uint16)
    for doc in docs:
        for s in doc:
            b.add_item(s)
        b.end_document()
    b.finalize(str(d / "c_text_sentence.idx"))
    t = IndexedDatasetBuilder(str(d / "c_title_document.bin"), np.uint16)
    for i in range(len(docs)):
        t.add_document(_sentence(rng, 1 + i % 3))
    t.finalize(str(d / "c_title_document.idx"))
    return IndexedDataset(str(d / "c_text_sentence")), IndexedDataset(str(d / "c_title_document")), docs, d


def bert(corpus, tok, n=600, **kw):
    ds, _, docs, d = corpus
    args = dict(seq_length=48, seed=1234, cache_dir=str(d / "cache"), tokenizer=tok)
    args.update(kw)
    return BERTDataset(ds, (0, len(docs)), n, **args)


def original(sample):
    """Undo the masking: labels hold the original id wherever the loss looks."""
    return torch.where(sample["loss_mask"].bool(), sample["labels"], sample["tokens"])


# ---------------------------------------------------------------- preprocessing and tokenizers


@pytest.fixture(scope="module")
def punkt_cache(tmp_path_factory):
    pytest.importorskip("nltk")
    return str(tmp_path_factory.mktemp("punkt"))


def test_splitter_abbreviations_and_keep_newlines(punkt_cache):
    from meshtron.data.sentences import SentenceSplitter

    text = "Mr. Smith went to Washington. He arrived e.g. on time!\n\nIt rained. The dog sat."
    assert SentenceSplitter(cache_dir=punkt_cache).split(text) == [
        "Mr. Smith went to Washington.", "He arrived e.g. on time!", "It rained.", "The dog sat."]
    kept = SentenceSplitter(keep_newlines=True, cache_dir=punkt_cache).split(text)
    assert len(kept) == 4 and "".join(kept) == text and kept[1].endswith("!\n\n")


def test_sentence_files_match_reference_writer(tmp_path, vocab_file, tok, punkt_cache):
    rows = [{"text": "Mr. Smith went to Washington. He arrived on time!"}, {"text": ""},
            {"text": "The quick brown fox jumps. Big dogs walked slowly? It rains."}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (prefix,) = preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / "out"), "--split-sentences", "--quiet",
                                 "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab_file, "--punkt-cache-dir", punkt_cache])
    assert prefix == str(tmp_path / "out_text_sentence")
    docs = [["Mr. Smith went to Washington.", "He arrived on time!"], [],
            ["The quick brown fox jumps.", "Big dogs walked slowly?", "It rains."]]
    seqs = [tok.encode(s) for doc in docs for s in doc]
    assert seqs[2] == [VOCAB.index(w) for w in ["the", "quick", "brown", "fox", "jump", "##s", "."]]
    # the reference writer, from the format alone
    lengths = [len(s) for s in seqs]
    pointers = np.cumsum([0] + lengths[:-1]) * 2
    doc_index = [0, 2, 2, 5]
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_index))
           + struct.pack(f"<{len(seqs)}i", *lengths) + struct.pack(f"<{len(seqs)}q", *pointers) + struct.pack(f"<{len(doc_index)}q", *doc_index))
    assert open(prefix + ".idx", "rb").read() == idx
    assert open(prefix + ".bin", "rb").read() == struct.pack(f"<{sum(lengths)}H", *[t for s in seqs for t in s])
    assert IndexedDataset(prefix).document_indices.tolist() == doc_index


def test_bert_wordpiece_tokenizers(vocab_file, tok):
    n = len(VOCAB)
    assert (tok.cls, tok.sep, tok.pad, tok.mask) == (2, 3, 0, 4)
    assert (tok.bos, tok.eos, tok.eod) == (n, n + 1, n + 1)
    assert tok.additional_special_tokens_ids == list(range(n + 2, n + 22)) and tok.vocab_size == n + 22
    ids = tok.encode("The Fox walked, Mr. Smith!")
    assert [tok.inv_vocab[i] for i in ids] == ["the", "fox", "walk", "##ed", ",", "mr", ".", "smith", "!"]
    assert tok.decode(ids) == "the fox walked, mr. smith!"
    assert tok.encode("<extra_id_0>")[0] != n + 2  # sentinels are never read from text
    cased = build_tokenizer("BertWordPieceCase", vocab_file=vocab_file)
    assert cased.encode("The fox") == [tok.vocab["[UNK]"], tok.vocab["fox"]] and cased.vocab_size == n + 2


# ---------------------------------------------------------------- mappings


def test_random_streams_and_mappings_match_megatron():
    assert mt19937_64(5489, 10000)[-1] == 9981545732273789042  # the C++ standard's check value
    assert np.random.RandomState(5489).randint(0, 1 << 32, size=10000, dtype=np.uint64)[-1] == 4123659995  # std::mt19937's
    docs = np.array([0, 3, 5, 9, 10, 14])
    sizes = np.array([20, 31, 5, 40, 7, 9, 12, 3, 30, 2, 8, 8, 9, 25], dtype=np.int32)
    # expected rows: Megatron's helpers.cpp on the same input
    expected = [[10, 14, 26], [3, 5, 38], [7, 9, 26], [0, 3, 40], [0, 3, 2], [5, 9, 36], [0, 3, 40], [12, 14, 40], [10, 12, 11],
                [10, 14, 40], [3, 5, 40], [5, 9, 40], [5, 7, 14], [3, 5, 8]]
    assert build_mapping(docs, sizes, 12, 40, 0.5, 1234, 2).tolist() == expected
    blocks = [[2, 3, 0, 1], [9, 10, 3, 6], [4, 5, 1, 3], [10, 13, 4, 7], [0, 2, 0, 0], [13, 14, 4, 8], [8, 9, 2, 5], [3, 4, 1, 2], [5, 8, 2, 4]]
    assert build_blocks_mapping(docs, sizes, np.array([3, 0, 1, 2, 4]), 8, 25, 7, True).tolist() == blocks


def test_mapping_packs_sentences_of_one_document(corpus, tok):
    ds = bert(corpus, tok, short_seq_prob=0.0)
    doc_of = np.searchsorted(corpus[0].document_indices, np.arange(len(corpus[0])), side="right") - 1
    for first, end, target in np.asarray(ds.sample_index):
        assert end - first >= 2 and doc_of[first] == doc_of[end - 1] and target == 45
    short = bert(corpus, tok, short_seq_prob=0.5)
    targets = np.asarray(short.sample_index)[:, 2]
    assert 0.25 < np.mean(targets < 45) < 0.75 and targets.min() >= 2


# ---------------------------------------------------------------- BERT


def check_bert_masking(ds, sp, cont: np.ndarray) -> None:
    """Every sample of ``ds`` padded with ``sp.pad``, [CLS]/[SEP] (``sp``'s) never masked, words
    (``cont``: ## pieces) masked whole; over all, 12-15.5 % of the real tokens masked, 80 % of those
    [MASK], 10 % kept (plus the random draws that hit the original)."""
    real = masked = as_mask = kept = 0
    for i in range(len(ds)):
        s = ds[i]
        orig, lm = original(s), s["loss_mask"].bool()
        n = int(s["padding_mask"].sum())
        assert not s["padding_mask"][n:].any() and (s["tokens"][n:] == sp.pad).all()
        assert (s["labels"][~lm] == -100).all() and not lm[orig == sp.cls].any() and not lm[orig == sp.sep].any()
        real, masked = real + n, masked + int(lm.sum())
        as_mask += int((s["tokens"][lm] == sp.mask).sum())
        kept += int((s["tokens"][lm] == orig[lm]).sum())
        special = (orig == sp.cls) | (orig == sp.sep)
        word = torch.cumsum(~torch.from_numpy(cont[orig.numpy()]) & ~special, 0)  # a ## piece joins the word before it
        for w in word[lm].unique():
            assert lm[(word == w) & ~special].all(), "a word is masked only in part"
    assert 0.12 < masked / real < 0.155
    assert abs(as_mask / masked - 0.8) < 0.03 and abs(kept / masked - 0.1 - 0.1 / sp.vocab_size) < 0.03


def test_bert_masking_statistics_and_whole_words(corpus, tok):
    check_bert_masking(bert(corpus, tok, n=800), tok, continuation_table(tok))


def test_ngram_lengths(tok):
    cont = continuation_table(tok)
    rng = np.random.default_rng(1)
    for geometric, limit in ((False, 3), (True, 10)):
        lengths = []
        for k in range(300):
            tokens = _sentence(rng, 60)
            _, _, _, spans = create_masked_lm_predictions(tokens, len(tokens), np.random.RandomState(k), mask_prob=0.15, max_ngram=limit,
                                                          continuation=cont, skip_ids=(), geometric=geometric, replacement=lambda r: 4)
            lengths += [sum(not cont[tokens[p]] for p in pos) for pos, _ in spans]
        counts = np.bincount(lengths, minlength=limit + 1)
        assert max(lengths) <= limit and counts[1] > counts[2] > counts[3] and counts[limit] > 0


def test_sentence_order_pairs(corpus, tok):
    ds = bert(corpus, tok, n=300, seq_length=160, short_seq_prob=0.0)  # long enough that nothing is truncated
    orders = []
    for i in range(len(ds)):
        s = ds[i]
        first, end, _ = (int(x) for x in ds.sample_index[i])
        text = [t for k in range(first, end) for t in corpus[0][k].tolist()]
        orig, types = original(s), s["types"]
        n = int(s["padding_mask"].sum())
        a, b = orig[1 : int((types[:n] == 0).sum()) - 1].tolist(), orig[int((types[:n] == 0).sum()) : n - 1].tolist()
        assert a and b and types[0] == 0 and types[n - 1] == 1
        assert (b + a if s["is_random"] else a + b) == text
        orders.append(int(s["is_random"]))
    assert 0.35 < np.mean(orders) < 0.65


# ---------------------------------------------------------------- T5


def test_t5_span_corruption_round_trip(corpus, tok):
    ds_, _, docs, d = corpus
    ds = T5Dataset(ds_, (0, len(docs)), 300, 64, 32, 99, str(d / "cache"), tok)
    sentinels = set(tok.additional_special_tokens_ids)
    cont = continuation_table(tok)
    for i in range(len(ds)):
        s = ds[i]
        first, end, target = (int(x) for x in ds.sample_index[i])
        text = [t for k in range(first, end) for t in corpus[0][k].tolist()][:target]
        n_dec = int(s["decoder_padding_mask"].sum())
        labels = s["labels"][:n_dec].tolist()
        assert s["decoder_tokens"][:n_dec].tolist() == [tok.bos] + labels[:-1] and labels[-1] == tok.eos
        assert (s["labels"][n_dec:] == -100).all() and s["loss_mask"].sum() == n_dec
        spans, cur = {}, None
        for t in labels[:-1]:
            if t in sentinels:
                cur = spans.setdefault(t, [])
            else:
                cur.append(t)
        assert all(sum(not cont[t] for t in span) <= 10 for span in spans.values())  # at most 10 words a span
        encoder = s["encoder_tokens"][: int(s["encoder_padding_mask"].sum())].tolist()
        assert [t for t in encoder if t in sentinels] == tok.additional_special_tokens_ids[: len(spans)]
        rebuilt = []
        for t in encoder:
            rebuilt += spans.pop(t) if t in sentinels else [t]
        assert rebuilt == text and not spans


# ---------------------------------------------------------------- ICT


def test_ict_query_removed_with_probability(corpus, tok):
    ds_, titles, docs, d = corpus
    ds = ICTDataset(ds_, (0, len(docs)), 400, 200, 5, str(d / "cache"), tok, titles=titles, query_in_block_prob=0.3)
    inside = []
    for i in range(len(ds)):
        s = ds[i]
        first, end, doc, _ = s["block_indices"].tolist()
        assert end - first >= 2  # without --use-one-sent-docs a block has two sentences or more
        title = titles[doc].tolist()
        ctx = s["context_tokens"][: int(s["context_padding_mask"].sum())].tolist()
        assert ctx[: len(title) + 2] == [tok.cls, *title, tok.sep] and ctx[-1] == tok.sep
        query = s["query_tokens"][1 : int(s["query_padding_mask"].sum()) - 1].tolist()
        sentences = [ds_[k].tolist() for k in range(first, end)]
        assert query in sentences
        body = ctx[len(title) + 2 : -1]
        inside.append(body == [t for x in sentences for t in x])
        if not inside[-1]:
            sentences.remove(query)
            assert body == [t for x in sentences for t in x]
    assert 0.2 < np.mean(inside) < 0.4
    one = ICTDataset(ds_, (0, len(docs)), 50, 200, 5, str(d / "cache"), tok, titles=titles, use_one_sent_docs=True)
    assert (np.diff(np.asarray(one.sample_index)[:, :2], axis=1) == 1).any()


# ---------------------------------------------------------------- determinism, resume, blending, config


def test_determinism_cache_and_resume(corpus, tok):
    a = bert(corpus, tok, n=64, seed=77)
    b = bert(corpus, tok, n=64, seed=77)
    assert b.cache_hit and not a.cache_hit
    for i in (0, 13, 63):
        assert all(torch.equal(a[i][k], b[i][k]) for k in a[i])
    assert not torch.equal(a[5]["tokens"], bert(corpus, tok, n=64, seed=78)[5]["tokens"])
    full = MicroBatchIterator(a, 4, 0)
    batches = [next(full) for _ in range(6)]
    resumed = MicroBatchIterator(b, 4, consumed_samples=12)
    for want in batches[3:]:
        got = next(resumed)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_build_masked_datasets_blends(corpus, tok):
    _, titles, _, d = corpus
    prefix = str(d / "c_text_sentence")
    cfg = DataConfig(data_path=["0.7", prefix, "0.3", prefix], split="90,10,0", seq_length=48, data_cache_path=str(d / "cache"),
                     vocab_extra_ids=20, decoder_seq_length=24, titles_data_path="")
    for model in ("bert", "t5", "ict"):
        train, valid, test = family(model).datasets(Config(data=cfg), tok, (40, 8, 0), 3)
        assert len(train) == 40 and len(valid) == 8 and test is None
        batch = next(MicroBatchIterator(train, 4, 0))
        assert all(v.shape[0] == 4 for v in batch.values())
    with pytest.raises(ValueError, match="--vocab-extra-ids"):
        family("t5").datasets(Config(data=DataConfig(data_path=[prefix], decoder_seq_length=24)), tok, (4, 0, 0), 3)


def test_per_split_blends_give_each_split_whole_datasets(corpus, tok):
    """--train-data-path / --valid-data-path for the sentence families: no --split division, each
    split's datasets whole (the same prefix may serve two splits, as AMD's DeepSeek script does)."""
    _, _, docs, d = corpus
    prefix = str(d / "c_text_sentence")
    cfg = DataConfig(train_data_path=["0.5", prefix, "0.5", prefix], valid_data_path=[prefix], seq_length=48,
                     data_cache_path=str(d / "cache"), vocab_extra_ids=20, decoder_seq_length=24)  # fmt: skip
    for model in ("bert", "t5"):
        train, valid, test = family(model).datasets(Config(data=cfg), tok, (40, 8, 4), 3)
        assert len(train) == 40 and len(valid) == 8 and test is None  # no test blend
        assert [ds.document_range for ds in train.datasets] == [(0, len(docs))] * 2 and valid.document_range == (0, len(docs))


def test_config_errors_and_flags():
    assert masked_data_config_errors(DataConfig()) == []
    bad = DataConfig(mask_prob=1.5, short_seq_prob=-0.1, query_in_block_prob=2.0, seq_length=512, decoder_seq_length=1, vocab_extra_ids=100)
    errors = " ".join(masked_data_config_errors(bad) + t5_data_errors(bad))
    for flag in ("--mask-prob", "--short-seq-prob", "--query-in-block-prob", "--decoder-seq-length"):
        assert flag in errors
    assert t5_data_errors(DataConfig(seq_length=512, decoder_seq_length=128, vocab_extra_ids=100)) == []
    parsed = parse_overrides(["--mask-prob", "0.2", "--vocab-extra-ids", "100", "--encoder-seq-length", "512", "--use-one-sent-docs",
                              "--titles-data-path", "t", "--query-in-block-prob", "0.1", "--short-seq-prob", "0", "--decoder-seq-length", "128"])
    assert parsed["data.vocab_extra_ids"] == "100" and parsed["data.use_one_sent_docs"] is True and parsed["data.titles_data_path"] == "t"


# ---------------------------------------------------------------- mock data (--mock-data)

MOCK_VOCAB = 1000


def mock_vocabulary(tok, with_tokenizer: bool) -> MockVocabulary:
    """The WordPiece tokenizer's ids (20 sentinels), or the reserved ids of a 1000-id vocabulary."""
    return MockVocabulary.build(tok if with_tokenizer else None, MOCK_VOCAB, 20)


def same_layout(mock: dict, real: dict) -> None:
    assert mock.keys() == real.keys()
    for k in real:
        assert (mock[k].dtype, mock[k].shape) == (real[k].dtype, real[k].shape), k


def test_mock_reserved_ids():
    vocab = MockVocabulary.build(None, MOCK_VOCAB, 20)
    assert vocab.special == SpecialIds(0, 1, 2, 3, 4, 5, tuple(range(980, 1000)), 1000)
    assert vocab.words.tolist() == list(range(6, 980)) and not vocab.continuation.any()
    with pytest.raises(ValueError, match="--vocab-size 26 leaves no word id"):
        MockVocabulary.build(None, 26, 20)
    assert MockVocabulary.build(None, 27, 20).words.tolist() == [6]
    for model in ("bert", "t5", "ict"):  # refused with the config, before any process starts
        flags = ["--model-type", model, "--mock-data", "--vocab-size", "26", "--vocab-extra-ids", "20", "--decoder-seq-length", "8"]
        with pytest.raises(ConfigError, match="--vocab-size 26 leaves no word id"):
            validate(build_config(overrides=flags))


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_mock_bert_samples_are_bert_samples(corpus, tok, with_tokenizer):
    vocab = mock_vocabulary(tok, with_tokenizer)
    mock = MockBERTDataset(250, 5, vocab, seq_length=128)  # long enough that 15 % of a sample is 18 whole tokens
    same_layout(mock[0], bert(corpus, tok, n=20, seq_length=128)[0])
    check_bert_masking(mock, vocab.special, vocab.continuation)
    samples = [mock[i] for i in range(len(mock))]
    assert 0.4 < np.mean([int(s["is_random"]) for s in samples]) < 0.6  # sentence order swapped half the time
    assert max(int(original(s).max()) for s in samples) < vocab.special.vocab_size
    assert all(torch.equal(v, MockBERTDataset(250, 5, vocab, seq_length=128)[7][k]) for k, v in mock[7].items())  # (seed, index) alone
    assert not torch.equal(mock[7]["tokens"], MockBERTDataset(250, 6, vocab, seq_length=128)[7]["tokens"])


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_mock_t5_samples_are_t5_samples(corpus, tok, with_tokenizer):
    ds_, _, docs, d = corpus
    vocab = mock_vocabulary(tok, with_tokenizer)
    sp, sentinels = vocab.special, set(vocab.special.sentinels)
    mock = MockT5Dataset(300, 5, vocab, 64, 32)
    same_layout(mock[0], T5Dataset(ds_, (0, len(docs)), 20, 64, 32, 99, str(d / "cache"), tok)[0])
    text = masked = 0
    for i in range(len(mock)):
        s = mock[i]
        n_dec = int(s["decoder_padding_mask"].sum())
        labels = s["labels"][:n_dec].tolist()
        assert s["decoder_tokens"][:n_dec].tolist() == [sp.bos] + labels[:-1] and labels[-1] == sp.eos
        assert (s["labels"][n_dec:] == -100).all() and s["loss_mask"].sum() == n_dec
        encoder = s["encoder_tokens"][: int(s["encoder_padding_mask"].sum())].tolist()
        spans = [t for t in labels if t in sentinels]
        assert [t for t in encoder if t in sentinels] == spans == list(sp.sentinels[: len(spans)])
        assert max(encoder + labels) < sp.vocab_size and (s["encoder_tokens"][len(encoder) :] == sp.pad).all()
        masked += n_dec - 1 - len(spans)  # the targets less their sentinels and [EOS]
        text += len(encoder) - len(spans) + n_dec - 1 - len(spans)
    assert 0.12 < masked / text < 0.155


def test_mock_ict_samples_are_ict_samples(corpus, tok):
    ds_, titles, docs, d = corpus
    vocab = mock_vocabulary(tok, False)
    mock = MockICTDataset(400, 5, vocab, seq_length=64, query_in_block_prob=0.3)
    same_layout(mock[0], ICTDataset(ds_, (0, len(docs)), 20, 64, 5, str(d / "cache"), tok, titles=titles)[0])
    inside = []
    for i in range(len(mock)):
        s = mock[i]
        first, end, doc, block = s["block_indices"].tolist()
        assert (first, doc, block) == (0, i, i) and end >= 2  # document i's sentences 0..end, two or more
        ctx = s["context_tokens"][: int(s["context_padding_mask"].sum())].tolist()
        query = s["query_tokens"][: int(s["query_padding_mask"].sum())].tolist()
        assert ctx[0] == query[0] == vocab.special.cls and ctx[-1] == query[-1] == vocab.special.sep  # untitled: [CLS] block [SEP]
        sentences, _ = mock._draw(i, 61, 0.0, 2)  # the block before the query is drawn
        assert query[1:-1] in sentences and end == len(sentences)
        inside.append(ctx[1:-1] == [t for x in sentences for t in x][:62])  # the block cut to the sequence
        if not inside[-1]:
            sentences.remove(query[1:-1])
            assert ctx[1:-1] == [t for x in sentences for t in x][:62]
    assert 0.2 < np.mean(inside) < 0.4  # the query stays in its block with --query-in-block-prob


def test_mock_data_routes_through_each_family():
    cfg = Config(data=DataConfig(mock=True, seq_length=48, vocab_extra_ids=20, decoder_seq_length=24))
    for model, kind in (("bert", MockBERTDataset), ("t5", MockT5Dataset), ("ict", MockICTDataset)):
        train, valid, test = family(model).datasets(cfg, None, (40, 8, 0), 3, None, MOCK_VOCAB)
        assert isinstance(train, kind) and len(train) == 40 and len(valid) == 8 and test is None
        assert train.seed != valid.seed  # each split its own samples
        batch = next(MicroBatchIterator(train, 4, 0))
        assert all(v.shape[0] == 4 for v in batch.values())
    with pytest.raises(ValueError, match="--vocab-extra-ids"):
        family("t5").datasets(Config(data=DataConfig(mock=True, decoder_seq_length=24)), None, (4, 0, 0), 3, None, MOCK_VOCAB)
