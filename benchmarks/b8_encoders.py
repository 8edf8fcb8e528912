"""B8: encoder and encoder-decoder training throughput, meshtron against Hugging Face in one command.

    python benchmarks/b8_encoders.py [--model bert|t5|both] [--steps 10] [--warmup 3]
        [--micro-batch-size 32] [--seq-length 512] [--dropout 0.1] [--sides meshtron,meshtron-unfused,hf] [--tiny]
        [-- extra meshtron flags]

One training step = forward + backward + optimizer step, dropout 0.1 on both sides, micro batch 32.

* ``bert``: BERT-large (24 layers, hidden 1024, 16 heads, FFN 4096, vocabulary 30522), sequence
  512, masked-LM loss over 15 % of positions. Both sides are post-LN BERT without the
  next-sentence head, so they compute the same function. meshtron pads its vocabulary to a
  multiple of 128 (30592) as it trains it.
* ``t5``: T5-base's shape (12 + 12 layers, hidden 768, 12 heads of 64, FFN 3072, vocabulary
  32128), encoder 512 / decoder 128 tokens, the decoder's cross-entropy over every target. meshtron
  is Megatron's T5 (learned absolute positions, LayerNorm, GELU, biases, tied LM head with a bias);
  HF's ``T5ForConditionalGeneration`` is T5 v1.0 (relative position buckets, RMSNorm, ReLU): the
  same shape and work per token, not the same function. Tokens count encoder + decoder (640 a sample).

The sides: ``meshtron`` is the trainer's own step (``Trainer.train_step``, ``--bf16``: bf16
weights, fp32 master weights and gradients, fused kernels, SDPA backend ``auto``); it starts on
``--mock-data`` (random masked sentences: no corpus, no tokenizer, no NLTK), but the timed steps
get the same random batches as HF, swapped in for its data iterator. ``meshtron-fused`` adds the opt-in bias + GELU and
dropout + add kernels (``--bias-gelu-fusion --bias-dropout-fusion``). ``meshtron-unfused`` is the step with the eager
fusions off (``--no-bias-gelu-fusion --no-bias-dropout-fusion --no-cross-entropy-loss-fusion``:
GELU, dropout and residual add as separate PyTorch ops, BERT's LM head through full logits of its
labelled rows): what they are worth, in its own row against HF. ``hf`` is the transformers model with SDPA attention, fp32
weights under ``torch.autocast(bf16)`` and ``torch.optim.AdamW(fused=True)``. No sequence is
padded, so neither side passes an attention mask. Each side of each model runs in its own process
(clean peak memory); warm-up steps are not timed. The table has a row per model: tokens/s of
each side, their ratio, TFLOP/s (meshtron's FLOP count for both), peak memory and the loss.
Each meshtron side gets a row (``bert``, ``bert unfused``). A side that fails fails the command. ``--tiny``: 2-layer (T5: 2 + 2), 64-wide models at sequence
32 (T5's decoder 16) that run on the CPU in fp32, a smoke test of the script, no timing worth reading.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from child import report, run_child  # benchmarks/child.py: the child-process protocol

MASKED_FRACTION = 0.15
# meshtron's sides: the flags each adds to the common ones.
MESHTRON_SIDES = {"meshtron": [], "meshtron-unfused": ["--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-cross-entropy-loss-fusion"],
                  "meshtron-fused": ["--bias-gelu-fusion", "--bias-dropout-fusion"]}  # fmt: skip
TINY = dict(layers=2, hidden=64, heads=4, ffn=256, vocab=4224, seq=32, batch=2)


def bert_flags(shape: dict) -> list[str]:
    return ["--model-type", "bert", "--apply-residual-connection-post-layernorm", "--bert-no-binary-head", "--norm-epsilon", "1e-12"]


def t5_flags(shape: dict) -> list[str]:
    return ["--model-type", "t5", "--kv-channels", str(shape["hidden"] // shape["heads"]), "--vocab-extra-ids", "100",
            "--decoder-seq-length", str(shape["dec"])]  # fmt: skip


def bert_batch(shape: dict, device: torch.device, gen: torch.Generator) -> dict:
    """Random tokens, 15 % of positions labelled (-100 elsewhere)."""
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device, generator=gen)
    masked = torch.rand(tokens.shape, device=device, generator=gen) < MASKED_FRACTION
    return {"tokens": tokens, "labels": torch.where(masked, tokens, -100), "loss_mask": masked.float()}


def t5_batch(shape: dict, device: torch.device, gen: torch.Generator) -> dict:
    """Random encoder and decoder tokens, every decoder position a target."""
    b, vocab = shape["batch"], shape["vocab"]
    labels = torch.randint(0, vocab, (b, shape["dec"]), device=device, generator=gen)
    return {
        "encoder_tokens": torch.randint(0, vocab, (b, shape["seq"]), device=device, generator=gen),
        "decoder_tokens": torch.randint(0, vocab, (b, shape["dec"]), device=device, generator=gen),
        "labels": labels,
        "loss_mask": torch.ones(b, shape["dec"], device=device),
    }


def hf_bert(shape: dict, dropout: float) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        intermediate_size=shape["ffn"], max_position_embeddings=shape["seq"], hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return BertForMaskedLM(cfg)


def hf_t5(shape: dict, dropout: float) -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=shape["vocab"], d_model=shape["hidden"], d_kv=shape["hidden"] // shape["heads"], d_ff=shape["ffn"],
        num_layers=shape["layers"], num_decoder_layers=shape["layers"], num_heads=shape["heads"], dropout_rate=dropout,
        tie_word_embeddings=True,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return T5ForConditionalGeneration(cfg)


def hf_bert_loss(model, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["tokens"], labels=batch["labels"]).loss


def hf_t5_loss(model, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["encoder_tokens"], decoder_input_ids=batch["decoder_tokens"], labels=batch["labels"]).loss


@dataclass(frozen=True)
class Benchmarked:
    """What differs between the models: shape (``dec`` 0 without a decoder), meshtron's model flags,
    a batch, the HF model and its loss."""

    shape: dict
    tiny_shape: dict
    meshtron_flags: Callable[[dict], list[str]]
    batch: Callable[[dict, torch.device, torch.Generator], dict]
    hf_model: Callable[[dict, float], torch.nn.Module]
    hf_loss: Callable[[torch.nn.Module, dict], torch.Tensor]


MODELS = {
    "bert": Benchmarked(dict(layers=24, hidden=1024, heads=16, ffn=4096, vocab=30522, seq=512, dec=0, batch=32),
                        dict(TINY, dec=0), bert_flags, bert_batch, hf_bert, hf_bert_loss),
    "t5": Benchmarked(dict(layers=12, hidden=768, heads=12, ffn=3072, vocab=32128, seq=512, dec=128, batch=32),
                      dict(TINY, dec=16), t5_flags, t5_batch, hf_t5, hf_t5_loss),
}  # fmt: skip


def shape_of(model: str, args) -> dict:
    shape = dict(MODELS[model].tiny_shape if args.tiny else MODELS[model].shape)
    shape["seq"] = args.seq_length or shape["seq"]
    shape["batch"] = args.micro_batch_size or shape["batch"]
    return shape


def device_of(args) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not args.tiny:
        raise SystemExit("b8_encoders needs a GPU; --tiny runs on the CPU")
    return torch.device("cpu")


def seconds_per_step(step, warmup: int, steps: int, device: torch.device) -> list[float]:
    """Host-clock seconds of each step after warm-up, the device synchronized around each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def random_batches(model: str, shape: dict, device: torch.device):
    """Endless random batches of ``model``, the same sequence on both sides (seed 0)."""
    gen = torch.Generator(device=device).manual_seed(0)
    while True:
        yield MODELS[model].batch(shape, device, gen)


def meshtron_overrides(model: str, args, shape: dict, device: torch.device, side: str = "meshtron") -> list[str]:
    return MODELS[model].meshtron_flags(shape) + [
        "--mock-data", "--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]), "--num-attention-heads", str(shape["heads"]),
        "--ffn-hidden-size", str(shape["ffn"]), "--vocab-size", str(shape["vocab"]),
        "--seq-length", str(shape["seq"]), "--max-position-embeddings", str(shape["seq"]),
        "--hidden-dropout", str(args.dropout), "--attention-dropout", str(args.dropout),
        "--micro-batch-size", str(shape["batch"]), "--global-batch-size", str(shape["batch"]),
        "--train-iters", str(args.warmup + args.steps + 1), "--log-interval", "1000000", "--eval-interval", "0",
        "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "1", "--precision", "bf16" if device.type == "cuda" else "fp32",
    ] + MESHTRON_SIDES[side] + args.meshtron_args  # fmt: skip


def run_meshtron(model: str, args, shape: dict, device: torch.device) -> dict:
    from meshtron.config import build_config
    from meshtron.training.trainer import Trainer

    cfg = build_config(None, meshtron_overrides(model, args, shape, device, args.child))
    trainer = Trainer(cfg, log=lambda s: print("[meshtron]", s, file=sys.stderr))
    trainer.train_batches.close()
    trainer.train_batches = random_batches(model, shape, trainer.device)
    losses = []

    def step():
        loss, _ = trainer.train_step()
        trainer.iteration += 1
        losses.append(loss)

    times = seconds_per_step(step, args.warmup, args.steps, device)
    _profile(step, args, model, args.child)
    return dict(times=times, first_loss=losses[0], last_loss=losses[-1], vocab=trainer.vocab_size)


def _profile(step, args, model: str, side: str) -> None:
    """With ``--profile-dir``: two more steps under the profiler, GPU time by kernel to a table."""
    if args.profile_dir:
        from b1_llama import profile_steps

        profile_steps(step, f"{args.profile_dir}/profile_b8_{model}_{side}.txt")


def run_hf(model_name: str, args, shape: dict, device: torch.device) -> dict:
    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = spec.hf_model(shape, args.dropout).to(device)  # fp32 master weights; bf16 compute under autocast
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batches = random_batches(model_name, shape, device)
    losses = []

    def step():
        batch = next(batches)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = spec.hf_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    times = seconds_per_step(step, args.warmup, args.steps, device)
    _profile(step, args, model_name, "hf")
    return dict(times=times, first_loss=losses[0], last_loss=losses[-1], vocab=shape["vocab"])


def child(args) -> None:
    device, shape = device_of(args), shape_of(args.model, args)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    result = (run_hf if args.child == "hf" else run_meshtron)(args.model, args, shape, device)
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    result["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report(result)


def table_row(model: str, args, shape: dict, sides: dict, mesh_side: str = "meshtron") -> str:
    """One line of a model: ``mesh_side``'s and HF's tokens/s, their ratio, then TFLOP/s, peak GiB and
    loss first->last as ``meshtron / hf`` (``-`` for a side not run, ``failed`` for one that failed)."""
    from meshtron.config import build_config
    from meshtron.models import model_flops_per_token

    model_cfg = build_config(None, meshtron_overrides(model, args, shape, torch.device("cpu"))).model
    tokens_per_step = shape["batch"] * (shape["seq"] + shape["dec"])
    rates = {s: tokens_per_step / statistics.median(r["times"]) for s, r in sides.items() if r}

    def cell(side: str, fmt) -> str:
        if side not in sides:
            return "-"
        return "failed" if sides[side] is None else fmt(sides[side], rates[side])

    def both(fmt) -> str:
        return " / ".join(cell(side, fmt) for side in (mesh_side, "hf"))

    def tflops(r, rate) -> str:
        return f"{rate * model_flops_per_token(model_cfg, r['vocab'], shape['seq'], shape['dec']) / 1e12:.2f}"

    def tokens(r, rate) -> str:
        return f"{rate:,.0f}"

    def peak(r, rate) -> str:
        return f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"

    def loss(r, rate) -> str:
        return f"{r['first_loss']:.3f}->{r['last_loss']:.3f}"

    ratio = f"{rates[mesh_side] / rates['hf']:.2f}x" if {mesh_side, "hf"} <= rates.keys() else "-"
    layers = f"{shape['layers']}+{shape['layers']}" if shape["dec"] else str(shape["layers"])
    length = f"{shape['seq']}/{shape['dec']}" if shape["dec"] else str(shape["seq"])
    label = model if mesh_side == "meshtron" else f"{model} {mesh_side.removeprefix('meshtron-')}"
    return (f"{label:<12} {layers + 'x' + str(shape['hidden']):>9} {length:>7} {cell(mesh_side, tokens):>11} {cell('hf', tokens):>11} "
            f"{ratio:>7} {both(tflops):>17} {both(peak):>13} {both(loss):>29}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=0, help="0: the model's (32)")
    parser.add_argument("--seq-length", type=int, default=0, help="0: the model's (512; T5's encoder)")
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout on both sides")
    parser.add_argument("--sides", default="meshtron,hf", help=f"comma-separated: {', '.join(MESHTRON_SIDES)}, hf")
    parser.add_argument("--rounds", type=int, default=2,
                        help="run the sides this many times, each round's order rotated by one (the first child of a "
                             "call measured slower); a side's steps of all rounds pooled")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="tiny models that run on the CPU (smoke test)")
    parser.add_argument("--profile-dir", default="", help="profile two steps of each side into this directory (GPU)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("meshtron_args", nargs="*", help="extra meshtron flags after --")
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return

    unknown = set(args.sides.split(",")) - {*MESHTRON_SIDES, "hf"}
    if unknown:
        parser.error(f"--sides: unknown {', '.join(sorted(unknown))}; choose from {', '.join(MESHTRON_SIDES)}, hf")
    models = list(MODELS) if args.model == "both" else [args.model]
    results = {}
    for model in models:
        shape = shape_of(model, args)
        sides = args.sides.split(",")
        for turn in range(args.rounds):
            for side in sides[turn % len(sides) :] + sides[: turn % len(sides)]:
                cmd = [sys.executable, __file__, "--child", side, "--model", model, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--micro-batch-size", str(shape["batch"]), "--seq-length", str(shape["seq"]),
                       "--dropout", str(args.dropout), *(["--tiny"] if args.tiny else []), "--profile-dir", args.profile_dir,
                       "--", *args.meshtron_args]  # fmt: skip
                got, pooled = run_child(cmd, f"{model} {side}"), results.setdefault(model, {})
                if got is None or pooled.get(side, 0) is None:
                    pooled[side] = None  # a side that failed once is failed
                elif side in pooled:
                    pooled[side]["times"] += got["times"]
                else:
                    pooled[side] = got

    device = next((r["device"] for sides in results.values() for r in sides.values() if r), "-")
    print(f"\nB8{' (tiny)' if args.tiny else ''}: dropout {args.dropout}, median of {args.steps} steps x {args.rounds} rounds (order rotated) on {device}; "
          "tokens count encoder + decoder; the last three columns are meshtron / hf")  # fmt: skip
    print(f"{'model':<12} {'shape':>9} {'seq':>7} {'meshtron/s':>11} {'hf/s':>11} {'ratio':>7} {'TFLOP/s':>17} "
          f"{'peak GiB':>13} {'loss first->last':>29}")  # fmt: skip
    for model, sides in results.items():
        for mesh_side in [side for side in sides if side in MESHTRON_SIDES] or ["meshtron"]:
            print(table_row(model, args, shape_of(model, args), sides, mesh_side))
    if any(r is None for sides in results.values() for r in sides.values()):
        sys.exit(1)  # a side that crashed fails the command, not just its row


if __name__ == "__main__":
    main()
