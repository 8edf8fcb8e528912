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
