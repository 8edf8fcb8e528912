"""BERT for sequence classification (Megatron's downstream ``Classification`` model): BERT's body,
its pooler ([CLS]'s final state, dense, tanh), dropout and a linear layer to ``num_classes`` logits.

``from_bert`` takes a pretrained BERT's body and pooler (when it was trained with the binary head,
which owns the pooler) by parameter name; the classification layer starts from the init rule.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.config import ModelConfig
from meshtron.models.bert import Bert, BertEncoder, tokentype_rows
from meshtron.models.init import init_weights

HEAD_PARAMETERS = {"pooler.weight", "pooler.bias", "classification_head.weight", "classification_head.bias"}


class BertClassifier(BertEncoder):
    """``tokens [b, s]`` (``[CLS] text [SEP]``, padded) -> logits ``[b, num_classes]``."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_seq_length: int, num_classes: int, padded_vocab_size: int = 0):
        super().__init__(cfg, vocab_size, max_seq_length, tokentype_rows(cfg), padded_vocab_size)
        h = cfg.hidden_size
        self.pooler = nn.Linear(h, h)
        self.classifier_dropout = nn.Dropout(cfg.hidden_dropout)
        self.classification_head = nn.Linear(h, num_classes)
        init_weights(self, self.weight_init)

    @classmethod
    def from_bert(cls, bert: Bert, num_classes: int) -> "BertClassifier":
        """A classifier holding ``bert``'s body and pooler; its LM and sentence-order heads are dropped."""
        model = cls(bert.cfg, bert.vocab_size, bert.max_positions, num_classes, bert.padded_vocab_size)
        missing, _ = model.load_state_dict(bert.state_dict(), strict=False)  # the unexpected: BERT's pretraining heads
        if not set(missing) <= HEAD_PARAMETERS:
            raise ValueError(f"the BERT model lacks the classifier's body parameters {sorted(set(missing) - HEAD_PARAMETERS)}")
        return model

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        batch = {"tokens": tokens, "padding_mask": padding_mask}
        carry, _ = self.forward_blocks(self.embed(batch), self.block_inputs(batch), list(self.layers))
        pooled = torch.tanh(self.pooler(self.final_norm(carry["hidden"][:, 0])))  # a token-wise norm: [CLS]'s row suffices
        return self.classification_head(self.classifier_dropout(pooled))
