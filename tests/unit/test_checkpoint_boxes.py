"""The box geometry of sharded checkpoints: flat slices and tensor-parallel runs tile the global
tensor exactly once when written, and cover each rank's whole part when read."""

import itertools

import torch

from meshtron.checkpoint.boxes import flat_boxes, param_boxes, tp_runs
from meshtron.models.contract import GroupedHeads, Halves, ParamMeta


def test_flat_boxes_tile_every_span_exactly():
    for shape in [(5,), (3, 4), (2, 3, 4)]:
        numel = torch.Size(shape).numel()
        index = torch.arange(numel).view(shape)
        for lo, hi in itertools.combinations(range(numel + 1), 2):
            got = []
            for offsets, sizes in flat_boxes(shape, lo, hi):
                box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                got += box.flatten().tolist()
            assert got == list(range(lo, hi)), (shape, lo, hi)  # in flat order: each box one run of memory


def _metas(layout, rows, tp):
    return [ParamMeta((rows, 3), tp_dim=0, layout=layout, tp_size=tp, tp_rank=r) for r in range(tp)]


def test_tp_runs_write_each_row_once_and_read_every_held_row():
    cases = [(Halves(2), 8, 2), (GroupedHeads(2, 2, 1), 8, 2), (GroupedHeads(1, 4, 1), 6, 2), (GroupedHeads(2, 4, 1), 12, 4)]
    for layout, rows, tp in cases:
        written = []
        for meta in _metas(layout, rows, tp):
            held = meta.local_index().tolist()
            read = [g + i for _, g, n in tp_runs(meta, writing=False) for i in range(n)]
            assert sorted(read) == sorted(held)
            written += [g + i for _, g, n in tp_runs(meta, writing=True) for i in range(n)]
        assert sorted(written) == list(range(rows)), (layout, written)  # k/v copies written by one rank


def test_param_boxes_of_a_distributed_optimizer_slice_hold_its_values():
    meta = _metas(Halves(2), 8, 2)[1]  # rows 2, 3, 6, 7 of an [8, 3] weight
    full = torch.arange(24.0).view(8, 3)
    local = full[meta.local_index()]
    piece = local.flatten()[4:10].clone()  # a slice through rows: the distributed optimizer's piece
    boxes = param_boxes(piece, (4, 3), meta, start=4).boxes
    assert sum(b.data.numel() for b in boxes) == 6
    for box in boxes:
        rows, cols = box.data.shape
        r, c = box.offsets
        assert torch.equal(box.data, full[r : r + rows, c : c + cols])
