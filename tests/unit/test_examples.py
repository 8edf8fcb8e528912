"""The launch script with the ROCm example scripts' knobs builds a command whose flags meshtron accepts."""

import os
import shlex
import subprocess
from pathlib import Path

from meshtron.config import build_config
from meshtron.validation import validate

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "llama" / "train_llama.sh"


def _dry_run(**env):
    proc = subprocess.run(["bash", str(SCRIPT)], env={**os.environ, "DRY_RUN": "1", **env}, capture_output=True, text=True)
    return proc


def test_knobs_become_valid_meshtron_flags():
    proc = _dry_run(MODEL="llama3.1", MODEL_SIZE="8", GPUS_PER_NODE="8", TP="2", PP="2", MBS="1", BS="64",
                    SEQ_LENGTH="4096", TE_FP8="1", RECOMPUTE="1", GEMM_TUNING="1", TOTAL_ITERS="7")
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert argv[:1] == ["torchrun"] and "--nproc-per-node" in argv
    cfg = build_config(None, argv[argv.index("train") + 1 :])
    validate(cfg, world_size=8)
    assert cfg.model.rope_scaling == "llama3" and cfg.model.hidden_size == 4096
    assert (cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel, cfg.parallel.sequence_parallel) == (2, 2, True)
    assert cfg.parallel.use_distributed_optimizer and cfg.model.fp8_format == "hybrid" and cfg.train.gemm_tuning
    assert cfg.model.recompute_granularity == "full" and cfg.train.train_iters == 7 and cfg.data.seq_length == 4096
    assert cfg.train.global_batch_size == 64 and cfg.data.mock


def test_unknown_model_size_is_refused():
    proc = _dry_run(MODEL="llama2", MODEL_SIZE="8", GPUS_PER_NODE="1")
    assert proc.returncode == 2 and "no preset for MODEL=llama2 MODEL_SIZE=8" in proc.stderr


def _argv(proc) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    return argv[argv.index("train") + 1 :]


def _run(script: str, *knobs: str, **env) -> subprocess.CompletedProcess:
    path = SCRIPT.parent / script
    return subprocess.run(["bash", str(path), *knobs], env={**os.environ, "DRY_RUN": "1", "GPUS_PER_NODE": "8", **env},
                          capture_output=True, text=True)  # fmt: skip


def test_rocm_script_names_and_key_value_arguments():
    """train_llama2.sh / train_llama3.sh pick the family; KEY=VALUE arguments work as the environment does."""
    llama2 = build_config(None, _argv(_run("train_llama2.sh", "TP=2", "MBS=1", "BS=16", "TOTAL_ITERS=3")))
    assert llama2.model.hidden_size == 4096 and llama2.model.rope_scaling == "" and llama2.parallel.tensor_parallel == 2
    assert (llama2.train.micro_batch_size, llama2.train.global_batch_size, llama2.train.train_iters) == (1, 16, 3)
    llama3 = build_config(None, _argv(_run("train_llama3.sh", "MODEL_SIZE=70", "TP=8")))
    assert llama3.model.num_layers == 80 and llama3.parallel.sequence_parallel
    assert _run("train_llama3.sh", "TP").returncode == 2


def test_data_path_means_real_data_and_fsdp_forces_tp1(tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    cfg = build_config(None, _argv(_run("train_llama3.sh", f"DATA_PATH={prefix}", "TOKENIZER_MODEL=tok", f"DATA_CACHE_PATH={tmp_path}")))
    assert cfg.data.data_path == [prefix] and not cfg.data.mock and cfg.data.data_cache_path == str(tmp_path)
    proc = _run("train_llama3.sh", "FSDP=1", "TP=4")
    cfg = build_config(None, _argv(proc))
    assert cfg.parallel.fsdp and cfg.parallel.tensor_parallel == 1 and not cfg.parallel.sequence_parallel
    assert "resetting TP=4 to TP=1" in proc.stderr
    validate(cfg, world_size=8)


def test_recompute_profiling_flash_and_output_knobs(tmp_path):
    proc = _run("train_llama3.sh", "RECOMPUTE=1", "ENABLE_PROFILING=1", "USE_FLASH_ATTN=1", f"LOG_DIR={tmp_path}", "TEE_OUTPUT=0")
    cfg = build_config(None, _argv(proc))
    m, log = cfg.model, cfg.logging
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "block", 32)
    assert log.profile and log.tensorboard_dir == str(tmp_path) and m.attention_backend == "flash"
    assert f"{tmp_path}/output_perf.log only" in proc.stderr
    assert "terminal and" in _run("train_llama3.sh").stderr
    assert build_config(None, _argv(_run("train_llama3.sh"))).model.attention_backend == "auto"  # fused: cuDNN first
