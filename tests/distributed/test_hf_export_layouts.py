"""``hf-export`` of a checkpoint two tensor-parallel ranks wrote, read tensor by tensor in one
process with no process group (``checkpoint/tensor_reader.py``).

The model has one kv head for the two ranks (each holds a copy of its k/v rows, one writes them),
SwiGLU (each rank's fc1 is a gate run and an up run of the global rows) and a padded vocabulary
(100 tokens -> 128 rows, split over tp; the checkpoint and the export hold the 100 real rows).
transformers must load the sharded export and give the logits of a one-process meshtron model
holding the ranks' gathered weights; the checkpoint also
holds the optimizer's state, which the export never reads.
"""

import pytest
import torch

from meshtron.checkpoint.checkpoint import read_dcp_metadata
from meshtron.checkpoint.tensor_reader import CheckpointWeights
from meshtron.config import build_config
from meshtron.models import build_model
from meshtron.models.hf import export_hf
from meshtron.training.trainer import Trainer
from tests.distributed.full_weights import full_weights
from tests.distributed.launcher import run_distributed
from tests.distributed.test_trainer_layouts import BASE

transformers = pytest.importorskip("transformers")

# Later flags win over BASE's.
FLAGS = [*BASE, "--train-iters", "1", "--tp", "2", "--micro-batch-size", "4", "--num-query-groups", "1",
         "--vocab-size", "100", "--make-vocab-size-divisible-by", "64"]  # fmt: skip


def _train_and_save(rank, world_size, save):
    trainer = Trainer(build_config(None, [*FLAGS, "--save", save]), log=lambda _: None)
    trainer.run()
    return full_weights(trainer.model, trainer.runner.metas, trainer.mesh)


def test_export_of_a_tp2_checkpoint_matches_its_weights(tmp_path):
    weights = run_distributed(_train_and_save, 2, str(tmp_path / "ckpt"))[0]
    cfg = build_config(None, FLAGS)
    model = build_model(cfg.model, 100, cfg.data.seq_length, 128).eval()
    model.load_state_dict(weights, strict=True)

    directory = tmp_path / "ckpt" / "iter_0000001"
    assert sorted(p.name for p in directory.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    saved = read_dcp_metadata(directory).state_dict_metadata
    assert any(k.startswith("optimizer.") for k in saved)
    assert set(CheckpointWeights(tmp_path / "ckpt")) == set(weights)  # the model's tensors only
    assert list(saved["model.embedding.weight"].size) == [100, 64]  # the real rows, whatever the tp

    export_hf(tmp_path / "ckpt", tmp_path / "hf", dtype="fp32", max_shard_size=50_000)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert reloaded.config.vocab_size == 100
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)
