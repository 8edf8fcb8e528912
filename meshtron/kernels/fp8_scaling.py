"""FP8 scaling recipes: how each GEMM operand of an FP8 linear gets its scale.

- ``tensorwise`` ("current" scaling): one scale per tensor from this tensor's amax, so its largest
  value lands on the format's largest: an amax pass, then the cast.
- ``delayed`` (Transformer Engine's and Megatron's default): one scale per tensor from the amax
  history of earlier calls of the same linear (the largest entry, or the most recent one), divided
  by ``2**margin``; the cast computes this call's amax in the same pass, and it enters the history
  afterwards. One pass per operand; values beyond the history's range saturate at the format's
  largest. The first call of a linear (empty history) scales from the current amax.
- ``rowwise``: one scale per row of each GEMM operand along the GEMM's reduction dimension (as
  torchao's rowwise recipe), so every operand is cast twice, once per layout; all operands e4m3
  (``_scaled_mm``'s rowwise kernels take e4m3 only), the output bf16.
- ``blockwise`` (DeepSeek-V3's recipe; Transformer Engine's ``Float8BlockScaling``): a scale per
  1 x 128 block of activations and gradients and per 128 x 128 tile of weights, all e4m3
  (``--fp8-format e4m3``): ``meshtron.kernels.fp8_blockwise``. Every dimension a multiple of 128.

Formats per platform: the OCP ``float8_e4m3fn`` / ``float8_e5m2`` (NVIDIA, AMD gfx950) or the
fnuz ``float8_e4m3fnuz`` / ``float8_e5m2fnuz`` (AMD gfx942, MI300X: max 240 and 57344), chosen
by ``meshtron.kernels.platform`` when a linear's scaling state is built; the scales follow the
chosen format's maximum.

Histories live in ``Fp8Scaling``, one per linear: device buffers, not persistent, so state dicts,
checkpoints and exports do not change; a resumed run starts them empty and re-seeds them from its
first step. Scales never leave the device (no host sync). A forward without grad (evaluation)
reads the histories but leaves them alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshtron.kernels import opaque_op, platform
from meshtron.kernels.fp8_blockwise import BLOCK, block_cast
from meshtron.kernels.fp8_cast import AMAX_FLOOR, Quantized, fp8_cast

# (e4m3, e5m2) of each FP8 family.
FP8_FAMILIES = {"ocp": (torch.float8_e4m3fn, torch.float8_e5m2), "fnuz": (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)}
FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise")
PER_TENSOR_RECIPES = ("delayed", "tensorwise")  # one 0-d scale per tensor (what --fp8-output-layer takes)
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
ROLES = ("input", "weight", "grad")  # the history rows of a linear


def grad_dtype(fp8_format: str, family: str = "ocp") -> torch.dtype:
    """The FP8 type of output gradients: e5m2 for ``hybrid``, e4m3 for ``e4m3``, of ``family``."""
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8 format must be one of {FP8_FORMATS}, got '{fp8_format}'")
    e4m3, e5m2 = FP8_FAMILIES[family]
    return e5m2 if fp8_format == "hybrid" else e4m3


def platform_family(device: torch.device | str | None = None) -> str:
    """The FP8 family of ``device`` (a meta or CPU device: the current GPU's, else OCP)."""
    return "fnuz" if platform.fp8_fnuz(device) else "ocp"


def recipe_formats(recipe: str) -> tuple[str, ...]:
    """The ``--fp8-format`` values ``recipe`` runs: blockwise is all e4m3 (DeepSeek-V3, and
    Transformer Engine's default for it; e5m2 gradients with 1 x 128 scales are not built)."""
    return ("e4m3",) if recipe == "blockwise" else FP8_FORMATS


def gemm_multiple(recipe: str) -> int:
    """What every GEMM dimension must be a multiple of under ``recipe`` (``_scaled_mm``'s 16; the block)."""
    return BLOCK if recipe == "blockwise" else 16


@dataclass(frozen=True)
class Fp8Recipe:
    """The FP8 settings of a model (``model.fp8_*``); Megatron's defaults."""

    format: str = "hybrid"
    recipe: str = "delayed"
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    margin: int = 0
    fused_kernels: str = "auto"  # the cast kernels: model.fused_kernels


def _scale(amax: torch.Tensor, fmax: float, margin: int = 0) -> torch.Tensor:
    scale = fmax / amax.clamp(min=AMAX_FLOOR)
    return scale / 2.0**margin if margin else scale  # no kernel for a division by 1 (Megatron's margin is 0)


class Fp8Scaling(nn.Module):
    """The scaling state of one FP8 linear: its recipe, its FP8 family (``FP8_FAMILIES``; None:
    the platform's), and for ``delayed`` the amax histories (rows: input, weight, output
    gradient; column 0 the most recent)."""

    def __init__(self, recipe: Fp8Recipe, device: torch.device | str | None = None, family: str | None = None):
        super().__init__()
        self.recipe = recipe
        self.family = platform_family(device) if family is None else family
        if self.family not in FP8_FAMILIES:
            raise ValueError(f"FP8 family must be one of {tuple(FP8_FAMILIES)}, got '{self.family}'")
        grad_dtype(recipe.format)  # validates the format
        if recipe.recipe not in FP8_RECIPES:
            raise ValueError(f"fp8 recipe must be one of {FP8_RECIPES}, got '{recipe.recipe}'")
        if recipe.format not in recipe_formats(recipe.recipe):
            raise ValueError(f"--fp8-recipe {recipe.recipe} runs every operand in e4m3: use --fp8-format e4m3, not '{recipe.format}'")
        history_len = recipe.amax_history_len if recipe.recipe == "delayed" else 0
        self.register_buffer("amax_history", torch.zeros(len(ROLES), history_len, device=device), persistent=False)
        self.seeded = False  # a forward with grad has run: the histories hold amaxes

    def _apply(self, fn, recurse=True):
        """Moves with the model but stays fp32 when the model is cast to bf16."""
        super()._apply(fn, recurse)
        if self.amax_history.dtype != torch.float32:
            self.amax_history = self.amax_history.float()
        return self

    def dtype(self, role: str) -> torch.dtype:
        if role == "grad" and self.recipe.recipe not in ("rowwise", "blockwise"):
            return grad_dtype(self.recipe.format, self.family)
        return FP8_FAMILIES[self.family][0]

    def quantize(self, t: torch.Tensor, role: str, rows: bool, transposed: bool, seeded: bool, update: bool) -> Quantized:
        """``t`` [n, k] as ``role``: the row-major copy (for GEMMs reducing over k) and/or the
        transposed one (reducing over n), as the recipe scales them. ``seeded``: the histories
        hold amaxes (else the current amax scales); ``update``: this call's amax enters them."""
        dtype, kernels = self.dtype(role), self.recipe.fused_kernels
        if self.recipe.recipe == "blockwise":  # weights per 128 x 128 tile, the rest per 1 x 128 block
            return block_cast(t, dtype, role == "weight", rows, transposed, kernels)
        if self.recipe.recipe == "rowwise":
            fmax, q, qt, q_inv, qt_inv = torch.finfo(dtype).max, None, None, None, None
            if rows:  # per row of t: amax over k
                scale = _scale(torch.linalg.vector_norm(t, float("inf"), dim=1, keepdim=True).float(), fmax)
                q, q_inv = fp8_cast(t, scale, dtype, True, False, fused_kernels=kernels).rows, scale.reciprocal()
            if transposed:  # per column of t: amax over n; one scale per row of the transposed copy
                scale = _scale(torch.linalg.vector_norm(t, float("inf"), dim=0, keepdim=True).float(), fmax)
                qt = fp8_cast(t, scale, dtype, False, True, fused_kernels=kernels).transposed
                qt_inv = scale.reciprocal().reshape(-1, 1)
            return Quantized(q, q_inv, qt, qt_inv)
        if self.recipe.recipe == "delayed":
            history = self.amax_history[ROLES.index(role)]
            use_max = self.recipe.amax_compute_algo == "max"
            q, qt, inv = _delayed_cast(t, history, dtype, self.recipe.margin, use_max, seeded, update,
                                                             rows, transposed, kernels)  # fmt: skip
            return Quantized(q if rows else None, inv, qt if transposed else None, inv)
        cast, scale, _ = _current_cast(t, dtype, rows, transposed, kernels)
        inv = scale.reciprocal()
        return Quantized(cast.rows, inv, cast.transposed, inv)


def _current_cast(t: torch.Tensor, dtype: torch.dtype, rows: bool, transposed: bool, fused_kernels: str):
    """Current per-tensor scaling: the amax pass, then the cast -> (Cast, scale, amax)."""
    amax = fp8_cast(t, None, dtype, False, False, compute_amax=True, fused_kernels=fused_kernels).amax
    scale = _scale(amax, torch.finfo(dtype).max)
    return fp8_cast(t, scale, dtype, rows, transposed, fused_kernels=fused_kernels), scale, amax


@opaque_op("meshtron::fp8_delayed_cast", mutates_args=("history",))
def _delayed_cast(t: torch.Tensor, history: torch.Tensor, dtype: torch.dtype, margin: int, use_max: bool, seeded: bool,
                  update: bool, rows: bool, transposed: bool, fused_kernels: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Delayed scaling of one operand as one op: the scale from ``history`` (this role's row; or
    the current amax when not ``seeded``), the cast with this call's amax, the amax pushed into
    ``history`` (``update``); -> (rows copy, transposed copy, inverse scale), empty where not asked.

    One op, declared to mutate the history, because traced as plain ops under ``torch.compile``
    the partitioner recomputed the saved FP8 copies in backward from the history the forward had
    already updated (another scale)."""
    if seeded:
        scale = _scale(history.max() if use_max else history[0], torch.finfo(dtype).max, margin)
        cast = fp8_cast(t, scale, dtype, rows, transposed, compute_amax=update, fused_kernels=fused_kernels)
        amax = cast.amax
    else:
        cast, scale, amax = _current_cast(t, dtype, rows, transposed, fused_kernels)
    if update:
        if history.numel() > 1:
            history.copy_(torch.roll(history, 1))
        history[0] = amax
    empty = t.new_empty((0,), dtype=dtype)
    return (cast.rows if rows else empty, cast.transposed if transposed else empty, scale.reciprocal())


@_delayed_cast.register_fake
def _delayed_cast_shapes(t, history, dtype, margin, use_max, seeded, update, rows, transposed, fused_kernels):
    n, m = t.shape
    return (t.new_empty((n, m) if rows else (0,), dtype=dtype), t.new_empty((m, n) if transposed else (0,), dtype=dtype),
            t.new_empty((), dtype=torch.float32))
