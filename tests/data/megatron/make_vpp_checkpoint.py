"""Write a legacy Megatron checkpoint with virtual pipeline stages, with Megatron-LM's own ``save_checkpoint``, on the CPU.

Run with the Python that runs ``make_checkpoints.py`` (Megatron-Core 0.19.2); from the repository root::

    /work/venv-megatron/bin/python tests/data/megatron/make_vpp_checkpoint.py [NAME ...]

``llama_pp2vpp2_torch``: ``make_checkpoints.py``'s 4-layer Llama (GQA, SwiGLU, RMSNorm, RoPE, untied)
under pp 2 with ``--num-layers-per-virtual-pipeline-stage 1``: each of the 2 ranks builds two
``GPTModel`` chunks (``vp_stage`` 0 and 1) as Megatron's ``get_model`` does, so rank p holds layers p
and p + 2, and ``save_checkpoint`` writes them as ``model0`` / ``model1`` in each rank's
``model_optim_rng.pt``. Weights are drawn as ``make_checkpoints.py`` draws them, then chunk 1's are
moved by its own noise, so the two chunks of a rank differ and a chunk-order mistake shows.
``reference.pt``: Megatron's logits of the fixed tokens, the activations passed chunk by chunk in
the model's order (rank 0 chunk 0, rank 1 chunk 0, rank 0 chunk 1, rank 1 chunk 1).

``llama_adam_pp2vpp2_torch``: a smaller model of the same layout saved with Megatron's optimizer
(Adam, fp32, no clipping), built over both chunks as its training loop builds it (one DDP wrapper per chunk,
``get_megatron_optimizer`` over the chunk list, so its param groups run through chunk 0's params,
then chunk 1's). It takes one step whose gradient is each parameter's own value (``main_grad`` set
by hand: no pipeline schedule runs on the CPU), which ties every saved moment to its parameter:
after the step, exp_avg = (1 - beta1) p0, exp_avg_sq = (1 - beta2) p0^2 and the saved weight is
p0 (1 - lr wd) - lr p0 / (|p0| + eps), with wd 0 for biases and 1-D params
(``tests/unit/test_megatron_optim.py`` checks those relations on the import). No reference.pt.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from make_checkpoints import ADAM, DENSE, DENSE4, HERE, ITERATION, NO_RNG, SEQ, VOCAB, _cpu_cuda_rng, _cpu_factories, _fill, _tokens

PP, VPP = 2, 2
SMALL4 = ["--num-layers", "4", "--hidden-size", "8", "--num-attention-heads", "2", "--num-query-groups", "1", "--ffn-hidden-size", "16", *DENSE[10:]]
CASES = {"llama_pp2vpp2_torch": (DENSE4, False), "llama_adam_pp2vpp2_torch": (SMALL4 + ADAM + ["--clip-grad", "0"], True)}  # name: (model flags, one Adam step)


def _run(rank: int, name: str, port: int) -> None:
    _cpu_cuda_rng()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(PP), LOCAL_RANK=str(rank))
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import global_vars
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import save_checkpoint

    out, (flags, stepped) = HERE / name, CASES[name]
    sys.argv = ["pretrain_gpt.py", *NO_RNG, "--pipeline-model-parallel-size", str(PP), "--num-layers-per-virtual-pipeline-stage", "1",
                "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "16",
                "--train-iters", "10", "--lr", "1e-4", "--save-interval", "7", "--save", str(out), "--ckpt-format", "torch",
                "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
                "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--transformer-impl",
                "local", "--distributed-backend", "gloo", "--attention-dropout", "0", "--hidden-dropout", "0", "--vocab-size", str(VOCAB),
                "--tokenizer-type", "NullTokenizer", "--make-vocab-size-divisible-by", "16", "--seed", "5", *flags]  # fmt: skip
    args = parse_args()
    validate_args(args)
    assert args.virtual_pipeline_model_parallel_size == VPP, args.virtual_pipeline_model_parallel_size
    args.padded_vocab_size = VOCAB
    args.consumed_train_samples = 112
    global_vars.set_args(args)
    global_vars._set_timers(args)
    dist.init_process_group("gloo", rank=rank, world_size=PP)
    mpu.initialize_model_parallel(1, PP, virtual_pipeline_model_parallel_size=VPP)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    config = core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(normalization=args.normalization)
    chunks = []
    for v in range(VPP):
        first, last = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v), mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v)
        chunk = GPTModel(config, spec, VOCAB, SEQ, pre_process=first, post_process=last, parallel_output=False,
                         share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_base=args.rotary_base, vp_stage=v)  # fmt: skip
        _fill(chunk, mpu)
        with torch.no_grad():  # chunk v's own weights: _fill draws by pipeline rank and parameter index only
            for index, p in enumerate(chunk.parameters()):
                p.add_(0.3 * v * torch.randn(p.shape, generator=torch.Generator().manual_seed(500 + 100 * rank + index)))
        chunks.append(chunk)
    if stepped:
        _step_and_save(chunks, config, args)
        dist.barrier()
        dist.destroy_process_group()
        return
    logits = _forward(chunks, mpu)
    save_checkpoint(ITERATION, chunks, None, None, 0)
    if logits is not None:
        torch.save({"tokens": _tokens(), "logits": logits}, out / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()


def _step_and_save(chunks, config, args) -> None:
    """Megatron's optimizer over both chunks takes one step with each parameter as its own gradient; saved with it."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config, get_optimizer_param_scheduler

    _cpu_factories()
    ddp = [DistributedDataParallel(config=config, ddp_config=get_megatron_ddp_config(args), module=chunk) for chunk in chunks]
    opt_config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(opt_config, ddp, overrides)
    scheduler = get_optimizer_param_scheduler(optimizer)
    for chunk in ddp:
        chunk.zero_grad_buffer()
        for p in chunk.parameters():
            p.main_grad.copy_(p.detach())
    optimizer.step()
    save_checkpoint(ITERATION, ddp, optimizer, scheduler, 0)


def _forward(chunks, mpu) -> torch.Tensor | None:
    """Megatron's logits of ``_tokens()`` (the last rank's last chunk); each chunk's output goes to the next rank."""
    tokens = _tokens()
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    rank, out = mpu.get_pipeline_model_parallel_rank(), None
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            chunk.eval()
            if not (rank == 0 and v == 0):
                hidden = torch.empty(s, b, chunk.config.hidden_size)
                dist.recv(hidden, src=(rank - 1) % PP)
                chunk.set_input_tensor(hidden)
            out = chunk(tokens, positions, mask)
            if not (rank == PP - 1 and v == VPP - 1):
                dist.send(out.contiguous(), dst=(rank + 1) % PP)
                out = None
    return None if out is None else out.float()


if __name__ == "__main__":
    for case in sys.argv[1:] or list(CASES):
        shutil.rmtree(HERE / case, ignore_errors=True)
        mp.spawn(_run, args=(case, 29000 + os.getpid() % 500), nprocs=PP, join=True)
        print(f"wrote {HERE / case}")
