"""Every flag the ROCm fork's launch scripts pass to ``pretrain_gpt.py`` is accepted.

The flag sets below are those of ROCm/Megatron-LM's ``examples/llama/train_llama3.sh``,
``examples/llama/train_llama2.sh``, ``examples/deepseek_v2/train_deepseekv2.sh`` and
``examples/deepseek_v3/train_deepseekv3.sh`` (read from the repository; the ``*_flags`` functions
follow each script's branches for its knobs), on 8 GPUs of one node, and DeepSeek-V3's also on the
8 nodes of its Slurm wrapper. Each goes through ``build_config`` and ``validate``; flags that
meshtron does its own way must then be in the start-up notes, each said once.

Not tested: the FP4 and Megatron-FSDP/HSDP knobs. DeepSeek-V3's script has no dry-run mode, no
multi-token prediction and no batch ramp-up (its README's "dryrun" names only log files).
"""

from __future__ import annotations

import shlex

import pytest

from meshtron.config import build_config
from meshtron.flags import NOTED_FLAGS, noted_flag_lines
from meshtron.validation import validate

WORLD = 8


def llama3_flags(FSDP=0, TE_FP8=0, RECOMPUTE=0, MODEL_SIZE=70, TP=8, MBS=1, BS=8, ENABLE_PROFILING=0, USE_FLASH_ATTN=0,
                 WANDB=False, SAVE=False, LOAD=False) -> str:  # fmt: skip
    """train_llama3.sh (2026) with the given knobs, everything else at its default."""
    layers, hidden, ffn, heads, groups = {8: (32, 4096, 14336, 32, 8), 70: (80, 8192, 28672, 64, 8)}[MODEL_SIZE]
    seq_parallel = 1
    gradient_accumulation_fusion = 1
    if FSDP:
        gradient_accumulation_fusion, TP = 0, 1
    gpt = (f"--tensor-model-parallel-size {TP} --pipeline-model-parallel-size 1 --context-parallel-size 1 --num-layers {layers} "
           f"--hidden-size {hidden} --ffn-hidden-size {ffn} --num-attention-heads {heads} --seq-length 2048 "
           "--max-position-embeddings 131072 --untie-embeddings-and-output-weights --position-embedding-type rope "
           "--no-position-embedding --swiglu --use-te-activation-func --no-bias-swiglu-fusion --disable-bias-linear "
           "--init-method-std 0.02 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm "
           f"--micro-batch-size {MBS} --global-batch-size {BS} --train-iters 12 --bf16 --no-masked-softmax-fusion")  # fmt: skip
    if RECOMPUTE:
        gpt += f" --recompute-num-layers {layers} --recompute-granularity full --recompute-method block"
    if not gradient_accumulation_fusion:
        gpt += " --no-gradient-accumulation-fusion"
    gpt += " --cross-entropy-loss-fusion --cross-entropy-fusion-impl te --fused-single-qkv-rope --grad-reduce-in-bf16"
    train = ("--lr 1e-4 --min-lr 1e-5 --lr-decay-iters 320000 --lr-decay-style cosine --weight-decay 1.0e-1 --clip-grad 1.0 "
             "--optimizer adam --adam-beta1 0.9 --adam-beta2 0.95")  # fmt: skip
    data = ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model NousResearch/Meta-Llama-3-8B --dataloader-type cyclic "
            "--save-interval 200000 --tensorboard-dir experiment/log --log-interval 1 --eval-interval 320000 --eval-iters 10 "
            "--num-workers 8 --mock-data")  # fmt: skip
    output = "--log-interval 1 --log-throughput --no-save-optim --no-save-rng --eval-iters -1"
    if SAVE:
        output += " --save-interval 5000 --eval-interval 5000 --ckpt-format torch --save experiment/ckpt"
    load = "--exit-on-missing-checkpoint --no-load-optim --no-load-rng --use-checkpoint-args --load ." if LOAD else ""
    extra = (f"--group-query-attention --num-query-groups {groups} --distributed-backend nccl --distributed-timeout-minutes 120 "
             "--overlap-grad-reduce --rerun-mode disabled")  # fmt: skip
    if FSDP:
        extra += " --use-torch-fsdp2"
        seq_parallel = 0
    else:
        extra += " --use-distributed-optimizer --overlap-param-gather"
    if ENABLE_PROFILING:
        extra += " --profile --use-pytorch-profiler --tensorboard-dir experiment/log"
    extra += " --use-flash-attn" if USE_FLASH_ATTN else " --attention-backend fused"
    if seq_parallel:
        extra += " --sequence-parallel"
    extra += " --use-mcore-models"
    if TE_FP8:  # TE_FP8_RECIPE=delayed, the default
        extra += (" --transformer-impl=transformer_engine --fp8-recipe=delayed --fp8-format=hybrid --fp8-margin=0 "
                  "--fp8-interval=1 --fp8-amax-history-len=1024 --fp8-amax-compute-algo=max --attention-softmax-in-fp32")  # fmt: skip
    logging = "--wandb-project=LLama --wandb-exp-name=LLama_70B --wandb-save-dir logs/wandb" if WANDB else ""
    extra += " --ddp-average-in-collective"
    return " ".join([gpt, data, output, extra, train, logging, load])


def llama2_flags(FSDP=0, TE_FP8=0, RECOMPUTE=0, MODEL_SIZE=70, TP=8, USE_FLASH_ATTN=1) -> str:
    """train_llama2.sh with the given knobs, everything else at its default."""
    layers, hidden, ffn, heads, kv = {7: (32, 4096, 11008, 32, 32), 13: (40, 5120, 13824, 40, 40), 70: (80, 8192, 28672, 64, 8)}[MODEL_SIZE]
    seq_parallel = 1
    if FSDP:
        TP = 1
    gpt = (f"--tensor-model-parallel-size {TP} --pipeline-model-parallel-size 1 --context-parallel-size 1 --num-layers {layers} "
           f"--hidden-size {hidden} --ffn-hidden-size {ffn} --num-attention-heads {heads} --seq-length 4096 "
           "--max-position-embeddings 32000 --untie-embeddings-and-output-weights --position-embedding-type rope "
           "--no-position-embedding --swiglu --disable-bias-linear --init-method-std 0.02 --attention-dropout 0.0 "
           "--hidden-dropout 0.0 --normalization RMSNorm --micro-batch-size 1 --global-batch-size 8 --train-iters 12 "
           "--no-async-tensor-model-parallel-allreduce --bf16 --no-masked-softmax-fusion")  # fmt: skip
    if RECOMPUTE:
        gpt += f" --recompute-num-layers {layers} --recompute-granularity full --recompute-method block"
    train = ("--lr 1e-4 --min-lr 1e-5 --lr-decay-iters 320000 --lr-decay-style cosine --weight-decay 1.0e-1 --clip-grad 1.0 "
             "--optimizer adam --adam-beta1 0.9 --adam-beta2 0.95")  # fmt: skip
    data = ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model NousResearch/Llama-2-7b-chat-hf --split 99990,8,2 "
            "--dataloader-type cyclic --save-interval 200000 --tensorboard-dir experiment/log --log-interval 1 "
            "--eval-interval 320000 --eval-iters 10 --num-workers 8 --mock-data")  # fmt: skip
    output = "--log-interval 1 --log-throughput --no-save-optim --no-save-rng --eval-iters -1"
    extra = (f"--group-query-attention --num-query-groups {heads // (heads // kv)} --no-gradient-accumulation-fusion "
             "--distributed-backend nccl --distributed-timeout-minutes 120 --overlap-grad-reduce")  # fmt: skip
    if FSDP:
        extra += " --use-torch-fsdp2"
        seq_parallel = 0
    else:
        extra += " --use-distributed-optimizer --overlap-param-gather"
    if USE_FLASH_ATTN:
        extra += " --use-flash-attn"
    if seq_parallel:
        extra += " --sequence-parallel"
    extra += " --use-mcore-models"
    if TE_FP8:
        extra += (" --transformer-impl=transformer_engine --fp8-recipe=delayed --fp8-format=hybrid --fp8-margin=0 "
                  "--fp8-interval=1 --fp8-amax-history-len=1024 --fp8-amax-compute-algo=max --attention-softmax-in-fp32")  # fmt: skip
    return " ".join([gpt, data, output, extra, train])


def deepseek_flags(PR="bf16", AC="sel") -> str:
    """train_deepseekv2.sh (DeepSeek-V2-Lite, 16B) with the given knobs; MOCK_DATA=1, TP=PP=1, EP=8, DO/FL on."""
    megatron = ("--log-throughput --no-gradient-accumulation-fusion --no-async-tensor-model-parallel-allreduce --lr 1e-5 "
                "--min-lr 1e-6 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 "
                "--init-method-std 0.008 --attention-dropout 0.0 --hidden-dropout 0.0 --dataloader-type cyclic "
                "--lr-decay-iters 48 --lr-warmup-iters 2 --train-iters 50 --micro-batch-size 4 --global-batch-size 256 "
                "--num-layers 27 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 10944 --seq-length 2048 "
                "--max-position-embeddings 2048 --max-padding-length 2048 --log-interval 1 --eval-interval 10000 "
                "--eval-iters -1 --exit-interval 50 --save-interval 5000000 --tensorboard-queue-size 1 "
                "--tensorboard-dir experiment/tb --log-timers-to-tensorboard --log-batch-size-to-tensorboard "
                "--log-validation-ppl-to-tensorboard --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
                "--no-load-optim --no-load-rng --num-workers 8 --extra-vocab-size 2400 --tokenizer-type DeepSeekV2Tokenizer "
                "--tokenizer-model deepseek-ai/DeepSeek-V2-Lite --dataset LLama-Pretrain-Idxmap --swiglu --normalization RMSNorm "
                "--norm-epsilon 1e-06 --use-rotary-position-embeddings --no-bias-swiglu-fusion --no-rope-fusion "
                "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --use-mcore-models "
                "--moe-grouped-gemm --moe-use-legacy-grouped-gemm --ckpt-format torch --rotary-base 10000 "
                "--rotary-scaling-factor 40 --transformer-impl transformer_engine --eod-mask-loss")  # fmt: skip
    data = "--mock-data --data-cache-path /root/cache"
    pr = {"bf16": "--bf16",
          "fp8": "--bf16 --fp8-format hybrid --fp8-amax-compute-algo max --fp8-amax-history-len 1024 --transformer-impl transformer_engine"}[PR]  # fmt: skip
    ac = {"full": "--recompute-method uniform --recompute-granularity full --recompute-num-layers 27",
          "sel": "--recompute-activations", "none": ""}[AC]  # fmt: skip
    moe = ("--multi-latent-attention --moe-ffn-hidden-size 1408 --enable-shared-expert --moe-layer-freq 1 --num-shared-experts 2 "
           "--moe-router-topk 6 --num-experts 64 --moe-aux-loss-coeff 1e-2 --expert-model-parallel-size 8 --kv-lora-rank 512 --qk-nope-head-dim 128 "
           "--qk-rope-head-dim 64 --v-head-dim 128 --moe-router-load-balancing-type aux_loss")  # fmt: skip
    return " ".join([megatron, data, pr, ac, "--use-distributed-optimizer", moe, "--train-mode pretrain", "--use-flash-attn"])


def deepseek_v3_flags(MODEL_SIZE="16B", MOCK_DATA=1, DATA_DIR="../data", PR="bf16", FP8_RECIPE="delayed", AC="none", RECOMPUTE_METHOD="block",
                      TP=1, PP=1, EP=8, ETP=1, NUM_LAYERS=None, MBS=1, GBS=128, SEQ_LEN=4096, TRAIN_ITERS=10, MP_VP=None,
                      ENABLE_DEEP_EP=False, APPLY_ROPE_FUSION=False, MOE_ROUTER_FUSION=False, MOE_SHARED_EXPERT_OVERLAP=False,
                      MOE_USE_LEGACY_GROUPED_GEMM=True, GPT_LAYER_IN_TE=True, USE_PRECISION_AWARE_OPTIMIZER=False,
                      GA_FUSION=False, CE_FUSION_ARGS="", PROFILE=False, FORCE_BALANCE=False, WINDOW_SIZE=None,
                      FUSED_PADDED_MLA_ATTENTION=False, MOE_LAYER_FREQ=None) -> str:  # fmt: skip
    """train_deepseekv3.sh (as of commit 430335a) with the given knobs (its environment variables), everything else at its default.

    The 671B proxy (proxy_mi355x_deepseekv3_671B.sh) and the 8-node Slurm wrapper only set these knobs; the
    proxy's USE_PRECISION_AWARE_OPTIMIZER (bf16 main gradients) is refused, the rest of it accepted."""
    if ETP == 1 and TP != EP and TP != 1:
        raise ValueError("the script itself stops: TP and EP must be equal when ETP is 1")
    layers, hidden, heads, ffn, expert_ffn, q_lora, experts, topk, shared, freq = {
        "671B": (61, 7168, 128, 18432, 2048, 1536, 256, 8, 1, "1"),
        "236B": (60, 5120, 128, 12288, 1536, 1536, 160, 6, 2, "1"),
        "16B": (27, 2048, 16, 10944, 1408, 512, 64, 6, 2, "([0]*3+[1]*24)")}[MODEL_SIZE]  # fmt: skip
    layers, freq = NUM_LAYERS or layers, MOE_LAYER_FREQ or freq
    data = ("--mock-data --data-cache-path ../.cache" if MOCK_DATA else
            " ".join(f"--{split}-data-path {DATA_DIR}/mmap_deepseekv3_datasets_text_document" for split in ("train", "valid", "test")))
    legacy_gg = MOE_USE_LEGACY_GROUPED_GEMM and PR != "fp8"  # FP8 MoE needs TE's grouped GEMM
    megatron = (f"--log-throughput{'' if GA_FUSION else ' --no-gradient-accumulation-fusion'} --no-async-tensor-model-parallel-allreduce {data} "
                "--lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 "
                "--init-method-std 0.008 --attention-dropout 0.0 --hidden-dropout 0.0 --dataloader-type cyclic "
                f"--lr-decay-iters {TRAIN_ITERS - 2} --lr-warmup-iters 2 --train-iters {TRAIN_ITERS} --micro-batch-size {MBS} "
                f"--global-batch-size {GBS} --num-layers {layers} --hidden-size {hidden} --num-attention-heads {heads} "
                f"--ffn-hidden-size {ffn} --seq-length {SEQ_LEN} --max-position-embeddings {SEQ_LEN} --max-padding-length 4096 "
                "--log-interval 1 --eval-interval 10000 --eval-iters -1 --save-interval 500000 --ckpt-format torch "
                "--tensorboard-queue-size 1 --tensorboard-dir output/tensorboard/ --log-timers-to-tensorboard "
                "--log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard "
                f"--tensor-model-parallel-size {TP} --pipeline-model-parallel-size {PP} --num-workers 8 --extra-vocab-size 0 "
                "--tokenizer-type DeepSeekV3Tokenizer --tokenizer-model deepseek-ai/DeepSeek-V3 --legacy-tokenizer "
                "--dataset LLama-Pretrain-Idxmap --swiglu --use-te-activation-func --no-bias-swiglu-fusion --normalization RMSNorm "
                "--norm-epsilon 1e-06 --use-rotary-position-embeddings --position-embedding-type rope "
                "--untie-embeddings-and-output-weights --disable-bias-linear --rotary-base 10000 --rotary-scaling-factor 40 "
                f"--transformer-impl {'transformer_engine' if GPT_LAYER_IN_TE or PR == 'fp8' else 'local'} --moe-grouped-gemm"
                f"{' --moe-use-legacy-grouped-gemm' if legacy_gg else ''} --distributed-timeout-minutes 60 --eod-mask-loss")  # fmt: skip
    if USE_PRECISION_AWARE_OPTIMIZER:
        megatron += " --use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"
    megatron += f" {CE_FUSION_ARGS}"
    pr = {"fp16": "--fp16 --apply-query-key-layer-scaling", "bf16": "--bf16",
          "fp8": {"delayed": "--bf16 --fp8-recipe delayed --fp8-format hybrid --fp8-margin 0 --fp8-amax-compute-algo max "
                             "--fp8-amax-history-len 1024 --attention-softmax-in-fp32",
                  "tensorwise": "--bf16 --fp8-recipe tensorwise --fp8-format hybrid",
                  "mxfp8": "--bf16 --fp8-recipe mxfp8 --fp8-format e4m3",
                  "blockwise": "--bf16 --fp8-recipe blockwise --fp8-format hybrid"}[FP8_RECIPE]}[PR]  # fmt: skip
    ac = {"full": f"--recompute-method {RECOMPUTE_METHOD} --recompute-granularity full --recompute-num-layers 1",
          "sel": "--recompute-activations", "none": ""}[AC]  # fmt: skip
    moe = {"671B": "--q-lora-rank {q_lora} --moe-router-score-function sigmoid --moe-router-num-groups {EP} --moe-router-group-topk 4 "
                   "--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3",
           "236B": "--q-lora-rank {q_lora} --moe-router-num-groups {EP} --moe-router-group-topk 3",
           "16B": "--q-lora-rank {q_lora} --moe-router-num-groups {EP}"}[MODEL_SIZE].format(EP=EP, q_lora=q_lora)  # fmt: skip
    moe += (" --moe-router-dtype fp32 --multi-latent-attention --qk-layernorm --rerun-mode disabled --attention-sink-k 0 "
            f"--moe-ffn-hidden-size {expert_ffn} --enable-shared-expert --moe-layer-freq {freq} --num-shared-experts {shared} "
            f"--moe-shared-expert-intermediate-size {shared * expert_ffn} --moe-router-load-balancing-type seq_aux_loss "
            f"--moe-router-topk {topk} --moe-permute-fusion --num-experts {experts} --moe-router-pre-softmax --mscale 1.0 "
            f"--mscale-all-dim 1.0 --moe-aux-loss-coeff 1e-2 --expert-model-parallel-size {EP} --expert-tensor-parallel-size {ETP} "
            "--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --kv-channels 128 "
            f"{'--enable-experimental' if APPLY_ROPE_FUSION else '--no-rope-fusion'}")  # fmt: skip
    if ENABLE_DEEP_EP:
        moe += " --moe-token-dispatcher-type flex --moe-enable-deepep"
    else:
        moe += " --moe-token-dispatcher-type alltoall" + (" --moe-shared-expert-overlap" if MOE_SHARED_EXPERT_OVERLAP else "")
    if PR == "fp8" and FP8_RECIPE == "mxfp8":
        moe += " --moe-router-padding-for-quantization"
    if MOE_ROUTER_FUSION:
        moe += " --moe-router-fusion"
    if WINDOW_SIZE:
        moe += f" --window-size {WINDOW_SIZE}"
    if FUSED_PADDED_MLA_ATTENTION:
        moe += " --fused-padded-mla-attention"
    sp = "--sequence-parallel" if TP > 1 else ""
    vp = f"--num-layers-per-virtual-pipeline-stage {MP_VP}" if MP_VP else ""
    overlap = "--overlap-grad-reduce --ddp-bucket-size 629145600 --overlap-param-gather"
    profile = ("--profile --profile-ranks 0 --use-pytorch-profiler --profile-step-start 6 --profile-step-end 7 "
               "--moe-router-force-load-balancing" if PROFILE else "--moe-router-force-load-balancing" if FORCE_BALANCE else "")  # fmt: skip
    return " ".join([megatron, pr, ac, "--use-distributed-optimizer", sp, moe, overlap, "--train-mode pretrain", vp,
                     "--use-flash-attn", profile])  # fmt: skip


CASES = {
    "llama3 defaults": llama3_flags(),
    "llama3 FSDP": llama3_flags(FSDP=1),
    "llama3 FP8 + RECOMPUTE + profiling + W&B off + save/load": llama3_flags(TE_FP8=1, RECOMPUTE=1, ENABLE_PROFILING=1, SAVE=True, LOAD=True),
    "llama3 8B flash": llama3_flags(MODEL_SIZE=8, USE_FLASH_ATTN=1, TP=1, MBS=2, BS=16),
    "llama2 defaults": llama2_flags(),
    "llama2 7B FSDP": llama2_flags(FSDP=1, MODEL_SIZE=7),
    "llama2 FP8 + RECOMPUTE": llama2_flags(TE_FP8=1, RECOMPUTE=1),
    "deepseek defaults": deepseek_flags(),
    "deepseek FP8 + full recompute": deepseek_flags(PR="fp8", AC="full"),
}
# DeepSeek-V3: every model size x precision x recompute, then the other knobs; (flags, world size).
V3_CASES = {
    f"deepseek-v3 {size} {pr} AC={ac}": (deepseek_v3_flags(MODEL_SIZE=size, PR=pr, FP8_RECIPE=recipe, AC=ac), WORLD)
    for size in ("16B", "236B", "671B") for pr, recipe in (("bf16", "delayed"), ("fp16", "delayed"), ("fp8", "delayed"), ("fp8", "tensorwise"))
    for ac in ("none", "sel", "full")
}  # fmt: skip
V3_CASES.update({
    "deepseek-v3 full uniform recompute, TP=EP=8": (deepseek_v3_flags(AC="full", RECOMPUTE_METHOD="uniform", TP=8, EP=8), WORLD),
    "deepseek-v3 knobs on": (deepseek_v3_flags(MODEL_SIZE="671B", ENABLE_DEEP_EP=True, APPLY_ROPE_FUSION=True, MOE_ROUTER_FUSION=True,
                                               GA_FUSION=True, PROFILE=True, GPT_LAYER_IN_TE=False, MOE_USE_LEGACY_GROUPED_GEMM=False,
                                               FUSED_PADDED_MLA_ATTENTION=True,
                                               CE_FUSION_ARGS="--cross-entropy-fusion-impl te --cross-entropy-loss-fusion"), WORLD),
    "deepseek-v3 shared-expert overlap + force balance": (deepseek_v3_flags(MOE_SHARED_EXPERT_OVERLAP=True, FORCE_BALANCE=True), WORLD),
    "deepseek-v3 671B PP=2 + virtual stages": (deepseek_v3_flags(MODEL_SIZE="671B", NUM_LAYERS=32, PP=2, EP=4, MP_VP=4, GBS=32), WORLD),
    "deepseek-v3 671B proxy, precision-aware optimizer off": (deepseek_v3_flags(
        MODEL_SIZE="671B", NUM_LAYERS=3, MOE_LAYER_FREQ="([0]*1+[1]*2)", MBS=2, GBS=16, TRAIN_ITERS=20, AC="full", APPLY_ROPE_FUSION=True,
        MOE_ROUTER_FUSION=True, MOE_USE_LEGACY_GROUPED_GEMM=False, FORCE_BALANCE=True, GA_FUSION=True, PROFILE=True,
        CE_FUSION_ARGS="--cross-entropy-fusion-impl te --cross-entropy-loss-fusion"), WORLD),
    # The Slurm wrapper's 8 nodes (its TP=2 EP=4 ETP=1 the script itself stops on: TP=1 here).
    "deepseek-v3 671B 8 nodes": (deepseek_v3_flags(MODEL_SIZE="671B", NUM_LAYERS=32, GBS=32, AC="full", TP=1, PP=16, EP=4), 8 * WORLD),
    "deepseek-v3 16B 8 nodes, EP=64": (deepseek_v3_flags(EP=64, GBS=512), 8 * WORLD),
})  # fmt: skip


def _accepted_and_noted_once(flags: str, world: int) -> None:
    argv = shlex.split(flags)
    cfg = build_config(None, argv)
    validate(cfg, world_size=world)
    given = {a.removeprefix("--").split("=")[0] for a in argv if a.startswith("--")}
    noted = {line.split(":")[0].split()[0].removeprefix("--") for line in noted_flag_lines(cfg.logging.noted_flags)}
    assert {f for f in given if f in NOTED_FLAGS} <= noted
    lines = noted_flag_lines(cfg.logging.noted_flags)
    assert len(lines) == len({line.split(":")[0].split()[0] for line in lines}), "a flag is noted twice"


@pytest.mark.parametrize("name", list(CASES))
def test_rocm_script_flags_are_accepted(name):
    _accepted_and_noted_once(CASES[name], WORLD)


@pytest.mark.parametrize("name", list(V3_CASES))
def test_deepseek_v3_script_flags_are_accepted(name):
    _accepted_and_noted_once(*V3_CASES[name])


def test_deepseek_v3_real_data_goes_to_the_per_split_paths(tmp_path):
    """MOCK_DATA=0: one indexed dataset for --train/valid/test-data-path (a tiny one written here)."""
    from meshtron.data.indexed import IndexedDatasetBuilder

    prefix = str(tmp_path / "mmap_deepseekv3_datasets_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin")
    builder.add_document([1, 2, 3, 4])
    builder.finalize(prefix + ".idx")
    cfg = build_config(None, shlex.split(deepseek_v3_flags(MOCK_DATA=0, DATA_DIR=str(tmp_path))))
    validate(cfg, world_size=WORLD)
    assert not cfg.data.mock and cfg.data.train_data_path == cfg.data.valid_data_path == cfg.data.test_data_path
    assert cfg.data.train_data_path in (prefix, [prefix])


def test_deepseek_v3_671b_is_estimated_without_being_built(tmp_path, monkeypatch, capsys):
    """The script's closest thing to a dry run: ``meshtron estimate`` with its flags unchanged sizes the
    671B model from a meta build, in seconds and a few hundred MiB, on 8 GPUs and on the Slurm wrapper's 64.
    Expected count: 671 B (DeepSeek-V3 without MTP) - 1.85 B of embeddings (the cached tokenizer here has
    384 rows, not 129280) + 3 x 10.9 B (the script makes all 61 layers MoE; the model's first 3 are dense)."""
    import re
    import resource

    from huggingface_hub import constants

    from meshtron.cli import main
    from meshtron.data.tokenizers import train_bpe_tokenizer

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = tmp_path / "models--deepseek-ai--DeepSeek-V3" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--deepseek-ai--DeepSeek-V3" / "refs").mkdir()
    (tmp_path / "models--deepseek-ai--DeepSeek-V3" / "refs" / "main").write_text("abc123")
    train_bpe_tokenizer(["cached text, cached merges"] * 20, 400, str(snapshot / "tokenizer.json"))
    assert main(["estimate", "--world-size", str(WORLD), *shlex.split(deepseek_v3_flags(MODEL_SIZE="671B"))]) == 0
    out = capsys.readouterr().out
    assert 700 < float(re.search(r"model: ([\d.]+) B parameters", out).group(1)) < 704 and "256 experts, top-8, 32 per ep rank" in out
    slurm = deepseek_v3_flags(MODEL_SIZE="671B", NUM_LAYERS=32, GBS=32, AC="full", TP=1, PP=16, EP=4)
    assert main(["estimate", "--world-size", str(8 * WORLD), *shlex.split(slurm)]) == 0
    assert "layout: world 64, tp 1, pp 16, cp 1, dp 4, ep 4" in capsys.readouterr().out
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 * 2**20  # KiB: far below the 1.4 TB of bf16 weights


def test_meanings_of_deepseek_v3_flags():
    """The 671B branch gives the preset's router; what Megatron ignores under MLA and sigmoid is accepted as it is there."""
    cfg = build_config(None, shlex.split(deepseek_v3_flags(MODEL_SIZE="671B")))
    m = cfg.model
    assert (m.moe_router_score_function, m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_enable_expert_bias) == ("sigmoid", 8, 4, True)
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (1536, 512, 128, 64, 128)
    assert m.moe_layer_freq == "1" and m.moe_shared_expert_intermediate_size == 2048 and cfg.data.tokenizer_type == "HuggingFaceTokenizer"
    small = build_config(None, shlex.split(deepseek_v3_flags()))
    assert small.model.moe_router_num_groups == 8 and not small.model.moe_router_group_topk  # plain top-k, as in Megatron
    assert small.model.moe_layer_freq == "([0]*3+[1]*24)"
    with pytest.raises(ValueError, match="TP and EP must be equal"):
        deepseek_v3_flags(TP=2, EP=4)

def test_meanings_of_translated_flags():
    cfg = build_config(None, shlex.split(llama3_flags()))
    assert cfg.model.attention_backend == "auto" and cfg.parallel.grad_reduce_in_bf16
    assert cfg.parallel.distributed_timeout_minutes == 120 and cfg.train.optimizer == "adam"
    assert "--overlap-grad-reduce: always on (gradient buckets are reduced during backward)" in noted_flag_lines(cfg.logging.noted_flags)
    assert build_config(None, shlex.split(llama2_flags())).model.attention_backend == "flash"
    deepseek = build_config(None, shlex.split(deepseek_flags(AC="sel")))
    assert deepseek.model.recompute_granularity == "selective" and deepseek.model.extra_vocab_size == 2400
    assert deepseek.model.moe_shared_expert_intermediate_size == 2 * 1408 and deepseek.data.tokenizer_type == "HuggingFaceTokenizer"
    assert deepseek.logging.tensorboard_queue_size == 1 and deepseek.checkpoint.ckpt_format == "torch_dist"


@pytest.mark.parametrize("argv, message", [
    ("--optimizer lion", "--optimizer lion: one of adam"),
    ("--fp8-recipe mxfp8", "MXFP8"),
    ("--train-mode finetune", "with --sft"),
    ("--no-position-embedding", "--position-embedding-type rope"),
    ("--profile", "--tensorboard-dir or --save"),
    ("--mock-data --tokenizer-model tok.json", "--tokenizer-type"),
    ("--rerun-mode validate-results", "--rerun-mode validate-results: not one of Megatron's values (disabled "),
    ("--dataloader-type external", "drop --dataloader-type external"),
    ("--transformer-impl te", "not one of Megatron's values (local "),
    ("--window-size 128,0", "no sliding window"),
    ("--attention-sink-k 4", "no sink keys"),
    ("--profile-ranks 1", "only global rank 0"),
    (deepseek_v3_flags(PR="fp8", FP8_RECIPE="mxfp8"), "MXFP8"),
    (deepseek_v3_flags(PR="fp8", FP8_RECIPE="blockwise"), "use --fp8-format e4m3, not hybrid"),
    (deepseek_v3_flags(USE_PRECISION_AWARE_OPTIMIZER=True), "drop --main-grads-dtype bf16"),
])  # fmt: skip
def test_values_meshtron_cannot_honour_are_refused_with_the_fix(argv, message):
    from meshtron.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(build_config(None, shlex.split(argv)), world_size=1)


def test_wandb_knob_needs_the_package_and_is_accepted_with_it(monkeypatch):
    """WANDB_API_KEY set: the scripts add the three W&B flags; refused with the fix while wandb is
    missing, accepted once it is importable (a stand-in module here)."""
    import importlib.machinery
    import sys
    import types

    from meshtron.errors import ConfigError

    argv = shlex.split(llama3_flags(WANDB=True))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="pip install wandb"):
        validate(build_config(None, argv), world_size=WORLD)
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = build_config(None, argv)
    validate(cfg, world_size=WORLD)
    assert (cfg.logging.wandb_project, cfg.logging.wandb_exp_name, cfg.logging.wandb_save_dir) == ("LLama", "LLama_70B", "logs/wandb")
