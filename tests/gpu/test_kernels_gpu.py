"""The Triton kernels against their references on the GPU, in the dtypes training runs in."""

import pytest
import torch

from meshtron.kernels.checks import dropout_add_check, run_checks
from meshtron.kernels.dropout_add import dropout_add


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("large", [False, True])
def test_kernels_match_references_gpu(dtype, tol, large):
    for r in run_checks("cuda", dtype, large=large):
        print(f"{r.name} {dtype} large={large}: forward {r.forward:.2e} backward {r.backward:.2e}")
        assert r.forward < tol and r.backward < tol, r


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dropout_add_matches_reference_gpu(dtype):
    """BERT-large's residual stream of one micro batch (32 x 512 tokens x 1024): one mask for the
    forward and the backward, F.dropout's arithmetic rounded once (exactly), 90 % kept (14 sigma)."""
    r = dropout_add_check("cuda", dtype, 16384, 1024, p=0.1)
    print(f"dropout+add {dtype}: {r}")
    assert r.forward == 0 and r.backward == 0 and abs(r.kept - 0.9) < 1e-3 and r.repeats and r.fresh, r


@pytest.mark.gpu
def test_dropout_add_masks_do_not_repeat_past_two_to_the_33_elements():
    """Past 2**33 elements (2**31 Philox counters of four draws) the counters start over under the
    next seed: the mask there is not the first elements' mask again (56 GiB of GPU memory)."""
    head = 2**20
    x = torch.ones(2**33 + head, dtype=torch.bfloat16, device="cuda")
    torch.manual_seed(0)
    kept = dropout_add(x, torch.zeros_like(x), 0.5, True, "on") != 0
    del x
    tail = kept[2**33 :]
    assert not torch.equal(kept[:head], tail)
    assert abs(tail.float().mean().item() - 0.5) < 0.01 and abs(kept[:head].float().mean().item() - 0.5) < 0.01
