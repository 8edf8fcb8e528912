"""The one entry point: ``meshtron train | preprocess | generate | finetune | evaluate-retrieval | convert | estimate | plan``."""

from __future__ import annotations

import argparse
import sys

from meshtron.errors import CheckpointError, ConfigError, DivergenceError  # torch-free: `preprocess` starts fast

# ``meshtron train`` with no arguments: the embedded corpus, a small GPT, a checkpoint, TensorBoard
# events for ``meshtron plot`` and a sample. Run again, the demo replaces its own checkpoints.
DEFAULT_RUN_DIR = "checkpoints/default"
EMBEDDED_DEFAULT_ARGS = ["--save", DEFAULT_RUN_DIR, "--tensorboard-dir", f"{DEFAULT_RUN_DIR}/tensorboard", "--allow-existing-checkpoints",
                         "--generate-prompt", "The"]  # fmt: skip

USAGE = """usage: meshtron <command> [options]

commands:
  train        train a model: meshtron train [--config FILE] [--flag value ...]
               (no arguments: a small GPT on the embedded corpus into checkpoints/default, then a sample)
  preprocess   jsonl -> Megatron-compatible .bin/.idx (preprocess_data.py's flags)
  generate     sample from a checkpoint: meshtron generate --load DIR --prompt TEXT [--max-new-tokens N]
               (a checkpoint trained on --mock-data has no tokenizer: add --tokenizer-type NAME ...)
  finetune     fine-tune a BERT checkpoint to classify text: meshtron finetune --load BERT_CKPT
               --train-data train.jsonl --valid-data valid.jsonl ({"text", "label"} lines) [--epochs N]
  evaluate-retrieval
               top-k accuracy of an ICT checkpoint on held-out blocks: meshtron evaluate-retrieval
               --load ICT_CKPT [--split valid|test] [--topk 1 5 20]
  convert      Hugging Face weights: meshtron convert hf-import --hf-dir DIR --save OUT [--dtype bf16|fp32]
               or meshtron convert hf-export --load CKPT --hf-dir OUT [--dtype bf16|fp16|fp32 (default: the checkpoint's)]
               [--max-shard-size 5GB]
               or meshtron convert reshard --load CKPT --save OUT (one process, offline)
               Megatron-LM checkpoints: meshtron convert megatron-import --load MEGATRON_DIR --save OUT
               or meshtron convert megatron-export --load CKPT --save MEGATRON_DIR [--ckpt-format torch_dist|torch]
  checkpoint   inspect a checkpoint: meshtron checkpoint info DIR [--ckpt-step N] [--tensors]
               (the first line: OK, or FAILED and why)
  plot         a PNG of a run's loss, lr, grad norm, tokens/s and memory: meshtron plot RUN_DIR (its --tensorboard-dir)
  estimate     per-GPU memory of a config and layout: meshtron estimate [--config FILE] [--world-size N]
               [--print-mesh] [--flag value ...]
  plan         the parallel layout by a model of step time: meshtron plan --gpus N [--gpus-per-node G]
               [--gpu h100|h200|mi300x | --calibration FILE] [--inter-node-gbps X] [--measure K] [--flag value ...]
               (--calibrate times this machine into a calibration file)
"""


def train_main(argv: list[str]) -> int:
    from meshtron.config import build_config, format_config
    from meshtron.parallel.mesh import end_distributed
    from meshtron.training.trainer import Trainer
    from meshtron.validation import validate

    parser = argparse.ArgumentParser(prog="meshtron train", add_help=False)
    parser.add_argument("--config", default=None)
    parser.add_argument("--print-config", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    known, overrides = parser.parse_known_args(argv)
    if known.help:
        from meshtron.config_help import help_text

        print(help_text(build_config(None, [])))
        return 0
    if not argv:
        overrides = list(EMBEDDED_DEFAULT_ARGS)
    cfg = build_config(known.config, overrides)
    if known.print_config:
        validate(cfg)
        print(format_config(cfg))
        return 0
    try:
        Trainer(cfg).run()
    except DivergenceError:  # every rank stops at the same step: no collective is in flight
        end_distributed()
        raise
    end_distributed()
    if not argv:
        print(f"draw the run: meshtron plot {DEFAULT_RUN_DIR} (pip install 'meshtron[plot]'); sample more: "
              f"meshtron generate --load {DEFAULT_RUN_DIR} --prompt 'The'")  # fmt: skip
    return 0


def generate_main(argv: list[str]) -> int:
    from meshtron.inference.generate import generate_from_checkpoint

    parser = argparse.ArgumentParser(prog="meshtron generate", description="sample text from a checkpoint")
    parser.add_argument("--load", required=True, help="checkpoint directory written by --save")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--ckpt-step", type=int, default=None, help="iteration to load (default: the newest)")
    given = parser.add_argument_group("tokenizer", "for a checkpoint saved without one (--mock-data), or to use another")
    for flag in ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file"):
        given.add_argument(flag, default="")
    args = parser.parse_args(argv)
    tokenizer = {key: getattr(args, key) for key in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")}
    text = generate_from_checkpoint(
        args.load, args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        greedy=args.greedy, seed=args.seed, device=args.device, iteration=args.ckpt_step, tokenizer=tokenizer,
    )
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "train":
            return train_main(rest)
        if command == "preprocess":
            from meshtron.data.preprocess import main as preprocess_main

            preprocess_main(rest)
            return 0
        if command == "generate":
            return generate_main(rest)
        if command == "finetune":
            from meshtron.downstream.classification import main as finetune_main

            return finetune_main(rest)
        if command == "evaluate-retrieval":
            from meshtron.downstream.retrieval import main as retrieval_main

            return retrieval_main(rest)
        if command == "convert" and rest[:1] in (["megatron-import"], ["megatron-export"]):
            from meshtron.checkpoint.megatron_convert import main as megatron_main

            return megatron_main(rest)
        if command == "convert" and rest[:1] == ["reshard"]:
            from meshtron.checkpoint.reshard import main as reshard_main

            return reshard_main(rest[1:])
        if command == "convert":
            from meshtron.models.hf import main as convert_main

            return convert_main(rest)
        if command == "checkpoint":
            from meshtron.checkpoint.info import main as checkpoint_main

            return checkpoint_main(rest)
        if command == "plot":
            from meshtron.plot import main as plot_main

            return plot_main(rest)
        if command == "estimate":
            from meshtron.estimate import main as estimate_main

            return estimate_main(rest)
        if command == "plan":
            from meshtron.planning.cli import main as plan_main

            return plan_main(rest)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as exc:
        # Bad input: one clear line, no traceback. Bugs (other exceptions) keep their traceback.
        print(f"meshtron {command}: error: {exc}", file=sys.stderr)
        return 2
    except DivergenceError as exc:
        print(f"meshtron {command}: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # Ctrl-C before training began (in training it saves and stops)
        print(f"meshtron {command}: interrupted (Ctrl-C); nothing was saved", file=sys.stderr)
        return 130
    print(f"meshtron: unknown command '{command}'\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
