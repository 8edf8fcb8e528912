"""The host buffers of --async-save: a snapshot of the state, allocated once per run."""

import torch

from meshtron.checkpoint.boxes import Box, Sharded
from meshtron.checkpoint.staging import HostStaging


def _state(weight: torch.Tensor) -> dict[str, Sharded]:
    return {"w": Sharded(tuple(weight.shape), weight.dtype, [Box((0, 0), weight[:2]), Box((2, 0), weight[2:])])}


def test_staged_boxes_are_a_snapshot_in_buffers_reused_by_the_next_save():
    weight = torch.arange(12.0).view(4, 3)
    staging = HostStaging()
    staged, wait = staging.stage(_state(weight))
    wait()
    first = [b.data for b in staged["w"].boxes]
    weight.add_(100)  # the next optimizer step changes the live tensor in place
    assert torch.equal(torch.cat(first), torch.arange(12.0).view(4, 3))
    held = staging.allocated_bytes
    staged_again, _ = staging.stage(_state(weight))
    assert all(a is b.data for a, b in zip(first, staged_again["w"].boxes))  # no new allocation
    assert staging.allocated_bytes == held == 12 * 4
    assert torch.equal(torch.cat([b.data for b in staged_again["w"].boxes]), weight)


def test_a_box_of_another_shape_gets_a_new_buffer_and_the_count_follows():
    staging = HostStaging()
    staging.stage(_state(torch.zeros(4, 3)))
    staging.stage(_state(torch.zeros(4, 5)))
    assert staging.allocated_bytes == 4 * 5 * 4


def test_reserved_buffers_are_the_ones_the_save_uses():
    weight = torch.ones(4, 3)
    staging = HostStaging()
    staging.reserve(_state(weight))
    held = dict(staging._buffers)
    staged, _ = staging.stage(_state(weight))
    assert [b.data for b in staged["w"].boxes] == [held[("w", 0)], held[("w", 1)]] and staging.allocated_bytes == 48
