"""Write Megatron BERT and T5 test checkpoints with Megatron-LM's own ``save_checkpoint``, on the CPU.

Run with the Python that runs ``make_checkpoints.py`` (Megatron-Core 0.19.2); from the repository root::

    /work/venv-megatron/bin/python tests/data/megatron/make_encoder_checkpoints.py [NAME ...]

Each case is built as Megatron's ``pretrain_bert.py`` / ``pretrain_t5.py`` build theirs: Megatron-Core's
``BertModel`` (local layer spec, ``bert_layer_local_spec``) or ``T5Model`` (its local encoder and
decoder block specs), from Megatron's parsed args, in ``tp`` gloo processes, weights drawn as
``make_checkpoints.py`` draws them (non-uniform attention). Megatron-Core's local T5 block specs
name Transformer Engine's ``TENorm`` as each stack's final norm, which is None where Transformer
Engine is missing (the CPU): the stacks would lose their final norms, which T5 on a GPU has; the
generator puts the local spec's LayerNorm there (the same ``final_layernorm`` weight and bias). ``reference.pt`` holds the fixed inputs and
Megatron's own outputs of them, gathered over tp: BERT's masked-LM logits (and the sentence-order
logits with the binary head) for tokens whose second sequence ends in padding, with token types;
T5's decoder logits for encoder and decoder tokens, the encoder's last positions padding.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from make_checkpoints import HERE, ITERATION, VOCAB, _cpu_cuda_rng, _fill

SEQ, DECODER_SEQ, PADDED = 16, 8, 4  # encoder / BERT length, T5 decoder length, padding at the second sequence's end
BODY = ["--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64", "--normalization", "LayerNorm",
        "--position-embedding-type", "learned_absolute"]  # fmt: skip
BERT = ["--num-layers", "2", *BODY]
T5 = ["--encoder-num-layers", "2", "--decoder-num-layers", "2", *BODY]
# name: (family, flags, tp, ckpt format)
CASES = {
    "bert_tp1_dist": ("bert", BERT, 1, "torch_dist"),
    "bert_tp2_torch": ("bert", [*BERT, "--bert-no-binary-head"], 2, "torch"),
    "t5_tp1_dist": ("t5", T5, 1, "torch_dist"),
    "t5_tp2_torch": ("t5", T5, 2, "torch"),
}


def _tokens(length: int, shift: int) -> torch.Tensor:
    return torch.tensor([[(7 * i * i + 3 * i + shift) % VOCAB for i in range(length)], [(5 * i + 11 + shift) % VOCAB for i in range(length)]])


def _padding_mask(length: int) -> torch.Tensor:
    """[b, s], 1 at real tokens: the second sequence ends in PADDED padding positions."""
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, -PADDED:] = 0
    return mask


def _types() -> torch.Tensor:
    return (torch.arange(SEQ) >= SEQ // 2).long().unsqueeze(0).expand(2, SEQ).contiguous()


def _build(family: str, args, config, mpu):
    if family == "bert":
        from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
        from megatron.core.models.bert.bert_model import BertModel

        return BertModel(config=config, num_tokentypes=2 if args.bert_binary_head else 0, transformer_layer_spec=bert_layer_local_spec,
                         vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=True, post_process=True, parallel_output=False,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         position_embedding_type=args.position_embedding_type, add_binary_head=args.bert_binary_head)  # fmt: skip
    from copy import deepcopy

    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_spec import (
        LNImpl,
        get_t5_decoder_with_local_block_spec,
        get_t5_encoder_with_local_block_spec,
    )

    encoder_config = deepcopy(config)
    encoder_config.num_layers = args.encoder_num_layers
    encoder, decoder = get_t5_encoder_with_local_block_spec(args.encoder_num_layers), get_t5_decoder_with_local_block_spec(args.decoder_num_layers)
    for spec in (encoder, decoder):  # each stack's final norm: Transformer Engine's TENorm, None without it; the local norm here
        spec.layer_norm = LNImpl
    return T5Model(config=config, encoder_config=encoder_config, transformer_encoder_layer_spec=encoder, transformer_decoder_layer_spec=decoder,
                   vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=True, post_process=True, parallel_output=False,
                   share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                   position_embedding_type=args.position_embedding_type)  # fmt: skip


def _forward(family: str, model) -> dict[str, torch.Tensor]:
    """Megatron's outputs of the fixed inputs, and the inputs."""
    model.eval()
    with torch.no_grad():
        if family == "bert":
            tokens, mask = _tokens(SEQ, 1), _padding_mask(SEQ)
            types = _types() if model.add_binary_head else None
            logits, sop = model(tokens, mask, tokentype_ids=types)
            out = {"tokens": tokens, "padding_mask": mask.bool(), "logits": logits.float()}
            if types is not None:
                out.update(types=types, sop=sop.float())
            return out
        encoder, decoder, mask = _tokens(SEQ, 1), _tokens(DECODER_SEQ, 4), _padding_mask(SEQ).bool()
        masked_keys = ~mask[:, None, None, :]  # Megatron's masks: True where attention is cut
        causal = torch.triu(torch.ones(1, 1, DECODER_SEQ, DECODER_SEQ, dtype=torch.bool), diagonal=1)
        logits = model(encoder, decoder, masked_keys.expand(2, 1, SEQ, SEQ), causal.expand(2, 1, DECODER_SEQ, DECODER_SEQ),
                       masked_keys.expand(2, 1, DECODER_SEQ, SEQ))  # fmt: skip
        return {"encoder_tokens": encoder, "decoder_tokens": decoder, "encoder_padding_mask": mask, "logits": logits.float()}


def _run(rank: int, name: str, world: int, port: int) -> None:
    family, flags, tp, fmt = CASES[name]
    _cpu_cuda_rng()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.training import global_vars
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import save_checkpoint

    out = HERE / name
    sys.argv = [f"pretrain_{family}.py", *flags, "--tensor-model-parallel-size", str(tp), "--seq-length", str(SEQ),
                "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "10",
                "--lr", "1e-4", "--save-interval", "7", "--save", str(out), "--ckpt-format", fmt, "--use-cpu-initialization",
                "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                "--no-bias-dropout-fusion", "--transformer-impl", "local", "--distributed-backend", "gloo", "--attention-dropout", "0",
                "--hidden-dropout", "0", "--vocab-size", str(VOCAB), "--tokenizer-type", "NullTokenizer",
                "--make-vocab-size-divisible-by", "16", "--seed", "5", "--no-save-rng"]  # fmt: skip
    if family == "t5":
        sys.argv += ["--decoder-seq-length", str(DECODER_SEQ)]
    args = parse_args()
    validate_args(args)
    args.padded_vocab_size = VOCAB
    args.consumed_train_samples = 112
    global_vars.set_args(args)
    global_vars._set_timers(args)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mpu.initialize_model_parallel(tp, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    model = _build(family, args, core_transformer_config_from_args(args), mpu)
    _fill(model, mpu)
    reference = _forward(family, model)
    save_checkpoint(ITERATION, [model], None, None, 0)
    if mpu.get_tensor_model_parallel_rank() == 0:
        torch.save(reference, out / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import shutil

    for case in sys.argv[1:] or list(CASES):
        shutil.rmtree(HERE / case, ignore_errors=True)
        world = CASES[case][2]
        mp.spawn(_run, args=(case, world, 28000 + sum(map(ord, case)) % 400), nprocs=world, join=True)
        print(f"wrote {HERE / case}")
