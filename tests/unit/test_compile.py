"""``--compile`` compiles each block in place: same names, same numbers (checked with the
``aot_eager`` backend, which traces forward and backward like inductor without generating code),
also through the FP8 linear's autograd function, each recipe (blockwise: its custom ops), delayed scaling past its first call
(the amax histories updated inside the compiled forward and backward), and inside a step's
``step_cache`` scope (compiled blocks cast their weights per micro batch)."""

import contextlib
import dataclasses

import pytest
import torch

from meshtron.config import build_config
from meshtron.kernels import fp8, step_cache
from meshtron.kernels.fp8_scaling import Fp8Recipe
from meshtron.models import build_model
from meshtron.parallel.setup import compile_blocks


def _loss_and_grads(compiled: bool, fp8_recipe: str = "", micro: int = 1, scoped: bool = False):
    blockwise = fp8_recipe == "blockwise"  # every GEMM dimension a multiple of 128, all e4m3
    width, seq = (128, 64) if blockwise else (64, 16)
    cfg = build_config(overrides=["--model.preset", "tiny-llama", "--num-layers", "2"]).model
    cfg = dataclasses.replace(cfg, hidden_size=width, ffn_hidden_size=2 * width)
    torch.manual_seed(0)
    model = build_model(cfg, 128, seq)
    if fp8_recipe:
        recipe = Fp8Recipe("e4m3" if blockwise else "hybrid", fp8_recipe, amax_history_len=4, amax_compute_algo="max")
        fp8.apply_fp8(model.layers, recipe, "meshtron")
    if compiled:
        compile_blocks(model.blocks(), backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    # The second call scales from the histories the first one filled (and compiles again: the
    # scaling is seeded by then); blockwise scales each call from its own tiles, so it is called once.
    for _ in range(1 if blockwise else 2):
        model.zero_grad()
        tokens = torch.randint(0, 128, (2, seq), generator=gen)
        with step_cache.scope() if scoped else contextlib.nullcontext():  # the runner's, around a step's micro batches
            for batch in tokens.chunk(micro):
                loss = model(batch, labels=torch.roll(batch, -1, 1)).mean()
                loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


# rowwise compiled (~8 s on 2 cores) runs with the slow cases; its eager path is in test_fp8.py
# scoped: two micro batches in the runner's step_cache scope, where compiled blocks look no weight
# copy up (they cast per micro batch, as the eager blocks outside a scope).
@pytest.mark.parametrize("fp8_recipe, scoped", [("", False), ("delayed", False), pytest.param("rowwise", False, marks=pytest.mark.slow),
                                                ("blockwise", False), ("delayed", True)])  # fmt: skip
def test_compiled_blocks_match_eager(fp8_recipe, scoped):
    torch._dynamo.reset()
    micro = 2 if scoped else 1
    ref_model, ref_loss, ref_grads = _loss_and_grads(False, fp8_recipe, micro)
    model, loss, grads = _loss_and_grads(True, fp8_recipe, micro, scoped)
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.layers)
    assert list(grads) == list(ref_grads)  # parameter names unchanged: checkpoints are unaffected
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    for ref_buffer, buffer in zip(ref_model.buffers(), model.buffers()):  # the amax histories too
        torch.testing.assert_close(buffer, ref_buffer, rtol=1e-5, atol=0)
