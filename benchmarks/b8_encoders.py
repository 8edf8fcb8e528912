"""B8: encoder training throughput, meshtron against Hugging Face transformers in one command.

    python benchmarks/b8_encoders.py --model bert [--steps 10] [--warmup 3] [--micro-batch-size 32]
        [--seq-length 512] [--dropout 0.1] [--sides meshtron,hf] [--tiny] [-- extra meshtron flags]

``--model bert``: BERT-large (24 layers, hidden 1024, 16 heads, FFN 4096, vocabulary 30522),
sequence 512, micro batch 32, one training step = forward + backward + optimizer step over the
masked-LM loss (15 % of positions masked), dropout 0.1 as BERT's. Both sides are post-LN BERT
without the next-sentence head, so they compute the same function:

* ``meshtron``: the trainer's own step (``Trainer.train_step``) with ``--model-type bert
  --apply-residual-connection-post-layernorm --bert-no-binary-head --bf16`` (bf16 weights, fp32
  master weights and gradients in the optimizer, fused kernels, SDPA backend ``auto``); its
  vocabulary padded to a multiple of 128 (30592) as meshtron trains it. The trainer still reads
  its data source at start-up (the embedded corpus, built once per cache), but the timed steps
  get the same random batches as HF, swapped in for its data iterator.
* ``hf``: ``BertForMaskedLM`` with SDPA attention, fp32 weights under ``torch.autocast(bf16)``
  and ``torch.optim.AdamW(fused=True)``.

Every sequence is full length (no padding) on both sides, so neither passes an attention mask.
Each side runs in its own process (clean peak memory); warm-up steps are not timed; the table
prints tokens/s, TFLOP/s (meshtron's one FLOP count, non-causal attention), peak memory and the
ratio to HF. ``--tiny``: a 2-layer, 64-wide model at sequence 32 that runs on the CPU in fp32
(a smoke test of the script, no timing worth reading).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from child import report, run_child  # benchmarks/child.py: the child-process protocol

MODELS = {"bert": dict(layers=24, hidden=1024, heads=16, ffn=4096, vocab=30522, seq=512, batch=32)}
# The embedded corpus's WordPiece tokenizer (4098 tokens) sets a floor under the vocabulary.
TINY = dict(layers=2, hidden=64, heads=4, ffn=256, vocab=4224, seq=32, batch=2)
MASKED_FRACTION = 0.15


def shape_of(args) -> dict:
    shape = dict(TINY if args.tiny else MODELS[args.model])
    shape["seq"] = args.seq_length or shape["seq"]
    shape["batch"] = args.micro_batch_size or shape["batch"]
    return shape


def device_of(args) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not args.tiny:
        raise SystemExit("b8_encoders needs a GPU; --tiny runs on the CPU")
    return torch.device("cpu")


def time_steps(step, warmup: int, steps: int, device: torch.device) -> list[float]:
    """Seconds per step after warm-up: CUDA events on a GPU, the host clock on the CPU."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            start_s = time.perf_counter()
            step()
            times.append(time.perf_counter() - start_s)
    return times


def random_batches(shape: dict, device: torch.device):
    """Endless masked-LM batches: random tokens, 15 % of positions labelled (-100 elsewhere)."""
    gen = torch.Generator(device=device).manual_seed(0)
    while True:
        tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device, generator=gen)
        masked = torch.rand(tokens.shape, device=device, generator=gen) < MASKED_FRACTION
        yield {"tokens": tokens, "labels": torch.where(masked, tokens, -100), "loss_mask": masked.float()}


def meshtron_overrides(args, shape: dict, device: torch.device) -> list[str]:
    return [
        "--model-type", "bert", "--apply-residual-connection-post-layernorm", "--bert-no-binary-head",
        "--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]), "--num-attention-heads", str(shape["heads"]),
        "--ffn-hidden-size", str(shape["ffn"]), "--vocab-size", str(shape["vocab"]), "--norm-epsilon", "1e-12",
        "--seq-length", str(shape["seq"]), "--max-position-embeddings", str(shape["seq"]),
        "--hidden-dropout", str(args.dropout), "--attention-dropout", str(args.dropout),
        "--micro-batch-size", str(shape["batch"]), "--global-batch-size", str(shape["batch"]),
        "--train-iters", str(args.warmup + args.steps + 1), "--log-interval", "1000000", "--eval-interval", "0",
        "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "1", "--precision", "bf16" if device.type == "cuda" else "fp32",
    ] + args.meshtron_args  # fmt: skip


def run_meshtron(args, shape: dict, device: torch.device) -> dict:
    from meshtron.config import build_config
    from meshtron.training.trainer import Trainer

    trainer = Trainer(build_config(None, meshtron_overrides(args, shape, device)), log=lambda s: print("[meshtron]", s, file=sys.stderr))
    trainer.train_batches.close()
    trainer.train_batches = random_batches(shape, trainer.device)
    losses = []

    def step():
        loss, _ = trainer.train_step()
        trainer.iteration += 1
        losses.append(loss)

    times = time_steps(step, args.warmup, args.steps, device)
    return dict(times=times, first_loss=losses[0], last_loss=losses[-1], vocab=trainer.vocab_size)


def run_hf(args, shape: dict, device: torch.device) -> dict:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        intermediate_size=shape["ffn"], max_position_embeddings=shape["seq"], hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg).to(device)  # fp32 master weights; bf16 compute under autocast
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batches = random_batches(shape, device)
    losses = []

    def step():
        batch = next(batches)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=batch["tokens"], labels=batch["labels"])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())

    times = time_steps(step, args.warmup, args.steps, device)
    return dict(times=times, first_loss=losses[0], last_loss=losses[-1], vocab=shape["vocab"])


def child(args) -> None:
    device, shape = device_of(args), shape_of(args)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    result = (run_hf if args.child == "hf" else run_meshtron)(args, shape, device)
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    result["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report(result)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="bert")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=0, help="0: the model's (BERT: 32)")
    parser.add_argument("--seq-length", type=int, default=0, help="0: the model's (BERT: 512)")
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout on both sides")
    parser.add_argument("--sides", default="meshtron,hf", help="comma-separated: meshtron, hf")
    parser.add_argument("--tiny", action="store_true", help="a tiny model that runs on the CPU (smoke test)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("meshtron_args", nargs="*", help="extra meshtron flags after --")
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return

    from meshtron.config import build_config
    from meshtron.training.metrics import model_flops_per_token

    shape = shape_of(args)
    rows = {}
    for side in args.sides.split(","):
        cmd = [sys.executable, __file__, "--child", side, "--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--micro-batch-size", str(shape["batch"]), "--seq-length", str(shape["seq"]), "--dropout", str(args.dropout),
               *(["--tiny"] if args.tiny else []), "--", *args.meshtron_args]  # fmt: skip
        rows[side] = run_child(cmd, side)

    model_cfg = build_config(None, meshtron_overrides(args, shape, torch.device("cpu"))).model
    tokens_per_step = shape["batch"] * shape["seq"]
    device = next((r["device"] for r in rows.values() if r), "-")
    name = "tiny BERT" if args.tiny else f"{args.model} {shape['layers']}x{shape['hidden']}"
    print(f"\nB8: {name}, seq {shape['seq']}, micro-batch {shape['batch']}, dropout {args.dropout}, "
          f"median of {args.steps} steps on {device}")  # fmt: skip
    print(f"{'side':<10} {'vocab':>7} {'tokens/s':>10} {'TFLOP/s':>8} {'peak GiB':>9} {'loss first->last':>18} {'vs hf':>7}")
    base = rows.get("hf")
    base_rate = tokens_per_step / statistics.median(base["times"]) if base else None
    for side, r in rows.items():
        if r is None:
            print(f"{side:<10} failed")
            continue
        rate = tokens_per_step / statistics.median(r["times"])
        tflops = rate * model_flops_per_token(model_cfg, r["vocab"], shape["seq"]) / 1e12
        peak = f"{r['peak_gib']:>9.1f}" if r["peak_gib"] is not None else f"{'-':>9}"
        ratio = f"{rate / base_rate:>6.2f}x" if base_rate else f"{'-':>7}"
        print(f"{side:<10} {r['vocab']:>7} {rate:>10,.0f} {tflops:>8.2f} {peak} {r['first_loss']:>8.3f}->{r['last_loss']:<8.3f} {ratio}")


if __name__ == "__main__":
    main()
