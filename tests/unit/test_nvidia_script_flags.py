"""The flags of NVIDIA's Megatron-LM example scripts are all known to meshtron (read from the
repository: ``examples/deepseek2_lite/train_deepseek2_lite_h100_fp8.sh`` and
``examples/llama/train_llama3_8b_h100_fp8.sh`` (with the logging flags of its sibling
``train_llama3_8b_h200_bf16.sh``) in their mock-data branches on 8 GPUs,
``examples/gpt3/train_gpt3_175b_distributed.sh`` on 128 with mock data for its files).

What meshtron cannot honour is refused, each with its fix:
- ``--kv-channels`` beside ``--multi-latent-attention``: MLA's head sizes have their own flags;
- ``--apply-layernorm-1p``: norm gains are stored centred on 1;
- GPT-3's ``--rampup-batch-size`` beside ``--train-iters``, which Megatron refuses too.

Without those the scripts validate, and the flags meshtron does its own way are in the start-up
notes, each once.
"""

from __future__ import annotations

import shlex

import pytest

from meshtron.config import build_config
from meshtron.errors import ConfigError
from meshtron.flags import noted_flag_lines
from meshtron.validation import validate

DATA_LOADER = ("--tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files "
               "--num-workers 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 128256")  # fmt: skip
RECIPE = ("--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0 "
          "--weight-decay 0.1 --adam-beta1 0.9 "
          "--adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc "
          "--empty-unused-memory-level 1 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
          "--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --ckpt-format torch_dist")  # fmt: skip
SCRIPTS = {
    "deepseek2_lite": (8, (
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
        "--mscale 0.707 --mscale-all-dim 0.707 --micro-batch-size 1 --global-batch-size 64 --train-samples 47340000 "
        "--lr-decay-samples 47245280 --lr-warmup-samples 94720 --exit-duration-in-mins 235000000 --no-persist-layer-norm "
        f"--tensor-model-parallel-size 8 --context-parallel-size 1 --pipeline-model-parallel-size 1 --sequence-parallel "
        f"--distributed-timeout-minutes 120 {RECIPE} {DATA_LOADER}"),
        "--kv-channels 16", ["--kv-channels does not apply to --multi-latent-attention"]),
    "llama3_8b_fp8": (8, (
        "--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192 "
        "--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 "
        "--swiglu --init-method-std 0.0134 --attention-backend fused --untie-embeddings-and-output-weights --disable-bias-linear "
        "--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748 "
        "--lr-warmup-samples 3906252 --exit-duration-in-mins 235 --fp8-format hybrid --fp8-amax-history-len 1024 "
        "--fp8-amax-compute-algo max --fp8-param-gather --tensor-model-parallel-size 1 --context-parallel-size 1 "
        f"--sequence-parallel --profile --profile-step-start 4 --profile-step-end 6 --distributed-timeout-minutes 60 "
        "--log-params-norm --log-num-zeros-in-grad --log-timers-to-tensorboard "  # the H200 bf16 sibling script's
        f"{RECIPE} {DATA_LOADER}"),
        "--apply-layernorm-1p", ["--apply-layernorm-1p: norm gains are stored as they apply"]),
    "gpt3_175b": (128, (
        "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048 "
        "--attention-backend auto --micro-batch-size 1 --global-batch-size 1536 --train-iters 500000 --weight-decay 0.1 "
        "--adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine "
        "--min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000 --tensor-model-parallel-size 8 "
        "--pipeline-model-parallel-size 16 --mock-data --vocab-size 50257 --split 949,50,1 --log-interval 100 "
        "--save-interval 10000 --eval-interval 1000 --eval-iters 10"),
        "--rampup-batch-size 16 16 5859375",
        ["--rampup-batch-size count samples: add --train-samples"]),
}  # fmt: skip


def script_config(tmp_path, flags: str):
    where = f"--data-cache-path {tmp_path / 'cache'} --save {tmp_path / 'ckpt'} --tensorboard-dir {tmp_path / 'tb'}"
    return build_config(None, shlex.split(f"{flags} {where}"))


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_what_cannot_be_honoured_is_refused_each_with_its_fix(tmp_path, name):
    world, flags, refused, messages = SCRIPTS[name]
    with pytest.raises(ConfigError) as caught:
        validate(script_config(tmp_path, f"{flags} {refused}"), world_size=world)
    said = str(caught.value)
    assert all(message in said for message in messages), said


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_without_it_the_script_validates_and_says_what_meshtron_does(tmp_path, name):
    world, flags, _, _ = SCRIPTS[name]
    cfg = script_config(tmp_path, flags)
    validate(cfg, world_size=world)
    if name == "gpt3_175b":
        assert (cfg.train.lr_warmup_fraction, cfg.train.lr_warmup_iters) == (0.001, 0)
        return
    assert (cfg.train.manual_gc, cfg.train.empty_unused_memory_level, cfg.data.tokenizer_type) == (True, 1, "")
    assert (cfg.train.decoupled_lr, cfg.train.decoupled_min_lr) == (5.0e-4, 4.5e-5)
    lines = noted_flag_lines(cfg.logging.noted_flags)
    logging = ("--log-params-norm", "--log-num-zeros-in-grad") if name == "llama3_8b_fp8" else ()
    for flag in ("--calculate-per-token-loss", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
                 "--tiktoken-pattern v2", "--tokenizer-type NullTokenizer", *logging):  # fmt: skip
        assert sum(line.startswith(flag) for line in lines) == 1, (flag, lines)


def test_a_tiktoken_pattern_megatron_lacks_is_refused(tmp_path):
    world, flags, _, _ = SCRIPTS["deepseek2_lite"]
    with pytest.raises(ConfigError, match="--tiktoken-pattern v3: not one of Megatron's values"):
        validate(script_config(tmp_path, f"{flags} --tiktoken-pattern v3"), world_size=world)
