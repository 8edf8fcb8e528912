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


DEEPSEEK = SCRIPT.parents[1] / "deepseek_v2" / "train_deepseekv2.sh"


def _deepseek(*knobs: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(DEEPSEEK), *knobs], env={**os.environ, "DRY_RUN": "1", "GPUS_PER_NODE": "8", **env},
                          capture_output=True, text=True)  # fmt: skip


def test_deepseek_v2_recipe_defaults_and_fp8_full_recompute_validate_on_8_gpus():
    """ROCm's train_deepseekv2.sh knobs: defaults (bf16, selective recompute, EP 8) and PR=fp8 AC=full."""
    cfg = build_config(None, _argv(_deepseek()))
    validate(cfg, world_size=8)
    m, t = cfg.model, cfg.train
    assert m.preset == "deepseek-v2-lite" and m.multi_latent_attention and m.num_experts == 64 and m.kv_lora_rank == 512
    assert (cfg.parallel.expert_parallel, cfg.parallel.tensor_parallel, cfg.parallel.use_distributed_optimizer) == (8, 1, True)
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters, cfg.data.seq_length) == (4, 256, 50, 2048)
    assert m.recompute_granularity == "selective" and t.precision == "bf16" and not m.fp8_format and cfg.data.mock
    assert "--max-padding-length 2048" in " ".join(cfg.logging.noted_flags)

    fp8 = build_config(None, _argv(_deepseek("PR=fp8", "AC=full", "MBS=2", "GBS=64", "SEQ_LEN=4096", "TRAIN_ITERS=7", "GEMM_TUNING=1")))
    validate(fp8, world_size=8)
    assert fp8.model.fp8_format == "hybrid" and fp8.train.gemm_tuning and fp8.data.seq_length == 4096
    assert (fp8.model.recompute_granularity, fp8.model.recompute_method, fp8.model.recompute_num_layers) == ("full", "uniform", 27)
    assert (fp8.train.micro_batch_size, fp8.train.global_batch_size, fp8.train.train_iters) == (2, 64, 7)


def test_deepseek_v2_recipe_layout_data_and_output_knobs(tmp_path):
    two = build_config(None, _argv(_deepseek("GPUS_PER_NODE=2")))  # EP 8 halved until it divides dp 2
    validate(two, world_size=2)
    assert two.parallel.expert_parallel == 2
    nodes = _deepseek("NNODES=2", "NODE_RANK=1", "MASTER_ADDR=node0", "EP=4", "TP=2", "TEE_OUTPUT=0", f"LOG_DIR={tmp_path}")
    argv = shlex.split(nodes.stdout)
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--master-addr") + 1] == "node0" and f"{tmp_path}/output_perf.log only" in nodes.stderr
    cfg = build_config(None, _argv(nodes))
    validate(cfg, world_size=16)
    assert (cfg.parallel.expert_parallel, cfg.parallel.tensor_parallel, cfg.parallel.sequence_parallel) == (4, 2, True)
    real = build_config(None, _argv(_deepseek("MOCK_DATA=0", f"DATA_DIR={tmp_path}", "TOKENIZER_MODEL=tok.json")))
    assert real.data.data_path == [f"{tmp_path}/mmap_deepseekv2_datasets_text_document"] and not real.data.mock
    assert real.data.tokenizer_type == "HuggingFaceTokenizer" and real.data.tokenizer_model == "tok.json"
    assert "TOKENIZER_MODEL" in _deepseek("MOCK_DATA=0").stderr
    assert _deepseek("PR=fp16").returncode == 2 and _deepseek("AC=block").returncode == 2


def test_megatron_and_pai_mla_flags_spell_the_preset():
    """Megatron's MLA flags and PAI/ROCm's spellings, given alone, set the deepseek-v2-lite preset's
    attention fields; through the recipe's EXTRA they leave its model unchanged."""
    megatron = ("--multi-latent-attention --kv-lora-rank 512 --q-lora-rank 0 --qk-head-dim 128 --qk-pos-emb-head-dim 64 "
                "--v-head-dim 128 --qk-layernorm --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707")  # fmt: skip
    pai = "--multi-latent-attention --qk-nope-head-dim 128 --qk-rope-head-dim 64 --v-head-dim 128 --kv-lora-rank 512"
    fields = ("multi_latent_attention", "kv_lora_rank", "q_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    preset = build_config(None, _argv(_deepseek())).model
    for flags in (megatron, pai):
        alone = build_config(None, shlex.split(flags)).model
        assert [getattr(alone, f) for f in fields] == [getattr(preset, f) for f in fields]
        assert build_config(None, _argv(_deepseek(f"EXTRA={flags}"))).model == preset
    alone = build_config(None, shlex.split(megatron)).model
    assert (alone.qk_layernorm, alone.rope_scaling_factor, alone.rope_mscale, alone.rope_mscale_all_dim) == (True, 40.0, 0.707, 0.707)
    shared = build_config(None, shlex.split("--num-experts 64 --moe-ffn-hidden-size 1408 --enable-shared-expert --num-shared-experts 2"))
    assert shared.model.moe_shared_expert_intermediate_size == preset.moe_shared_expert_intermediate_size == 2816
