"""The ICT retriever in one process: its towers are BERT's body under BERT's names (separate or
shared), the loss is the cross-entropy of each query against its own block among the micro
batch's, top-k accuracies, ``--bert-load`` filling both towers from a BERT checkpoint, the
held-out retrieval evaluation, parameter counts and the config rules."""

import math

import pytest
import torch
import torch.nn.functional as F

from meshtron.checkpoint.checkpoint import save_checkpoint
from meshtron.checkpoint.pretrained import load_pretrained_encoders
from meshtron.config import ConfigError, build_config
from meshtron.models import build_model, flops_shape, num_parameters, parameter_count
from meshtron.models.contract import default_meta
from meshtron.models.ict import topk_accuracies
from meshtron.downstream.retrieval import retrieval_accuracies
from meshtron.parallel.mesh import Mesh
from meshtron.validation import validate

VOCAB, SEQ = 96, 12
TINY = ["--preset", "tiny-ict", "--num-layers", "2", "--hidden-size", "32", "--biencoder-projection-dim", "16"]


def _cfg(*flags: str):
    return build_config(overrides=[*TINY, *flags])


def _model(*flags: str):
    torch.manual_seed(0)
    return build_model(_cfg(*flags).model, VOCAB, SEQ).eval()


def _batch(rows: int = 4, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for side in ("query", "context"):
        out[f"{side}_tokens"] = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        out[f"{side}_padding_mask"] = torch.arange(SEQ)[None, :] < torch.randint(3, SEQ + 1, (rows, 1), generator=g)
    return out


def test_towers_are_bert_bodies_separate_or_shared():
    separate, shared = _model(), _model("--biencoder-shared-query-context-model")
    bert = build_model(build_config(overrides=[*TINY, "--model-type", "bert"]).model, VOCAB, SEQ)
    body = {n for n in bert.state_dict() if not n.startswith(("lm_head", "output", "pooler", "binary_head"))}
    assert {n.removeprefix("towers.query.") for n in separate.state_dict() if n.startswith("towers.query.")} == body
    assert {n.split(".")[1] for n in separate.state_dict() if n.startswith("towers.")} == {"query", "context"}
    assert {n.split(".")[1] for n in shared.state_dict() if n.startswith("towers.")} == {"shared"}
    assert len(list(separate.blocks())) == 4 and len(list(shared.blocks())) == 2
    for model, flags in ((separate, []), (shared, ["--biencoder-shared-query-context-model"])):
        assert num_parameters(model) == parameter_count(_cfg(*flags).model, VOCAB, SEQ)


def test_flops_count_two_tower_passes_per_sample_without_lookups():
    for flags in ([], ["--biencoder-shared-query-context-model"]):
        model = _model(*flags)
        tower = model.towers["shared" if flags else "query"]
        multiplying = sum(p.numel() for m in (tower.layers, tower.final_norm) for p in m.parameters())
        assert flops_shape(_cfg(*flags).model, VOCAB, SEQ) == (2 * multiplying, 4)


@pytest.mark.parametrize("scaling", [False, True])
def test_loss_is_each_querys_cross_entropy_against_its_own_block(scaling):
    model = _model(*(["--retriever-score-scaling"] if scaling else ["--no-retriever-score-scaling"]),
                   "--retriever-report-topk-accuracies", "1", "2")  # fmt: skip
    batch = _batch()
    out, _ = model.run_stage(None, batch, list(model.blocks()), True, True)
    loss = model.loss(batch, out)
    query = model.encode("query", batch["query_tokens"], batch["query_padding_mask"])
    context = model.encode("context", batch["context_tokens"], batch["context_padding_mask"])
    torch.testing.assert_close(out["query"], query)
    scores = query @ context.t() / (math.sqrt(32) if scaling else 1.0)
    torch.testing.assert_close(loss.total, F.cross_entropy(scores, torch.arange(4), reduction="sum"))
    assert loss.count == 4 == model.loss_count(batch)
    assert set(loss.metrics) == {"top1_acc", "top2_acc"}


def test_padding_does_not_change_the_embeddings():
    model = _model()
    batch = _batch()
    changed = batch["context_tokens"].clone()
    changed[~batch["context_padding_mask"]] = (changed[~batch["context_padding_mask"]] + 1) % VOCAB
    a = model.encode("context", batch["context_tokens"], batch["context_padding_mask"])
    b = model.encode("context", changed, batch["context_padding_mask"])
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_topk_accuracies():
    scores = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    acc = topk_accuracies(scores, torch.tensor([0, 1, 2]), [1, 2, 5])
    assert {k: round(v.item(), 4) for k, v in acc.items()} == {"top1_acc": 0.3333, "top2_acc": 0.6667, "top5_acc": 1.0}


def test_bert_load_fills_both_towers_from_a_bert_checkpoint(tmp_path):
    bert_cfg = build_config(overrides=[*TINY, "--model-type", "bert"])
    torch.manual_seed(5)
    bert = build_model(bert_cfg.model, VOCAB, SEQ)
    save_checkpoint(tmp_path, 3, bert, None, {"config": bert_cfg.to_dict(), "vocab_size": VOCAB, "tokenizer": {}}, save_optim=False)
    model = _model()
    projection = model.projections["query"].weight.clone()
    metas = {n: default_meta(n, p) for n, p in model.named_parameters()}
    logged = []
    load_pretrained_encoders(str(tmp_path), model, None, Mesh(), metas, logged.append)
    assert "towers.query, towers.context" in logged[0] and "iteration 3" in logged[0]
    expected = bert.state_dict()
    for name, tensor in model.state_dict().items():
        if name.startswith("towers."):
            torch.testing.assert_close(tensor, expected[name.split(".", 2)[2]], rtol=0, atol=0)
    torch.testing.assert_close(model.projections["query"].weight, projection)  # not BERT's: it stays as initialized


def test_retrieval_finds_identical_blocks_and_not_shuffled_ones():
    """With one tower and no projection, [CLS] embeddings are LayerNorm outputs of equal norm, so a
    query identical to its block scores it highest (Cauchy-Schwarz): accuracy 1. Pairing each
    query with another sample's block instead leaves only chance."""
    model = _model("--biencoder-shared-query-context-model", "--biencoder-projection-dim", "0")
    batch = _batch(rows=32)
    same = [{"query_tokens": batch["context_tokens"][i], "query_padding_mask": batch["context_padding_mask"][i],
             "context_tokens": batch["context_tokens"][i], "context_padding_mask": batch["context_padding_mask"][i]} for i in range(32)]  # fmt: skip
    assert retrieval_accuracies(model, same, [1], batch_size=5) == {"top1_acc": 1.0}
    shifted = [{**s, "context_tokens": same[(i + 1) % 32]["context_tokens"], "context_padding_mask": same[(i + 1) % 32]["context_padding_mask"]}
               for i, s in enumerate(same)]  # fmt: skip
    assert retrieval_accuracies(model, shifted, [1], batch_size=5)["top1_acc"] <= 0.2


def test_config_rules():
    validate(_cfg("--retriever-report-topk-accuracies", "1", "5", "20"))
    assert _cfg("--ict-head-size", "8").model.biencoder_projection_dim == 8
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 1"):
        validate(_cfg("--pipeline-model-parallel-size", "2"), world_size=2)
    validate(_cfg("--sequence-parallel", "--tp", "2"), world_size=2)
    with pytest.raises(ConfigError, match="--context-parallel-size 1"):
        validate(_cfg("--context-parallel-size", "2"), world_size=2)
    with pytest.raises(ConfigError, match="--retriever-report-topk-accuracies"):
        validate(_cfg("--retriever-report-topk-accuracies", "0"))
    with pytest.raises(ConfigError, match="--bert-load"):
        validate(build_config(overrides=["--preset", "tiny-bert", "--bert-load", "somewhere"]))
