"""On a GPU the async save's copies run on a side stream; the optimizer step waits for them there."""

import pytest
import torch

from meshtron.checkpoint.boxes import Box, Sharded
from meshtron.checkpoint.staging import HostStaging

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_state_change_after_before_state_changes_does_not_reach_the_snapshot():
    weight = torch.randn(4096, 4096, device="cuda")
    expected = weight.cpu()
    state = {"w": Sharded(tuple(weight.shape), weight.dtype, [Box((0, 0), weight[:100]), Box((100, 0), weight[100:])])}
    staging = HostStaging()
    for _ in range(2):  # the second save reuses the pinned buffers
        staged, wait = staging.stage(state)
        staging.before_state_changes()
        weight.mul_(2)  # queued after the copies on the compute stream
        wait()
        assert all(b.data.is_pinned() for b in staged["w"].boxes)
        assert torch.equal(torch.cat([b.data for b in staged["w"].boxes]), expected)
        expected = weight.cpu()
