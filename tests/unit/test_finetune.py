"""``meshtron finetune``: a BERT checkpoint fine-tuned on a tiny separable jsonl classification
set (one class word among filler words) reaches a validation accuracy far above chance, starting
from the checkpoint's body. The checkpoint is a randomly initialized tiny BERT: a trained one
would only make the task easier."""

import json
import random

import torch

from meshtron.checkpoint.checkpoint import save_checkpoint
from meshtron.cli import main
from meshtron.config import build_config
from meshtron.models import build_model
from meshtron.models.bert_classifier import BertClassifier

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
COLOURS, ANIMALS, FILLER = ["red", "green", "blue", "pink"], ["cat", "dog", "fox", "owl"], ["the", "a", "big", "small", "near", "far"]
VOCAB = 128  # the vocabulary (16 words, the specials, [BOS] and [EOS]) padded


def _bert_checkpoint(root):
    (root / "tokenizer").mkdir(parents=True)
    (root / "tokenizer" / "vocab.txt").write_text("\n".join(SPECIALS + COLOURS + ANIMALS + FILLER) + "\n")
    cfg = build_config(overrides=["--preset", "tiny-bert", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "16",
                                  "--tokenizer-type", "BertWordPieceLowerCase"])  # fmt: skip
    torch.manual_seed(0)
    bert = build_model(cfg.model, VOCAB, cfg.data.seq_length)
    meta = {"config": cfg.to_dict(), "vocab_size": VOCAB,
            "tokenizer": {"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": "tokenizer/vocab.txt"}}  # fmt: skip
    save_checkpoint(root, 7, bert, None, meta, save_optim=False)
    return bert


def _jsonl(path, n: int, seed: int) -> None:
    """Sentences of filler words with one class word: a colour (label "colour") or an animal."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            label = rng.choice(["colour", "animal"])
            words = rng.choices(FILLER, k=5)
            words.insert(rng.randrange(6), rng.choice(COLOURS if label == "colour" else ANIMALS))
            f.write(json.dumps({"text": " ".join(words), "label": label}) + "\n")


def test_classifier_starts_from_the_bert_body(tmp_path):
    bert = _bert_checkpoint(tmp_path / "bert")
    classifier = BertClassifier.from_bert(bert, 3)
    expected = bert.state_dict()
    for name, tensor in classifier.state_dict().items():
        if not name.startswith("classification_head"):
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    assert classifier(torch.full((2, 16), 5), torch.ones(2, 16, dtype=torch.bool)).shape == (2, 3)


def test_finetune_reaches_high_validation_accuracy(tmp_path, capsys):
    _bert_checkpoint(tmp_path / "bert")
    _jsonl(tmp_path / "train.jsonl", 96, seed=1)
    _jsonl(tmp_path / "valid.jsonl", 48, seed=2)
    code = main(["finetune", "--load", str(tmp_path / "bert"), "--train-data", str(tmp_path / "train.jsonl"),
                 "--valid-data", str(tmp_path / "valid.jsonl"), "--epochs", "10", "--lr", "2e-3", "--micro-batch-size", "8",
                 "--device", "cpu", "--save", str(tmp_path / "classifier.pt")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    accuracies = [float(line.split("validation accuracy ")[1].rstrip("%")) for line in out.splitlines() if line.startswith("epoch")]
    # A randomly initialized body sits at chance for a few epochs, then finds the class word
    # (seeds 1 to 3 and the default: 100% from epoch 4 to 6 on).
    assert len(accuracies) == 10 and accuracies[-1] >= 90.0, out  # chance is ~50%
    saved = torch.load(tmp_path / "classifier.pt", weights_only=False)
    assert saved["classes"] == ["animal", "colour"] and "classification_head.weight" in saved["model"]
