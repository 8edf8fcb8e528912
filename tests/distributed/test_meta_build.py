"""Each rank builds only its own shard: the model is built on the meta device, planned, cut into
pipeline stages and sharded there, and a rank then allocates and draws only what it keeps.

On 4 gloo ranks, every allocation made while the runner is built is counted (a dispatch mode
that follows each new storage until it is freed): the peak stays within 1.1 x what the rank
holds once the runner exists (its parameters, buffers, gradient buffer and optimizer state), for
tp4, pp4 with a large vocabulary, ep4, FSDP2 dp4 and tp2 x pp2 x dp2: the peak exceeds what the rank
holds once the runner exists (parameters, buffers, gradient buffer, optimizer state) by at most a
tenth of its local parameter and buffer bytes, and those are well below the whole model's, so a
build that made the whole model first could not pass (it fails on each layout here). Then the
memory of whole processes: pp4 middle stages of an untied 262,144-token model peak within 15 %
of the same stages with a 512-token vocabulary (they never hold an embedding or output table).
"""

from __future__ import annotations

import resource
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from meshtron.config import build_config
from meshtron.parallel.mesh import init_distributed
from meshtron.parallel.setup import build_runner
from meshtron.training.trainer import Trainer
from tests.distributed.launcher import run_distributed

MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--num-query-groups", "4", "--swiglu",
         "--ffn-hidden-size", "2048", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--make-vocab-size-divisible-by", "1", "--seq-length", "32", "--mock-data",
         "--global-batch-size", "8", "--device", "cpu", "--fp32"]  # fmt: skip
LAYOUTS = {
    "tp4": ["--tp", "4", "--micro-batch-size", "8", "--vocab-size", "4096"],
    "pp4_large_vocab": ["--pp", "4", "--micro-batch-size", "2", "--vocab-size", "65536"],
    "ep4": ["--num-experts", "8", "--moe-router-topk", "2", "--ep", "4", "--micro-batch-size", "2", "--vocab-size", "4096"],
    "fsdp_dp4": ["--fsdp", "--micro-batch-size", "2", "--vocab-size", "16384"],
    "tp2_pp2_dp2": ["--tp", "2", "--pp", "2", "--micro-batch-size", "2", "--use-distributed-optimizer", "--vocab-size", "4096"],
}


class AllocationCounter(TorchDispatchMode):
    """Bytes of the storages created inside the mode and still alive (``now``), and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                try:
                    key = storage.data_ptr()
                except RuntimeError:  # a wrapper without storage of its own (its inner tensors' ops come here too)
                    continue
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._freed, key)
        return out


def _whole_model_bytes(flags: list[str]) -> int:
    from meshtron.models import build_model

    cfg = build_config(None, MODEL + flags)
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_length)
    return sum(p.numel() * 4 for p in model.parameters())


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param  # an FSDP2 DTensor: this rank's shard


def _setup_allocations(rank: int, world_size: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        cfg = build_config(None, MODEL + LAYOUTS[name])
        mesh = init_distributed(cfg.parallel, "cpu")
        with AllocationCounter() as counter:
            runner = build_runner(cfg, mesh, cfg.model.vocab_size, torch.device("cpu"), torch.float32)
        local = [_local(t) for t in (*runner.model.parameters(), *runner.model.buffers())]
        out[name] = {"peak": counter.peak, "held": counter.now, "local_bytes": sum(t.numel() * t.element_size() for t in local),
                     "params": sum(t.numel() for t in local)}  # fmt: skip
        del runner
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, out)
    return gathered if rank == 0 else None


@pytest.fixture(scope="module")
def allocations():
    return run_distributed(_setup_allocations, 4, list(LAYOUTS), timeout=600)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_setup_allocates_only_the_rank_shard(allocations, layout):
    whole = _whole_model_bytes(LAYOUTS[layout])
    for rank, per_layout in enumerate(allocations):
        got = per_layout[layout]
        # Beyond what it keeps (parameters, buffers, gradient buffer, optimizer state), a rank's
        # setup allocates at most a tenth of its local parameter and buffer bytes at any moment.
        assert got["peak"] - got["held"] <= 0.1 * got["local_bytes"], (layout, rank, got)
        # What a rank keeps (weights and optimizer state) is well below the whole model's weights alone.
        assert got["params"] * 4 < 0.6 * whole, (layout, rank, got["params"], whole)


def _stage_peak_rss(rank: int, world_size: int, vocab: int) -> int:
    flags = ["--pp", "4", "--micro-batch-size", "2", "--vocab-size", str(vocab), "--hidden-size", "512", "--ffn-hidden-size", "1024",
             "--train-iters", "1", "--eval-interval", "0", "--log-interval", "100"]  # fmt: skip
    Trainer(build_config(None, MODEL + flags), log=lambda _: None).run()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


@pytest.mark.slow
def test_middle_stages_never_hold_the_vocabulary_tables():
    large = run_distributed(_stage_peak_rss, 4, 262_144, timeout=600)
    small = run_distributed(_stage_peak_rss, 4, 512, timeout=600)
    for rank in (1, 2):
        assert large[rank] <= 1.15 * small[rank], (rank, large, small)
    assert large[0] > small[0] + 1_000_000  # the first stage does hold the 0.5 GiB embedding (and its Adam state)
