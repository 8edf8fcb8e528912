"""``meshtron finetune``: fine-tune a BERT checkpoint to classify text (Megatron's downstream
classification tasks, on any labelled jsonl), with the validation accuracy after every epoch.

Data: jsonl lines ``{"text": ..., "label": ...}``; a label is an int or a string, the classes are
the training file's labels, sorted. Each text becomes ``[CLS] text [SEP]``, cut and padded to
``--seq-length`` (default: the checkpoint's) with the checkpoint's tokenizer. The model is
``models/bert_classifier.py`` started from the checkpoint's BERT body and pooler.

One process (the CPU or one GPU), fp32, AdamW with a linear decay of the learning rate to zero:
fine-tuning sets are small, and the pretraining runner's layouts are not needed to fit them.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from meshtron.checkpoint.saved_model import load_saved_model
from meshtron.data.masked_lm import pad
from meshtron.models.bert_classifier import BertClassifier


def read_examples(path: str) -> tuple[list[str], list]:
    """Texts and labels of a jsonl file of ``{"text", "label"}`` objects."""
    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "text" not in row or "label" not in row:
                raise ValueError(f"{path}:{number}: each line needs 'text' and 'label', got keys {sorted(row)}")
            texts.append(row["text"])
            labels.append(row["label"])
    if not texts:
        raise ValueError(f"{path} holds no examples")
    return texts, labels


def encode_texts(tokenizer, texts: list[str], seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[CLS] text [SEP]`` per text, cut to ``seq_length`` and padded: (tokens, padding mask) ``[n, seq_length]``."""
    rows = [pad([tokenizer.cls, *tokenizer.encode(t)[: seq_length - 2], tokenizer.sep], seq_length, tokenizer.pad) for t in texts]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


@torch.no_grad()
def accuracy(model: BertClassifier, tokens: torch.Tensor, padding_mask: torch.Tensor, labels: torch.Tensor, batch_size: int) -> float:
    """Fraction of examples whose highest logit is their label (the model in eval mode)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    for start in range(0, len(labels), batch_size):
        rows = slice(start, start + batch_size)
        logits = model(tokens[rows].to(device), padding_mask[rows].to(device))
        correct += int((logits.argmax(-1).cpu() == labels[rows]).sum())
    model.train(was_training)
    return correct / len(labels)


def finetune_classifier(load_dir: str, train_path: str, valid_path: str, epochs: int = 3, lr: float = 2e-5, batch_size: int = 32,
                        seq_length: int = 0, weight_decay: float = 0.01, seed: int = 1234, device: str = "auto", save: str = "",
                        log: Callable[[str], None] = print) -> list[float]:  # fmt: skip
    """Fine-tune the BERT of ``load_dir`` on ``train_path``; returns the validation accuracy after
    each epoch. ``save``: a file for the classifier's weights, classes and config."""
    saved = load_saved_model(load_dir, needs="bert")
    seq_length = seq_length or saved.config.data.seq_length
    train_texts, train_labels = read_examples(train_path)
    valid_texts, valid_labels = read_examples(valid_path)
    classes = sorted(set(train_labels), key=str)
    index = {c: i for i, c in enumerate(classes)}
    unknown = sorted({str(v) for v in valid_labels if v not in index})
    if unknown:
        raise ValueError(f"{valid_path} has labels the training data lacks: {unknown[:5]}")
    train_x, train_mask = encode_texts(saved.tokenizer, train_texts, seq_length)
    valid_x, valid_mask = encode_texts(saved.tokenizer, valid_texts, seq_length)
    train_y = torch.tensor([index[v] for v in train_labels])
    valid_y = torch.tensor([index[v] for v in valid_labels])

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    torch.manual_seed(seed)
    model = BertClassifier.from_bert(saved.model, len(classes)).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * math.ceil(len(train_y) / batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / steps)
    log(f"fine-tuning {load_dir} (iteration {saved.meta['iteration']}) on {len(train_y)} examples of {len(classes)} classes, "
        f"{len(valid_y)} to validate; {steps} steps of {batch_size}")  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    accuracies = []
    model.train()
    for epoch in range(1, epochs + 1):
        total = 0.0
        for rows in torch.randperm(len(train_y), generator=generator).split(batch_size):
            loss = F.cross_entropy(model(train_x[rows].to(dev), train_mask[rows].to(dev)), train_y[rows].to(dev))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.item() * len(rows)
        accuracies.append(accuracy(model, valid_x, valid_mask, valid_y, batch_size))
        log(f"epoch {epoch}/{epochs} | train loss {total / len(train_y):.4f} | validation accuracy {100 * accuracies[-1]:.2f}%")
    if save:
        Path(save).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "classes": classes, "seq_length": seq_length, "config": saved.config.to_dict()}, save)
        log(f"saved the classifier to {save}")
    return accuracies


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshtron finetune", description="fine-tune a BERT checkpoint to classify jsonl text")
    parser.add_argument("--load", "--pretrained-checkpoint", dest="load", required=True, help="a BERT checkpoint directory (--save of a bert run)")
    parser.add_argument("--train-data", required=True, help='jsonl of {"text": ..., "label": ...}')
    parser.add_argument("--valid-data", required=True, help="jsonl of the same form; its accuracy is reported after each epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--seq-length", type=int, default=0, help="tokens per example (default: the checkpoint's)")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--save", default="", help="write the fine-tuned classifier to this file")
    args = parser.parse_args(argv)
    accuracies = finetune_classifier(args.load, args.train_data, args.valid_data, args.epochs, args.lr, args.micro_batch_size,
                                     args.seq_length, args.weight_decay, args.seed, args.device, args.save)  # fmt: skip
    print(f"final validation accuracy {100 * accuracies[-1]:.2f}%")
    return 0
