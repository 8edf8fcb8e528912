"""The Triton kernels against their references on the CPU, through Triton's interpreter (fp32).

Skipped where Triton is not installed (CI) and where a GPU is present (tests/gpu runs them
compiled, in bf16): the interpreter is switched on for the whole process by an environment
variable read when the kernels are first defined, which must not happen on a GPU machine.
"""

import os

import pytest
import torch

from meshtron.kernels import triton_available

pytestmark = pytest.mark.skipif(
    not triton_available() or torch.cuda.is_available(), reason="needs Triton, and no GPU (then tests/gpu covers it)"
)
if triton_available() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from meshtron.kernels.checks import run_checks  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1])
def test_kernels_match_references_fp32(seed):
    results = run_checks("cpu", torch.float32, seed=seed)
    assert {r.name for r in results} >= {"rmsnorm", "layernorm", "swiglu", "rope", "linear+cross-entropy"}
    for r in results:
        assert r.forward < 1e-5 and r.backward < 1e-5, r
