"""B4b (DeepSeek-V2-Lite's shape x 4 layers: MLA, layer 0 dense, then 64 experts top-6 + 2 shared,
seq 4096, micro batch 2, fp32 master weights) in bf16 and with FP8 experts, one training process
per side, on one GPU:

    python benchmarks/b4b_fp8_experts.py [--steps 6] [--warmup 3] [--sides bf16,fp8,fp8_linears]

Sides: ``bf16``; ``fp8`` (``--fp8-format hybrid``: the blocks' linears on the default delayed
recipe, the routed experts' grouped GEMMs in FP8 with rowwise scales); ``fp8_linears`` (the same
with ``--model.moe_fp8 off``: the experts stay bf16, so ``fp8`` against ``fp8_linears`` is what the
FP8 experts add); ``rowwise`` (``--fp8-format e4m3 --fp8-recipe rowwise``: linears rowwise too);
``bf16_4mb``, ``fp8_4mb``, ``fp8_linears_4mb``: the same with four micro batches a step (global
batch 8), where each expert weight is cast to FP8 once for the four (``kernels/step_cache.py``).
The table (``b3_fp8_recipes.print_table``) gives tokens/s, model TFLOP/s (active parameters),
step time, peak memory, the ratio to bf16 and the losses of the timed steps (the same mock data on
every side).
"""

from __future__ import annotations

from b3_fp8_recipes import compare

B4B = ["--preset", "deepseek-v2-lite", "--num-layers", "4", "--moe-layer-freq", "([0]+[1]*3)", "--seq-length", "4096",
       "--micro-batch-size", "2", "--global-batch-size", "2", "--bf16"]  # fmt: skip
SIDES = {
    "bf16": [],
    "fp8": ["--fp8-format", "hybrid", "--fp8-backend", "meshtron", "--model.moe_fp8", "rowwise"],
    "fp8_linears": ["--fp8-format", "hybrid", "--fp8-backend", "meshtron", "--model.moe_fp8", "off"],
    "rowwise": ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--model.moe_fp8", "rowwise"],
    # Four micro batches a step (gradient accumulation): the experts' weights are cast once for all four.
    "bf16_4mb": ["--global-batch-size", "8"],
    "fp8_4mb": ["--fp8-format", "hybrid", "--fp8-backend", "meshtron", "--model.moe_fp8", "rowwise", "--global-batch-size", "8"],
    "fp8_linears_4mb": ["--fp8-format", "hybrid", "--fp8-backend", "meshtron", "--model.moe_fp8", "off", "--global-batch-size", "8"],
}

if __name__ == "__main__":
    compare("B4b", B4B, SIDES, "bf16,fp8,fp8_linears", __doc__)
