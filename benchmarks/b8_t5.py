"""B8 for T5: encoder–decoder training throughput, meshtron against Hugging Face in one command.

    python benchmarks/b8_t5.py [--steps 10] [--warmup 3] [--micro-batch-size 32] [--dropout 0.1]
        [--sides meshtron,hf] [--tiny] [-- extra meshtron flags]

T5-base's shape (12 + 12 layers, hidden 768, 12 heads of 64, FFN 3072, vocabulary 32128),
encoder 512 / decoder 128 tokens, micro batch 32; one training step = forward + backward +
optimizer step over the decoder's cross-entropy (every target position counted). Throughput is
counted in encoder + decoder tokens (640 per sample), as the issue's HF figure is.

* ``meshtron``: the trainer's own step (``Trainer.train_step``) with ``--model-type t5 --bf16``
  (bf16 weights, fp32 master weights and gradients, fused kernels, SDPA backend ``auto``):
  Megatron's T5, learned absolute positions, LayerNorm, GELU, biases, tied LM head with a bias.
  The trainer reads its data source at start-up (the embedded corpus, by sentences), but the
  timed steps get the same random batches as HF, swapped in for its data iterator.
* ``hf``: ``T5ForConditionalGeneration`` (T5 v1.0: relative position buckets, RMSNorm without
  biases, ReLU) with SDPA attention, fp32 weights under ``torch.autocast(bf16)`` and
  ``torch.optim.AdamW(fused=True)``.

The two are not the same function (HF's T5 is not Megatron's) but the same shape and work per
token, within the position bias and the norms. No sequence is padded, so neither side passes an
attention mask. Each side runs in its own process; warm-up steps are not timed; the table prints
tokens/s, TFLOP/s (meshtron's T5 FLOP count for both), peak memory and the ratio to HF.
``--tiny``: a 2 + 2-layer, 64-wide model that runs on the CPU in fp32 (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from child import report, run_child  # benchmarks/child.py: the child-process protocol

T5_BASE = dict(layers=12, hidden=768, heads=12, ffn=3072, vocab=32128, enc=512, dec=128, batch=32)
# The embedded corpus's WordPiece tokenizer with 100 sentinels (4198 tokens) sets a floor under the vocabulary.
TINY = dict(layers=2, hidden=64, heads=4, ffn=256, vocab=4224, enc=32, dec=16, batch=2)


def shape_of(args) -> dict:
    shape = dict(TINY if args.tiny else T5_BASE)
    shape["batch"] = args.micro_batch_size or shape["batch"]
    return shape


def device_of(args) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not args.tiny:
        raise SystemExit("b8_t5 needs a GPU; --tiny runs on the CPU")
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


def random_batches(shape: dict, device: torch.device):
    """Endless T5 batches of random tokens, every decoder position a target."""
    gen = torch.Generator(device=device).manual_seed(0)
    b, t, s, vocab = shape["batch"], shape["enc"], shape["dec"], shape["vocab"]
    while True:
        labels = torch.randint(0, vocab, (b, s), device=device, generator=gen)
        yield {
            "encoder_tokens": torch.randint(0, vocab, (b, t), device=device, generator=gen),
            "decoder_tokens": torch.randint(0, vocab, (b, s), device=device, generator=gen),
            "labels": labels,
            "loss_mask": torch.ones(b, s, device=device),
        }


def meshtron_overrides(args, shape: dict, device: torch.device) -> list[str]:
    return [
        "--model-type", "t5", "--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]),
        "--num-attention-heads", str(shape["heads"]), "--kv-channels", str(shape["hidden"] // shape["heads"]),
        "--ffn-hidden-size", str(shape["ffn"]), "--vocab-size", str(shape["vocab"]), "--vocab-extra-ids", "100",
        "--seq-length", str(shape["enc"]), "--decoder-seq-length", str(shape["dec"]), "--max-position-embeddings", str(shape["enc"]),
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

    times = seconds_per_step(step, args.warmup, args.steps, device)
    return dict(times=times, first_loss=losses[0], last_loss=losses[-1], vocab=trainer.vocab_size)


def run_hf(args, shape: dict, device: torch.device) -> dict:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=shape["vocab"], d_model=shape["hidden"], d_kv=shape["hidden"] // shape["heads"], d_ff=shape["ffn"],
        num_layers=shape["layers"], num_decoder_layers=shape["layers"], num_heads=shape["heads"], dropout_rate=args.dropout,
        tie_word_embeddings=True,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg).to(device)  # fp32 master weights; bf16 compute under autocast
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batches = random_batches(shape, device)
    losses = []

    def step():
        batch = next(batches)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=batch["encoder_tokens"], decoder_input_ids=batch["decoder_tokens"], labels=batch["labels"])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())

    times = seconds_per_step(step, args.warmup, args.steps, device)
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
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=0, help="0: T5-base's 32")
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
        cmd = [sys.executable, __file__, "--child", side, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--micro-batch-size", str(shape["batch"]), "--dropout", str(args.dropout), *(["--tiny"] if args.tiny else []),
               "--", *args.meshtron_args]  # fmt: skip
        rows[side] = run_child(cmd, side)

    model_cfg = build_config(None, meshtron_overrides(args, shape, torch.device("cpu"))).model
    tokens_per_step = shape["batch"] * (shape["enc"] + shape["dec"])
    device = next((r["device"] for r in rows.values() if r), "-")
    name = "tiny T5" if args.tiny else f"T5-base {shape['layers']}+{shape['layers']}x{shape['hidden']}"
    print(f"\nB8: {name}, encoder {shape['enc']} / decoder {shape['dec']}, micro-batch {shape['batch']}, dropout {args.dropout}, "
          f"median of {args.steps} steps on {device}")  # fmt: skip
    print(f"{'side':<10} {'vocab':>7} {'tokens/s':>10} {'TFLOP/s':>8} {'peak GiB':>9} {'loss first->last':>18} {'vs hf':>7}")
    base = rows.get("hf")
    base_rate = tokens_per_step / statistics.median(base["times"]) if base else None
    for side, r in rows.items():
        if r is None:
            print(f"{side:<10} failed")
            continue
        rate = tokens_per_step / statistics.median(r["times"])
        tflops = rate * model_flops_per_token(model_cfg, r["vocab"], shape["enc"], shape["dec"]) / 1e12
        peak = f"{r['peak_gib']:>9.1f}" if r["peak_gib"] is not None else f"{'-':>9}"
        ratio = f"{rate / base_rate:>6.2f}x" if base_rate else f"{'-':>7}"
        print(f"{side:<10} {r['vocab']:>7} {rate:>10,.0f} {tflops:>8.2f} {peak} {r['first_loss']:>8.3f}->{r['last_loss']:<8.3f} {ratio}")


if __name__ == "__main__":
    main()
