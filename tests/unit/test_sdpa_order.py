"""``SdpaOrder``, the ``auto`` attention backend's kernel order on a GPU: inside, torch's SDPA
switches and priority are exactly what ``sdpa_kernel(order, set_priority=True)`` sets; after, they
are as before (also nested, and when some kernel was switched off before)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshtron.layers.attention import _SDPA_FLAGS, SdpaOrder, auto_order, sdpa_backends


def _state() -> tuple[list[bool], list[int]]:
    return [getattr(torch._C, f"_get_{name}_sdp_enabled")() for name in _SDPA_FLAGS], torch._C._get_sdp_priority_order()


@pytest.fixture
def restored():
    before = _state()
    yield
    for name, on in zip(_SDPA_FLAGS, before[0]):
        getattr(torch._C, f"_set_sdp_use_{name}")(on)
    torch._C._set_sdp_priority_order(before[1])


@pytest.mark.parametrize("switched_off", [(), ("flash",), ("math", "overrideable")])
@pytest.mark.parametrize("order", [auto_order(), [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]])
def test_inside_as_sdpa_kernel_sets_it_and_after_as_before(restored, switched_off, order):
    for name in switched_off:
        getattr(torch._C, f"_set_sdp_use_{name}")(False)
    before = _state()
    with sdpa_kernel(order, set_priority=True):
        wanted = _state()
    for name, on in zip(_SDPA_FLAGS, before[0]):  # sdpa_kernel leaves switched-off kernels' order changed
        getattr(torch._C, f"_set_sdp_use_{name}")(on)
    torch._C._set_sdp_priority_order(before[1])
    context = SdpaOrder(order)
    with context:
        assert _state() == wanted
        with context:  # nested (activation recompute inside a forward): one stack of saved states
            assert _state() == wanted
        assert _state() == wanted
    assert _state() == before


def test_auto_on_a_gpu_uses_one_reused_order_and_elsewhere_none(restored):
    cuda = torch.device("cuda")
    assert sdpa_backends("auto", cuda) is sdpa_backends("auto", cuda)
    with sdpa_backends("auto", cuda):
        assert torch._C._get_sdp_priority_order()[: len(auto_order())] == [int(k) for k in auto_order()]
    before = _state()
    with sdpa_backends("auto", torch.device("cpu")):
        assert _state() == before
