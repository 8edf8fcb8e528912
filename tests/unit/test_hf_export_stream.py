"""``hf-export`` streams (``checkpoint/tensor_reader.py``, ``models/hf_shards.py``): sharded output
that transformers loads with meshtron's logits, and a bounded number of checkpoint bytes alive.

The checkpoint is a Llama-shaped meshtron model with random weights everywhere (norm gains too, so
a misplaced tensor shows) and a padded vocabulary (100 tokens padded to 128 rows), saved in fp32.
"""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

from meshtron.checkpoint import tensor_reader  # noqa: E402
from meshtron.checkpoint.checkpoint import save_checkpoint  # noqa: E402
from meshtron.cli import main as cli_main  # noqa: E402
from meshtron.checkpoint.tensor_reader import CheckpointWeights  # noqa: E402
from meshtron.config import build_config  # noqa: E402
from meshtron.models import build_model, padded_vocab_size  # noqa: E402
from meshtron.models.hf import export_hf  # noqa: E402
from meshtron.models.hf_shards import parse_size, write_shards  # noqa: E402

LAYERS = 8
FLAGS = ["--num-layers", str(LAYERS), "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2", "--swiglu",
         "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--vocab-size", "100", "--make-vocab-size-divisible-by", "64",
         "--seq-length", "32", "--tokenizer-type", "NullTokenizer"]  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint directory, the model it holds)."""
    cfg = build_config(None, FLAGS)
    vocab = padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by)
    model = build_model(cfg.model, vocab, cfg.data.seq_length).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    path = tmp_path_factory.mktemp("stream") / "ckpt"
    save_checkpoint(path, 3, model, None, {"config": cfg.to_dict(), "vocab_size": vocab, "tokenizer": {}}, save_optim=False)
    return path, model


def _logits_agree(hf_dir, model):
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    reloaded = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    assert reloaded.config.vocab_size == 128  # the padded rows are kept: the logits are meshtron's
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)


def test_sharded_export_loads_in_transformers_with_equal_logits(saved, tmp_path):
    path, model = saved
    limit, out = 40_000, tmp_path / "hf"
    argv = ["convert", "hf-export", "--load", str(path), "--hf-dir", str(out), "--dtype", "fp32", "--max-shard-size", "40KB"]
    assert cli_main(argv) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 5 and files == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert not (out / "model.safetensors").exists()
    total = 0
    for name in files:
        with safe_open(str(out / name), "pt") as f:
            sizes = [f.get_tensor(k).numel() * 4 for k in f.keys()]
            assert sorted(index["weight_map"][k] for k in f.keys()) == [name] * len(sizes)
        assert sum(sizes) <= limit or len(sizes) == 1, (name, sizes)  # over the limit only as a tensor of its own
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    _logits_agree(out, model)

    export_hf(path, out, dtype="fp32")  # again into the same folder, one shard: the old shards go
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    _logits_agree(out, model)


def test_export_keeps_few_checkpoint_tensors_alive(saved, tmp_path, monkeypatch):
    """Spy on the lazy mapping: every tensor it hands out is tracked until it (and every view of
    it) is freed. Peak bytes alive stay within one shard + one layer + one tensor, a fraction of
    the checkpoint; reading the whole mapping at once (the old export) is caught by the same spy."""
    path, _ = saved
    alive, peak, reads = {"bytes": 0, "tensors": 0}, {"bytes": 0, "tensors": 0}, []
    read_one = CheckpointWeights.__getitem__

    def spy(self, name):
        tensor = read_one(self, name)
        size = tensor.numel() * tensor.element_size()
        reads.append(name)
        alive["bytes"], alive["tensors"] = alive["bytes"] + size, alive["tensors"] + 1
        peak.update({k: max(peak[k], alive[k]) for k in peak})
        weakref.finalize(tensor, lambda: alive.update(bytes=alive["bytes"] - size, tensors=alive["tensors"] - 1))
        return tensor

    monkeypatch.setattr(CheckpointWeights, "__getitem__", spy)
    weights = CheckpointWeights(path)
    sizes = {name: torch.Size(shape).numel() * 4 for name, shape in weights.shapes.items()}
    layer = max(sum(v for k, v in sizes.items() if k.startswith(f"layers.{i}.")) for i in range(LAYERS))
    limit = 40_000
    export_hf(path, tmp_path / "hf", dtype="fp32", max_shard_size=limit)
    assert sorted(reads) == sorted(sizes)  # every weight read once
    assert alive == {"bytes": 0, "tensors": 0}
    bound = limit + layer + max(sizes.values())
    assert peak["bytes"] <= bound, (peak, bound)  # many small norms may share a shard: bytes, not tensors, are bounded
    assert sum(sizes.values()) > 3 * bound  # the bound is a real one: well under the whole checkpoint

    peak.update(bytes=0, tensors=0)
    everything = dict(weights)  # what materializing the state dict costs, seen by the same spy
    assert peak == {"bytes": sum(sizes.values()), "tensors": len(sizes)}
    del everything


def test_reader_reads_model_tensors_only(saved, monkeypatch):
    path, model = saved
    keys = []
    read = tensor_reader.read_state
    monkeypatch.setattr(tensor_reader, "read_state", lambda state, *a: (keys.extend(state), read(state, *a)))
    weights = CheckpointWeights(path, dtype=torch.bfloat16)
    assert weights.meta["iteration"] == 3 and set(weights) == set(model.state_dict())
    got = weights["layers.2.mlp.linear_fc1.weight"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, model.state_dict()["layers.2.mlp.linear_fc1.weight"].bfloat16())
    assert keys == ["model.layers.2.mlp.linear_fc1.weight"]
    with pytest.raises(KeyError):
        weights["optimizer.master.embedding.weight"]


def test_writer_refuses_a_name_twice(tmp_path):
    with pytest.raises(ValueError, match="wrote a twice"):
        write_shards([("a", torch.zeros(2)), ("b", torch.ones(3)), ("a", torch.ones(2))], tmp_path, max_shard_size=8)


def test_parse_size():
    assert [parse_size(s) for s in ("5GB", "500MB", "100KiB", "12", "1.5kb")] == [5 * 10**9, 5 * 10**8, 102400, 12, 1500]
    for bad in ("", "5XB", "-1", "0", "GB"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)
