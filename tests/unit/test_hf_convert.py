"""Hugging Face import/export (``meshtron/models/hf.py``) held to transformers' own logits.

Tiny random HF models are built here (no download), imported, and must give the logits HF gives
on the same tokens in fp32; exported back, transformers must load them and agree again.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from meshtron.checkpoint.checkpoint import CheckpointError, load_checkpoint, read_meta  # noqa: E402
from meshtron.models.hf import export_hf, import_hf  # noqa: E402
from meshtron.models.hf_common import fuse_qkv, split_qkv  # noqa: E402
from meshtron.cli import main as cli_main  # noqa: E402
from meshtron.config import Config  # noqa: E402
from meshtron.data.tokenizers import train_bpe_tokenizer  # noqa: E402
from meshtron.models import build_model  # noqa: E402

LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256, rope_theta=10000.0, max_position_embeddings=128)  # fmt: skip
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}  # fmt: skip


def _random_init(model: torch.nn.Module, seed: int = 0) -> None:
    """HF inits norms to ones; random values everywhere make a swapped or misplaced tensor show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))


def _save_llama(tmp_path, **overrides):
    cfg = transformers.LlamaConfig(**{**LLAMA, **overrides})
    model = transformers.LlamaForCausalLM(cfg).eval()
    _random_init(model)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    return model, hf_dir


def _meshtron_logits(save_dir, tokens, **model_fields):
    """The logits of the checkpoint in ``save_dir``, its model config changed by ``model_fields``."""
    meta = read_meta(save_dir)
    cfg = Config.from_dict(meta["config"])
    for name, value in model_fields.items():
        setattr(cfg.model, name, value)
    model = build_model(cfg.model, meta["vocab_size"], cfg.data.seq_length).eval()
    load_checkpoint(save_dir, model, load_rng=False)
    with torch.no_grad():
        return model(tokens)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def _import_through_cli(tmp_path, hf_model) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``hf_model`` saved, then ``meshtron convert hf-import``ed in fp32: (tokens, HF's logits on
    them, the imported model config), the imported logits checked equal to HF's."""
    hf_model.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    expected = _hf_logits(hf_model, tokens)
    assert cli_main(["convert", "hf-import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"), "--dtype", "fp32"]) == 0
    torch.testing.assert_close(_meshtron_logits(tmp_path / "ckpt", tokens), expected, atol=1e-5, rtol=1e-5)
    return tokens, expected, read_meta(tmp_path / "ckpt")["config"]["model"]


def _export_through_cli(tmp_path, hf_class, tokens, expected) -> tuple[set, dict]:
    """The checkpoint ``_import_through_cli`` wrote, ``hf-export``ed: the same tensor names as the
    original files, and ``hf_class.from_pretrained`` on it gives ``expected``; (names, config.json)."""
    from safetensors.torch import load_file

    assert cli_main(["convert", "hf-export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    written = load_file(str(tmp_path / "out" / "model.safetensors")).keys()
    assert written == load_file(str(tmp_path / "hf" / "model.safetensors")).keys()
    reloaded = hf_class.from_pretrained(tmp_path / "out").eval()
    reloaded.config._attn_implementation = "eager"
    torch.testing.assert_close(_hf_logits(reloaded, tokens), expected, atol=1e-5, rtol=1e-5)
    return set(written), json.loads((tmp_path / "out" / "config.json").read_text())


def _check_fused_expert_import(tmp_path, hf_model, *fused_names: str) -> None:
    """A MoE model saved in transformers 5's in-memory form (stacked ``experts.gate_up_proj`` /
    ``down_proj``, checked present by ``fused_names``) imports to the logits HF gives, as the Hub's
    per-expert files do."""
    from safetensors.torch import save_file

    hf_model.save_pretrained(tmp_path / "hf")
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert all(name in state for name in fused_names), sorted(state)
    save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    import_hf(tmp_path / "hf", tmp_path / "ckpt", dtype="fp32")
    tokens = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_meshtron_logits(tmp_path / "ckpt", tokens), _hf_logits(hf_model, tokens), atol=1e-5, rtol=1e-5)


def test_fuse_split_qkv_roundtrip_and_layout():
    q, k, v = torch.arange(8 * 3).view(8, 3), 100 + torch.arange(4 * 3).view(4, 3), 200 + torch.arange(4 * 3).view(4, 3)
    fused = fuse_qkv(q, k, v, groups=2)  # head dim 2: group 0 = q heads 0,1 | k head 0 | v head 0
    assert torch.equal(fused[:4], q[:4]) and torch.equal(fused[4:6], k[:2]) and torch.equal(fused[6:8], v[:2])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, heads=4, groups=2), (q, k, v)))


@pytest.mark.parametrize("overrides", [{}, {"rope_scaling": LLAMA3_SCALING, "tie_word_embeddings": True}], ids=["plain", "llama3-tied"])
def test_llama_import_export_match_transformers(tmp_path, overrides):
    hf_model, hf_dir = _save_llama(tmp_path, **overrides)
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))  # past the original 32 positions
    expected = _hf_logits(hf_model, tokens)

    import_hf(hf_dir, tmp_path / "ckpt", dtype="fp32")
    meta = read_meta(tmp_path / "ckpt")
    assert meta["iteration"] == 0 and meta["consumed_samples"] == 0 and meta["vocab_size"] == 256
    torch.testing.assert_close(_meshtron_logits(tmp_path / "ckpt", tokens), expected, atol=1e-5, rtol=1e-5)

    export_hf(tmp_path / "ckpt", tmp_path / "exported", dtype="fp32")
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert reloaded.config.tie_word_embeddings == bool(overrides.get("tie_word_embeddings", False))
    torch.testing.assert_close(_hf_logits(reloaded, tokens), expected, atol=1e-5, rtol=1e-5)


def test_gpt2_import_export_match_transformers(tmp_path):
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, activation_function="gelu")
    hf_model = transformers.GPT2LMHeadModel(cfg).eval()
    _random_init(hf_model)
    hf_model.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    expected = _hf_logits(hf_model, tokens)

    import_hf(tmp_path / "hf", tmp_path / "ckpt", dtype="fp32")
    torch.testing.assert_close(_meshtron_logits(tmp_path / "ckpt", tokens), expected, atol=1e-5, rtol=1e-5)

    export_hf(tmp_path / "ckpt", tmp_path / "exported", dtype="fp32")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "exported").eval()
    torch.testing.assert_close(_hf_logits(reloaded, tokens), expected, atol=1e-5, rtol=1e-5)


def test_sharded_weights_import(tmp_path, monkeypatch, capsys):
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    _random_init(hf_model)
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, 256, (1, 16))
    monkeypatch.setenv("MESHTRON_PROGRESS", "1")  # the bar over the shards' bytes, shown though stderr is captured
    import_hf(tmp_path / "hf", tmp_path / "ckpt", dtype="fp32")
    assert "reading safetensors: 100%" in capsys.readouterr().err
    torch.testing.assert_close(_meshtron_logits(tmp_path / "ckpt", tokens), _hf_logits(hf_model, tokens), atol=1e-5, rtol=1e-5)
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"weights file .*{shard.name} is missing"):
        import_hf(tmp_path / "hf", tmp_path / "again", dtype="fp32")


def test_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        import_hf(tmp_path, tmp_path / "ckpt")
    _, hf_dir = _save_llama(tmp_path)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: model\.layers\.0\.mlp\.gate_proj\.weight has shape \[128, 64\]"):
        import_hf(hf_dir, tmp_path / "ckpt")
    (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "olmo2"}))
    with pytest.raises(CheckpointError, match="model_type 'olmo2' is not supported"):
        import_hf(hf_dir, tmp_path / "ckpt")
    (hf_dir / "config.json").write_text(json.dumps(config))
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        import_hf(hf_dir, tmp_path / "ckpt")


def test_cli_import_then_generate_and_finetune_config(tmp_path, capsys):
    _, hf_dir = _save_llama(tmp_path, vocab_size=300)
    train_bpe_tokenizer(["hello world, the quick brown fox jumps over the lazy dog"] * 20, 300, str(hf_dir / "tokenizer.json"))
    save = tmp_path / "ckpt"
    assert cli_main(["convert", "hf-import", "--hf-dir", str(hf_dir), "--save", str(save)]) == 0
    assert (save / "tokenizer" / "tokenizer.json").is_file() and (save / "model_config.yaml").is_file()
    capsys.readouterr()
    assert cli_main(["generate", "--load", str(save), "--prompt", "hello", "--max-new-tokens", "5", "--greedy"]) == 0
    assert capsys.readouterr().out.startswith("hello")
    from meshtron.config import build_config

    cfg = build_config(str(save / "model_config.yaml"), ["--load", str(save), "--no-load-optim", "--no-load-rng"])
    assert cfg.model.vocab_size == 300 and cfg.model.make_vocab_size_divisible_by == 1 and cfg.data.tokenizer_type == "HuggingFaceTokenizer"
    assert cli_main(["convert", "hf-export", "--load", str(save), "--hf-dir", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"  # the import's default, kept
    assert config["bos_token_id"] is None and config["eos_token_id"] == 0  # the tokenizer has an end of text only
    assert cli_main(["convert", "hf-import", "--hf-dir", str(tmp_path / "nothing"), "--save", str(save)]) == 2


def test_imported_checkpoint_fine_tunes(tmp_path, capsys):
    _, hf_dir = _save_llama(tmp_path)
    import_hf(hf_dir, tmp_path / "ckpt", dtype="fp32")
    args = ["train", "--config", str(tmp_path / "ckpt" / "model_config.yaml"), "--load", str(tmp_path / "ckpt"),
            "--no-load-optim", "--no-load-rng", "--mock-data", "--seq-length", "32", "--train-iters", "2",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--lr-warmup-iters", "0", "--eval-iters", "0",
            "--save", str(tmp_path / "tuned")]  # fmt: skip
    assert cli_main(args) == 0
    assert "resumed from" in capsys.readouterr().out
    assert read_meta(tmp_path / "tuned")["iteration"] == 2


def test_gpt2_tanh_gelu_imports_exactly(tmp_path):
    """GPT-2's default activation (gelu_new, the tanh approximation) maps to meshtron's gelu_tanh."""
    hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt", dtype="fp32")
    tokens = torch.randint(0, 256, (1, 16))
    torch.testing.assert_close(_meshtron_logits(tmp_path / "ckpt", tokens), _hf_logits(hf_model, tokens), atol=1e-5, rtol=1e-5)
    export_hf(tmp_path / "ckpt", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["activation_function"] == "gelu_new"

def test_export_keeps_the_checkpoints_dtype_real_token_ids_and_a_normal_file_mode(tmp_path):
    """A GPT trained as the default run trains one (a 4096-token BPE is ~300 here, fp32 on the CPU):
    the export stays fp32 unless --dtype says otherwise, its bos/eos are the tokenizer's end of text
    (left out, transformers' GPT-2 would say 50256, beyond the vocabulary), and the weights file
    has the mode the umask gives a new file (safetensors writes 0600)."""
    import os

    from safetensors import safe_open

    from meshtron.checkpoint.checkpoint import save_checkpoint
    from meshtron.config import build_config

    save = tmp_path / "ckpt"
    (save / "tokenizer").mkdir(parents=True)
    train_bpe_tokenizer(["hello world, the quick brown fox jumps over the lazy dog"] * 20, 300, str(save / "tokenizer" / "tokenizer.json"))
    cfg = build_config(None, ["--preset", "tiny-gpt", "--tokenizer-type", "HuggingFaceTokenizer"])
    model = build_model(cfg.model, 320, cfg.data.seq_length)
    tokenizer = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "tokenizer/tokenizer.json"}
    save_checkpoint(save, 5, model, None, {"config": cfg.to_dict(), "vocab_size": 320, "tokenizer": tokenizer}, save_optim=False)
    eod = json.loads((save / "tokenizer" / "tokenizer.json").read_text())["added_tokens"][0]["id"]

    old_mask = os.umask(0o027)
    try:
        assert cli_main(["convert", "hf-export", "--load", str(save), "--hf-dir", str(tmp_path / "out")]) == 0
    finally:
        os.umask(old_mask)
    weights = tmp_path / "out" / "model.safetensors"
    assert weights.stat().st_mode & 0o777 == 0o640
    with safe_open(str(weights), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["bos_token_id"] == config["eos_token_id"] == eod < config["vocab_size"]
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert hf_config.bos_token_id == hf_config.eos_token_id == eod

    assert cli_main(["convert", "hf-export", "--load", str(save), "--hf-dir", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    (save / "tokenizer" / "tokenizer.json").unlink()  # no tokenizer to read the ids from: null, not transformers' defaults
    assert cli_main(["convert", "hf-export", "--load", str(save), "--hf-dir", str(tmp_path / "none")]) == 0
    config = json.loads((tmp_path / "none" / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    assert transformers.AutoConfig.from_pretrained(tmp_path / "none").bos_token_id is None
