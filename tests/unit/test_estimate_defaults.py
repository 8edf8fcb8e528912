"""``meshtron estimate`` with a preset and a world size alone (no batch sizes): micro batch 1 and
global batch micro x dp, stated; given ones are kept. Apart from ``test_estimate.py``, whose
model-family tests change on their own."""

from meshtron.cli import main


def test_a_preset_and_a_world_size_are_enough_and_the_batches_chosen_are_stated(capsys, tmp_path):
    assert main(["estimate", "--preset", "llama3-8b", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "batch: micro 1, global 8 (not given, so micro 1 and global = micro x dp, Megatron-LM's rule; set them with" in out
    assert "8.03 B parameters" in out and "total" in out
    assert main(["estimate", "--preset", "llama3-8b", "--world-size", "8", "--tp", "2", "--micro-batch-size", "2"]) == 0
    assert "batch: micro 2, global 8 (not given, so global = micro x dp, Megatron-LM's rule;" in capsys.readouterr().out
    config = tmp_path / "run.toml"
    config.write_text("[train]\nmicro_batch_size = 1\nglobal_batch_size = 128\n")
    assert main(["estimate", "--config", str(config), "--preset", "llama3-8b", "--world-size", "8"]) == 0
    assert "batch:" not in capsys.readouterr().out  # both given in the file: nothing chosen, nothing said
