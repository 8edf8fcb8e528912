"""One vocabulary rule for training and ``estimate``: a named tokenizer sizes the model even with
``--mock-data`` (before, mock runs silently used 32000 rows), ``--extra-vocab-size`` adds rows,
the embedded corpus's tokenizer sizes the no-argument run, and ``estimate`` reports what trains."""

from __future__ import annotations

import pytest

from meshtron.cli import main
from meshtron.config import build_config
from meshtron.training.vocab import model_vocab_size, run_tokenizer


def _vocab(*flags: str) -> int:
    cfg = build_config(None, list(flags))
    return model_vocab_size(cfg, run_tokenizer(cfg))


def test_mock_data_takes_the_named_tokenizers_vocabulary():
    assert _vocab("--mock-data") == 32000
    assert _vocab("--mock-data", "--tokenizer-type", "ByteTokenizer") == 384  # 257 padded to a multiple of 128
    assert _vocab("--mock-data", "--tokenizer-type", "ByteTokenizer", "--extra-vocab-size", "200") == 512
    assert _vocab("--mock-data", "--tokenizer-type", "ByteTokenizer", "--vocab-size", "1000") == 1024
    assert _vocab("--mock-data", "--tokenizer-type", "ByteTokenizer", "--tensor-model-parallel-size", "4") == 512


def test_mock_data_takes_a_tokenizer_files_vocabulary(tmp_path):
    """What the ROCm scripts pass (--tokenizer-model with --mock-data), with the tokenizer on disk."""
    from tokenizers import Tokenizer

    from meshtron.data.tokenizers import train_bpe_tokenizer

    path = str(tmp_path / "tokenizer.json")
    train_bpe_tokenizer(["some text to learn merges from, some more text"] * 20, 300, path)
    size = Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    rows = _vocab("--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", path)
    assert rows == -(-size // 128) * 128 and rows != 32000


def test_a_hub_name_is_read_from_the_local_cache(tmp_path, monkeypatch):
    """The ROCm scripts name a Hugging Face model; its cached tokenizer.json sizes the vocabulary
    (nothing is downloaded), and without one the error says how to get it or do without."""
    from huggingface_hub import constants

    from meshtron.data.tokenizers import train_bpe_tokenizer

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    flags = ("--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "NousResearch/Meta-Llama-3-8B")
    with pytest.raises(FileNotFoundError, match="huggingface-cli download NousResearch/Meta-Llama-3-8B tokenizer.json.*set --vocab-size instead"):
        _vocab(*flags)
    repo = tmp_path / "models--NousResearch--Meta-Llama-3-8B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    train_bpe_tokenizer(["cached text, cached merges"] * 20, 400, str(repo / "snapshots" / "abc123" / "tokenizer.json"))
    assert _vocab(*flags) == _vocab("--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                    str(repo / "snapshots" / "abc123" / "tokenizer.json"))  # fmt: skip


@pytest.mark.parametrize("flags, rows", [([], 4096), (["--mock-data", "--tokenizer-type", "ByteTokenizer"], 384),
                                         (["--mock-data"], 32000)])  # fmt: skip
def test_estimate_uses_the_vocabulary_training_uses(capsys, flags, rows):
    assert main(["estimate", *flags]) == 0
    assert f"vocabulary: {rows} rows" in capsys.readouterr().out
