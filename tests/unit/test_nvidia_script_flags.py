"""The flags of NVIDIA's Megatron-LM example ``examples/deepseek2_lite/train_deepseek2_lite_h100_fp8.sh``
(its mock-data branch, bf16, 8 GPUs; read from the repository) are all known to meshtron.

Three are refused, each with its fix:
- ``--decoupled-lr`` and ``--decoupled-min-lr``: meshtron has one learning-rate schedule;
- ``--kv-channels`` beside ``--multi-latent-attention``: MLA's head sizes have their own flags.

Without them the run validates, and the flags meshtron does its own way are in the start-up notes.
"""

from __future__ import annotations

import shlex

import pytest

from meshtron.config import build_config
from meshtron.errors import ConfigError
from meshtron.flags import noted_flag_lines
from meshtron.validation import validate

REFUSED = "--kv-channels 16 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5"
SCRIPT = (
    "--num-layers 16 --hidden-size 2048 --ffn-hidden-size 10944 --num-attention-heads 16 --seq-length 1024 "
    "--max-position-embeddings 1024 --attention-dropout 0.0 --hidden-dropout 0.0 --disable-bias-linear "
    "--untie-embeddings-and-output-weights --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --no-masked-softmax-fusion "
    "--attention-softmax-in-fp32 --use-mcore-models --make-vocab-size-divisible-by 3200 --transformer-impl local "
    "--multi-latent-attention --kv-lora-rank 512 --v-head-dim 128 --qk-head-dim 128 --qk-layernorm --qk-pos-emb-head-dim 64 "
    "--num-experts 64 --moe-layer-freq ([0]+[1]*15) --moe-ffn-hidden-size 1408 --moe-grouped-gemm "
    "--moe-router-score-function softmax --moe-router-topk 6 --moe-router-topk-scaling-factor 1.0 --moe-router-pre-softmax "
    "--moe-shared-expert-intermediate-size 2816 --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall "
    "--moe-token-drop-policy probs --moe-router-load-balancing-type seq_aux_loss "
    "--position-embedding-type rope --no-rope-fusion --rotary-percent 1.0 --rotary-base 10000 --rotary-scaling-factor 40 "
    "--mscale 0.707 --mscale-all-dim 0.707 "
    "--micro-batch-size 1 --global-batch-size 64 --train-samples 47340000 --lr-decay-samples 47245280 "
    "--lr-warmup-samples 94720 --lr 0.00015 --min-lr 0.00001 --lr-decay-style cosine --clip-grad 1.0 "
    "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion "
    "--calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 --exit-duration-in-mins 235000000 "
    "--no-persist-layer-norm --tensor-model-parallel-size 8 --context-parallel-size 1 --pipeline-model-parallel-size 1 "
    "--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --tiktoken-pattern v2 --split 99,1,0 "
    "--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 "
    "--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --ckpt-format torch_dist "
    "--distributed-timeout-minutes 120"
)  # fmt: skip


def script_config(tmp_path, extra: str = ""):
    where = f"--data-cache-path {tmp_path / 'cache'} --save {tmp_path / 'ckpt'} --tensorboard-dir {tmp_path / 'tb'}"
    return build_config(None, shlex.split(f"{SCRIPT} {where} {extra}"))


def test_the_refused_flags_are_named_each_with_its_fix(tmp_path):
    with pytest.raises(ConfigError) as refused:
        validate(script_config(tmp_path, REFUSED), world_size=8)
    problems = [line for line in str(refused.value).splitlines() if line.startswith("  - ")]
    assert len(problems) == 3
    assert "--kv-channels does not apply to --multi-latent-attention" in problems[0]
    assert "--decoupled-lr 5.0e-4: one learning-rate schedule for every parameter" in problems[1]
    assert "--decoupled-min-lr 4.5e-5: one learning-rate schedule for every parameter" in problems[2]


def test_without_them_the_script_validates_and_says_what_meshtron_does(tmp_path):
    cfg = script_config(tmp_path)
    validate(cfg, world_size=8)
    t = cfg.train
    assert (t.manual_gc, t.manual_gc_interval, t.empty_unused_memory_level) == (True, 0, 1)
    lines = noted_flag_lines(cfg.logging.noted_flags)
    for flag in ("--calculate-per-token-loss", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
                 "--tiktoken-pattern v2"):  # fmt: skip
        assert sum(line.startswith(flag + ":") for line in lines) == 1, flag


def test_a_tiktoken_pattern_megatron_lacks_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--tiktoken-pattern v3: not one of Megatron's values"):
        validate(script_config(tmp_path, "--tiktoken-pattern v3"), world_size=8)
