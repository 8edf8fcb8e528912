"""Write the Megatron test checkpoints with Megatron-LM's own ``save_checkpoint``, on the CPU.

Run with a Python that has ``megatron-core`` (0.19.2 here: its wheel carries ``megatron/training``)
and torch; from the repository root::

    /work/venv-megatron/bin/python tests/data/megatron/make_checkpoints.py [NAME ...]

Each case is a tiny GPT built by Megatron-Core's ``GPTModel`` with the local layer spec (no
Transformer Engine), run by ``world = tp x pp x ep`` gloo processes. Weights are drawn with a spread
of 1/sqrt(fan-in) (norm weights 1 +- 0.3), so attention is far from uniform and a q/k, rope or
head-order mistake changes the logits. Each case directory holds the checkpoint Megatron saved
(``iter_0000007/`` + tracker) and ``reference.pt``: fixed tokens and Megatron's own logits of
them, gathered over tp and taken from the last pipeline stage.

The ``TRAINED`` cases (one process, fp32 and bf16) are trained instead: Megatron's DDP wrapper,
optimizer (Adam, bf16 with fp32 main params) and scheduler, built from the args as its training
loop builds them, take ITERATION steps on the fixed tokens; the save carries the optimizer's
model-space state; ``reference.pt`` holds the losses of CONTINUED more steps, which a run resumed
from the import must reproduce (``tests/unit/test_megatron_optim.py``). Megatron's optimizer and
DDP make a few tensors on ``device='cuda'`` and check CUDA type names, so those runs also get the
CPU stand-ins of ``_cpu_factories``.

``--check-export CASE DIR [TP PP EP]`` loads ``DIR`` (``meshtron convert megatron-export`` of
CASE's import, either format) with Megatron-LM's ``load_checkpoint`` in ``TP x PP x EP`` processes
(default 1 1 1; a legacy export loads only under the layout it was written for), checks that the
model took it strictly (Megatron falls back to ``strict=False`` when a strict load fails, so the
fallback is caught here), writes Megatron's logits to ``DIR/megatron_logits.pt`` and prints how
far they are from CASE's reference (``tests/unit/test_megatron_export.py`` runs it).

CPU-only torch has no CUDA RNG; Megatron's RNG tracker and ``save_checkpoint`` ask for one, so
``torch.cuda.get_rng_state``/``set_rng_state`` are given a CPU stand-in here, and
``torch.cuda.current_device`` answers the CPU, ``torch.cuda.synchronize`` does nothing and
``torch.cuda.get_device_properties`` describes an arch 10 GPU (argument checks ask for it) (the saved
``cuda_rng_state`` is then a CPU generator's state, with the same type and shape as on a GPU).
"""

from __future__ import annotations

import os
import shutil
import sys
from types import SimpleNamespace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
VOCAB, SEQ, ITERATION, CONSUMED = 96, 16, 7, 112

DENSE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "48", "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
         "--position-embedding-type", "rope", "--rotary-base", "10000", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--group-query-attention"]  # fmt: skip
DENSE4 = ["--num-layers", "4", *DENSE[2:]]
GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
       "--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute"]  # fmt: skip
MOE = [*DENSE, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
       "--moe-shared-expert-intermediate-size", "16", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-token-dispatcher-type", "allgather", "--moe-aux-loss-coeff", "0.01"]  # fmt: skip

# DeepSeek-V2's latent attention (local spec; Megatron forbids --group-query-attention with it).
# --kv-channels = v_head_dim: the local DotProductAttention sizes its output by kv_channels.
MLA = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "16", "--swiglu",
       "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--disable-bias-linear", "--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8",
       "--v-head-dim", "8", "--kv-channels", "8"]  # fmt: skip
# a low-rank query with the latent norms, YaRN (Megatron's MLA default rope type) stretched 4x
# with both temperatures set; and a full query projection with plain RoPE, no position type
MLA_YARN = [*MLA, "--position-embedding-type", "rope", "--q-lora-rank", "12", "--qk-layernorm", "--rope-type", "yarn",
            "--rotary-scaling-factor", "4", "--mscale", "0.8", "--mscale-all-dim", "0.6"]  # fmt: skip
MLA_ROPE = [*MLA, "--position-embedding-type", "none", "--rope-type", "rope", "--rotary-base", "500"]

SMALL = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2", "--num-query-groups", "1", "--ffn-hidden-size", "16", *DENSE[10:]]
# Trained cases: Adam for ITERATION steps on the fixed tokens, saved with the optimizer, then
# CONTINUED more steps whose losses are the reference a resumed run must reproduce.
ADAM = ["--lr", "1e-2", "--lr-decay-style", "constant", "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0"]
CONTINUED = 3
NO_RNG = ["--no-save-rng"]  # RNG states are 35 KB a rank: two cases keep them (NumPy's state read safely), the rest stay small
# name: (model flags, tp, pp, ep, ckpt format)
CASES = {
    "llama_tp1_dist": (DENSE, 1, 1, 1, "torch_dist"),
    "llama_tp2_dist": (DENSE + NO_RNG, 2, 1, 1, "torch_dist"),
    "llama_tp2pp2_torch": (DENSE4, 2, 2, 1, "torch"),
    "llama_pp2_dist": (DENSE4 + NO_RNG, 1, 2, 1, "torch_dist"),
    "gpt_tp2_torch": (GPT + NO_RNG, 2, 1, 1, "torch"),
    "moe_ep2_dist": (MOE + NO_RNG, 1, 1, 2, "torch_dist"),
    "moe_ep2_torch": (MOE + NO_RNG, 1, 1, 2, "torch"),
    "mla_yarn_dist": (MLA_YARN + NO_RNG, 1, 1, 1, "torch_dist"),
    "mla_tp2_torch": (MLA_ROPE + NO_RNG, 2, 1, 1, "torch"),
    "llama_adam_dist": (SMALL + NO_RNG, 1, 1, 1, "torch_dist"),
    "llama_adam_bf16_dist": (SMALL + NO_RNG + ["--bf16"], 1, 1, 1, "torch_dist"),
    "llama_adam_tp2_torch": (SMALL + NO_RNG, 2, 1, 1, "torch"),
    "llama_adam_bf16_torch": (SMALL + NO_RNG + ["--bf16"], 1, 1, 1, "torch"),
}
TRAINED = ("llama_adam_dist", "llama_adam_bf16_dist", "llama_adam_tp2_torch", "llama_adam_bf16_torch")


def _cpu_cuda_rng() -> None:
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": None
    torch.cuda.current_device = lambda: torch.device("cpu")  # where RoPE's table and a few buffers are put
    torch.cuda.synchronize = lambda device=None: None  # the save's staging waits for a GPU
    torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(major=10, minor=0)  # tp > 1 asks for the GPU's arch


def _cpu_factories() -> None:
    """Megatron's optimizer, gradient clipping and DDP buffers make small tensors with
    ``device='cuda'`` written out; here those go to the CPU (``Tensor.cuda`` stays put)."""
    def on_cpu(factory):
        def make(*args, device=None, **kwargs):
            return factory(*args, device="cpu" if device is not None and "cuda" in str(device) else device, **kwargs)
        return make

    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # its checks of gradients and params compare ``Tensor.type()`` with the CUDA type names
    plain_type = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **k: plain_type(self, *a, **k) if a or k else plain_type(self).replace("torch.", "torch.cuda.", 1)
    # the gradient reduction waits on the current stream for CUDA-graph events (there are none)
    torch.cuda.current_stream = lambda device=None: SimpleNamespace(wait_event=lambda event: None, wait_stream=lambda stream: None)


def _mla_core_attention(spec) -> None:
    """Megatron-Core 0.19.2's MLA hands its core attention ``k_channels``/``v_channels``, which the
    local spec's ``DotProductAttention`` does not take (TypeError: Transformer Engine's does): this
    stand-in drops them and runs Megatron's own DotProductAttention, whose product already takes
    qk dims unlike v dims (its output width is ``kv_channels`` x heads, so the cases set
    ``--kv-channels`` = ``--v-head-dim``). Nothing else about MLA needs a GPU."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLACoreAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    spec.submodules.self_attention.submodules.core_attention = LocalMLACoreAttention


def _fill(model: torch.nn.Module, mpu) -> None:
    """Weights with a spread that makes attention non-uniform. A tensor-parallel shard is drawn per
    tp rank, a tensor every tp rank holds whole (norms, router, row-parallel biases) the same on
    each, as Megatron's own init keeps them; expert shards per expert-parallel rank; data-parallel
    replicas alike. Each checkpoint is its own model; Megatron's logits of it are the reference."""
    stage = 100 * mpu.get_pipeline_model_parallel_rank()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for index, (name, p) in enumerate(model.named_parameters()):
            seed = stage + 7 * index + (1000 * tp_rank if getattr(p, "tensor_model_parallel", False) else 0)
            if ".experts." in name and "shared" not in name:
                seed += 10_000 * (1 + mpu.get_expert_model_parallel_rank())
            gen = torch.Generator().manual_seed(seed)
            if p.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5 * (2.0 if "embedding" in name else 1.0))


def _run(rank: int, name: str, world: int, port: int, load: tuple[str, tuple[int, int, int]] | None = None) -> None:
    """Save case ``name``; with ``load`` (a meshtron export of it and the tp, pp, ep to load it
    under), load that with Megatron-LM's ``load_checkpoint`` (strict) instead and keep its logits."""
    flags, tp, pp, ep, fmt = CASES[name]
    if load:
        load, (tp, pp, ep) = load
        fmt = "torch_dist" if (Path(load) / f"iter_{ITERATION:07d}" / ".metadata").is_file() else "torch"
    _cpu_cuda_rng()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import global_vars
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint

    out = HERE / name
    sys.argv = ["pretrain_gpt.py", *flags, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                "--expert-model-parallel-size", str(ep), "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
                "--micro-batch-size", "1", "--global-batch-size", str(16 * world // (tp * pp)), "--train-iters", "10", "--lr", "1e-4", "--save-interval", "7",
                "--save", str(out), "--ckpt-format", fmt, "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
                "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
                "--no-bias-dropout-fusion", "--no-rope-fusion", "--transformer-impl", "local", "--distributed-backend", "gloo",
                "--attention-dropout", "0", "--hidden-dropout", "0", "--vocab-size", str(VOCAB), "--tokenizer-type", "NullTokenizer",
                "--make-vocab-size-divisible-by", "16", "--seed", "5"]  # fmt: skip
    if load:
        sys.argv += ["--load", load, "--no-load-optim", "--no-load-rng"]
    if name in TRAINED:
        sys.argv += ADAM
    args = parse_args()
    validate_args(args)
    args.padded_vocab_size = VOCAB
    args.consumed_train_samples = CONSUMED
    global_vars.set_args(args)
    global_vars._set_timers(args)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mpu.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    config = core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, qk_layernorm=args.qk_layernorm,
                                    multi_latent_attention=args.multi_latent_attention, normalization=args.normalization)
    if args.multi_latent_attention:
        _mla_core_attention(spec)
    model = GPTModel(config, spec, VOCAB, SEQ, pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
                     parallel_output=False, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base)  # fmt: skip
    if load:
        import megatron.training.checkpointing as checkpointing
        from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

        # load_checkpoint updates the micro-batch count from the consumed samples it reads
        init_num_microbatches_calculator(rank, None, args.global_batch_size, args.micro_batch_size, args.data_parallel_size, False)

        # Its tracker reader all-reduces the iteration in a CUDA tensor; the same reading on the CPU:
        checkpointing.read_metadata = lambda tracker: (int(Path(tracker).read_text()), False)
        calls = []
        strict_load = model.load_state_dict
        model.load_state_dict = lambda state, strict=True: calls.append(strict) or strict_load(state, strict=strict)
        load_checkpoint([model], None, None, strict=True)
        if calls != [True]:
            raise RuntimeError(f"Megatron-LM's strict load of {load} failed and fell back to strict=False ({calls})")
        logits = _forward(model, mpu)
        if logits is not None and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
            torch.save(logits, Path(load) / "megatron_logits.pt")
            reference = torch.load(out / "reference.pt")["logits"]
            print(f"{name}: Megatron-LM's logits of the export differ from the reference by {(logits - reference).abs().max():.3g}")
        dist.barrier()
        dist.destroy_process_group()
        return
    _fill(model, mpu)
    if name in TRAINED:
        _train_and_save(model, config, args, out)
        dist.barrier()
        dist.destroy_process_group()
        return
    logits = _forward(model, mpu)
    save_checkpoint(ITERATION, [model], None, None, 0)
    if logits is not None and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
        torch.save({"tokens": _tokens(), "logits": logits}, out / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()


def _train_and_save(model, config, args, out: Path) -> None:
    """One process: Megatron's DDP wrapper, optimizer and scheduler as its training loop builds them
    from ``args`` (bf16: Float16Module and fp32 main params); ITERATION steps on the fixed tokens,
    a save with the optimizer, then CONTINUED more steps. ``reference.pt`` keeps ``losses``: the
    loss before each continued step and after the last (no logits: the first loss is the saved
    weights' forward, and the files stay small)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config, get_optimizer_param_scheduler

    _cpu_factories()
    if args.bf16:
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config=config, ddp_config=get_megatron_ddp_config(args), module=model)
    opt_config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(opt_config, [ddp], overrides)
    scheduler = get_optimizer_param_scheduler(optimizer)

    def step() -> float:
        ddp.train()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = _loss(ddp)
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        scheduler.step(increment=args.global_batch_size)
        return loss.item()

    for _ in range(ITERATION):
        step()
    save_checkpoint(ITERATION, [ddp], optimizer, scheduler, 0)
    losses = [step() for _ in range(CONTINUED)]
    with torch.no_grad():
        losses.append(_loss(ddp).item())
    torch.save({"tokens": _tokens(), "losses": torch.tensor(losses, dtype=torch.float64)}, out / "reference.pt")


def _loss(model) -> torch.Tensor:
    """Next-token cross entropy of ``_tokens()``, the mean over its positions."""
    tokens = _tokens()
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    logits = model(tokens, positions, mask).float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _tokens() -> torch.Tensor:
    return torch.tensor([[(7 * i * i + 3 * i + 1) % VOCAB for i in range(SEQ)], [(5 * i + 11) % VOCAB for i in range(SEQ)]])


def _forward(model, mpu) -> torch.Tensor | None:
    """Megatron's logits of ``_tokens()`` (last stage only); stages hand activations on by send/recv."""
    tokens = _tokens()
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    model.eval()
    with torch.no_grad():
        if not mpu.is_pipeline_first_stage():
            hidden = torch.empty(s, b, model.config.hidden_size)
            dist.recv(hidden, src=mpu.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, positions, mask)
        if not mpu.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())
            return None
    return out.float()


def make(name: str) -> None:
    flags, tp, pp, ep, fmt = CASES[name]
    shutil.rmtree(HERE / name, ignore_errors=True)
    world = tp * pp * ep  # ep ranks are data-parallel ranks of the dense part
    mp.spawn(_run, args=(name, world, 29500 + sum(map(ord, name)) % 400), nprocs=world, join=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check-export"]:  # --check-export CASE DIR [TP PP EP]: DIR is `meshtron convert megatron-export` of CASE
        layout = tuple(int(n) for n in sys.argv[4:7]) or (1, 1, 1)
        world = layout[0] * layout[1] * layout[2]
        port = 20000 + os.getpid() % 20000  # concurrent checks on one machine get their own ports
        mp.spawn(_run, args=(sys.argv[2], world, port, (str(Path(sys.argv[3]).resolve()), layout)), nprocs=world, join=True)
        sys.exit(0)
    for case in sys.argv[1:] or list(CASES):
        make(case)
        print(f"wrote {HERE / case}")
