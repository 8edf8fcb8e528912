"""Per-split data (Megatron's --train/valid/test-data-path, --per-split-data-args-path) and
--data-args-path: the flags and files land in the config, each split's datasets are built from
its own blend, and the ways of naming data exclude each other with errors that say what to drop."""

import json

import numpy as np
import pytest

from meshtron.config import ConfigError, build_config
from meshtron.data.blended import BlendedDataset
from meshtron.data.builder import build_datasets
from meshtron.data.gpt_dataset import GPTDataset
from meshtron.data.indexed import IndexedDatasetBuilder
from meshtron.data.tokenizers import ByteTokenizer
from meshtron.training.trainer import Trainer
from meshtron.validation import validate

EOD = 256


def corpus(tmp_path, name: str, low: int, n_docs: int = 60) -> str:
    """Documents of tokens in [low, low + 50): a sample's tokens say which corpus it came from."""
    b = IndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), np.uint16)
    rng = np.random.default_rng(low)
    for _ in range(n_docs):
        b.add_document(rng.integers(low, low + 50, int(rng.integers(5, 40))).tolist() + [EOD])
    b.finalize(str(tmp_path / f"{name}.idx"))
    return str(tmp_path / name)


def sources_of(dataset, n: int) -> set[int]:
    """The corpora (their ``low // 50``) whose tokens the first ``n`` samples hold."""
    return {int(t) // 50 for i in range(n) for t in dataset[i]["tokens"].tolist() if t != EOD}


def test_flags_and_files_fill_the_config(tmp_path):
    cfg = build_config(None, ["--train-data-path", "0.3", "a", "0.7", "b", "--valid-data-path", "v", "--test-data-path", "t"])
    assert (cfg.data.train_data_path, cfg.data.valid_data_path, cfg.data.test_data_path) == (["0.3", "a", "0.7", "b"], ["v"], ["t"])
    args = tmp_path / "data_args.txt"
    args.write_text("0.4 x\n0.6 y\n")
    assert build_config(None, ["--data-args-path", str(args)]).data.data_path == ["0.4", "x", "0.6", "y"]
    per_split = tmp_path / "per_split.json"
    per_split.write_text(json.dumps({"train": "0.5 a 0.5 b", "valid": ["v"], "test": None}))
    d = build_config(None, ["--per-split-data-args-path", str(per_split)]).data
    assert (d.train_data_path, d.valid_data_path, d.test_data_path) == (["0.5", "a", "0.5", "b"], ["v"], [])


@pytest.mark.parametrize("flags, message", [
    (["--data-path", "a", "--train-data-path", "b"], "both name the data; keep one"),
    (["--data-path", "a", "--data-args-path", "FILE"], "--data-path and --data-args-path both name the data"),
    (["--data-args-path", "FILE", "--valid-data-path", "a", "--train-data-path", "b"], "--data-args-path\\) and per-split data"),
    (["--per-split-data-args-path", "JSON", "--train-data-path", "b"], "--per-split-data-args-path and --train/valid/test-data-path"),
    (["--mock-data", "--train-data-path", "b"], "--mock-data and per-split data"),
    (["--train-data-path", "b", "--split", "90,10,0"], "drop --split"),
    (["--valid-data-path", "b"], "without a train blend: add --train-data-path"),
    (["--data-args-path", "NOWHERE"], "--data-args-path .*NOWHERE: cannot read it"),
    (["--per-split-data-args-path", "BAD"], "must be a JSON object with keys train, valid, test"),
    (["--per-split-data-args-path", "NOTJSON"], "is not JSON"),
])  # fmt: skip
def test_refusals_say_what_to_drop(tmp_path, flags, message):
    files = {"FILE": "a", "JSON": json.dumps({"train": "a"}), "BAD": json.dumps({"training": "a"}), "NOTJSON": "{train"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        build_config(None, [str(tmp_path / f) if f in files or f == "NOWHERE" else f for f in flags])


def test_each_split_is_built_from_its_own_blend(tmp_path):
    train_a, train_b = corpus(tmp_path, "train_a", 0), corpus(tmp_path, "train_b", 150)
    valid, test = corpus(tmp_path, "valid", 50), corpus(tmp_path, "test", 100)
    cfg = build_config(None, ["--train-data-path", "0.25", train_a, "0.75", train_b, "--valid-data-path", valid, "--test-data-path", test,
                              "--tokenizer-type", "ByteTokenizer", "--seq-length", "16", "--data-cache-path", str(tmp_path / "cache")])  # fmt: skip
    validate(cfg, world_size=1)
    train, valid_ds, test_ds = build_datasets(cfg.data, ByteTokenizer(), (400, 20, 10), seed=5)
    assert isinstance(train, BlendedDataset) and isinstance(valid_ds, GPTDataset) and isinstance(test_ds, GPTDataset)
    # every document of a per-split dataset belongs to its split (no --split division)
    assert [d.description["document_range"] for d in train.datasets] == [[0, 60], [0, 60]]
    assert valid_ds.description["document_range"] == [0, 60] and len(valid_ds) >= 20 and len(test_ds) >= 10
    shares = [int(train.dataset_index[train.dataset_index == k].size) for k in (0, 1)]
    assert shares == [100, 300]  # Megatron's greedy blend of 0.25 / 0.75
    assert sources_of(train.datasets[0], 20) == {0} and sources_of(train.datasets[1], 20) == {3}
    assert sources_of(valid_ds, 20) == {1} and sources_of(test_ds, 10) == {2}


def test_a_missing_per_split_prefix_names_its_flag(tmp_path):
    cfg = build_config(None, ["--train-data-path", corpus(tmp_path, "t", 0), "--valid-data-path", str(tmp_path / "nope"),
                              "--tokenizer-type", "ByteTokenizer"])  # fmt: skip
    with pytest.raises(ConfigError, match="--valid-data-path: '.*nope.bin' not found"):
        validate(cfg, world_size=1)


def test_training_reads_the_train_blend_and_validates_on_the_valid_one(tmp_path):
    flags = ["--preset", "tiny-gpt", "--train-data-path", corpus(tmp_path, "t", 0), "--valid-data-path", corpus(tmp_path, "v", 50),
             "--tokenizer-type", "ByteTokenizer", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
             "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1", "--device", "cpu", "--fp32"]  # fmt: skip
    lines = []
    trainer = Trainer(build_config(None, flags), log=lines.append)
    assert sources_of(trainer.train_data, 4) == {0} and sources_of(trainer.valid_data, 2) == {1}
    result = trainer.run()
    assert result.iteration == 2 and len(result.valid_losses) == 1
    assert not any("embedded corpus" in line for line in lines)
