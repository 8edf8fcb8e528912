"""Expert tensor parallelism (each expert's FFN split over the expert grid's etp group, of any
size against tp) and FSDP2 with expert parallelism, equal to one process.

One spawn of 4 gloo processes (fp32, CPU) runs every case through the same runner as training
(and one of 2 processes, tp1 x etp2: each expert split over two data-parallel ranks):

- etp = tp: etp2 (tp2, ep1) with and without sequence parallelism and with pp2, ep2 x etp2 with
  both dispatchers and with sequence parallelism (DeepSeek's per-sequence balancing loss, a gated
  shared expert); etp other than tp: tp1 x etp2 x ep2 (etp from dp ranks, both dispatchers),
  tp4 x etp2 (etp half of a tp group) and tp2 x etp4 (etp across two tp groups), each with and
  without sequence parallelism (without it the tp ranks' shared rows are split among them first),
  tp2 x etp1 x ep4 x sp (Megatron's fine-grained layout: ep across the tp ranks), etp2 over the
  cp ranks (cp2 x dp2) and etp2 inside each pipeline stage (pp2 x dp2): the step
  loss, each balancing term and every gradient equal one process's (1e-5 relative);
- FSDP2 with ep2 (dp4: experts sharded over an edp group of 2), ep4 (edp 1) and etp2 (dp4, edp
  2): loss, balancing terms and gradients the same way (ep2 also with the all-to-all overlapped);
- one optimizer step under ep2 x etp2 (the distributed optimizer sharding experts over edp),
  etp2 x sp (replicated optimizer), tp1 x etp2 x ep2 (distributed optimizer), tp4 x etp2 x sp
  and FSDP2 with ep2 and with etp2: the gradient norm (each expert slice counted once), the
  updated weights and the expert bias equal a one-process runner's, and the checkpoint each
  layout saves, loaded into one process, equals the one-process runner's state (weights,
  masters, Adam moments) and continues with its next step's loss and gradient norm;
- one process's checkpoint loaded into a fresh ep2 x etp2 layout (and into FSDP2 ep2) and saved
  again reads back the same: resharding 1 -> ep2 x etp2 -> 1 and 1 -> FSDP2 ep2 -> 1;
- the alltoall and allgather dispatchers stay bit-identical under etp, and so does the overlapped
  all-to-all (``--overlap-moe-expert-parallel-comm``) against the plain one; and the experts alone
  (ep2 x etp2, sequence parallel) with an etp rank that sends no row and experts that receive
  none: outputs and gradients equal one process's experts.
"""

from __future__ import annotations

import pytest
import torch

from launcher import by_name, run_distributed
from meshtron.checkpoint.checkpoint import load_checkpoint, save_checkpoint
from meshtron.config import ParallelConfig
from meshtron.models.contract import Halves, ParamMeta
from meshtron.parallel.expert_parallel import ExpertParallelExperts, expert_tensor_parallel_split
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import gather_full
from meshtron.parallel.setup import runner_for
from test_expert_parallel import (CONFIGS, MOE_BIAS, STEP_RTOL, TRAIN, _assert_same_state, _bias_runner, _one_process_step, _parallel,
                                  _assert_bit_identical, _assert_rows_match, _reference, _reload, _state_in_one_process, _zero_token_experts, _zero_token_inputs,
                                  _zero_token_reference)  # fmt: skip
from test_model_contract import MICRO_BATCHES, RTOL, _check, _build, _micro_batches, _train_step


try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch < 2.5
    from torch.distributed._tensor import DTensor

TP2 = dict(tp=2, dp=2, etp=2)
EP2_TP2 = dict(tp=2, dp=2, ep=2, etp=2)
# name: (mesh sizes, config, sequence parallel)
ETP2_EP2_DP4 = dict(dp=4, ep=2, etp=2)
TP4_ETP2 = dict(tp=4, etp=2)
LAYOUTS = {
    "etp2": (TP2, "moe", False),
    "etp2_sp": (TP2, "sequence", True),
    "etp2_pp2": (dict(tp=2, pp=2, etp=2), "moe", False),
    "ep2_etp2": (EP2_TP2, "moe", False),
    "ep2_etp2_allgather": (EP2_TP2, "allgather", False),
    "ep2_etp2_sp": (EP2_TP2, "sequence", True),
    "tp1_etp2_ep2": (ETP2_EP2_DP4, "moe", False),
    "tp1_etp2_ep2_allgather": (ETP2_EP2_DP4, "allgather", False),
    "ep2_etp2_overlap": (EP2_TP2, "overlap", False),
    "tp1_etp2_ep2_overlap": (ETP2_EP2_DP4, "overlap", False),
    "tp4_etp2": (TP4_ETP2, "moe", False),
    "tp4_etp2_sp": (TP4_ETP2, "sequence", True),
    "tp2_etp4": (dict(tp=2, dp=2, etp=4), "moe", False),
    "tp2_etp4_sp": (dict(tp=2, dp=2, etp=4), "sequence", True),
    "tp2_etp1_ep4_sp": (dict(tp=2, dp=2, ep=4), "sequence", True),
    "cp2_etp2": (dict(cp=2, dp=2, etp=2), "moe", False),
    "pp2_etp2": (dict(pp=2, dp=2, etp=2), "moe", False),
}
# world 2: name -> (mesh sizes, config, sequence parallel)
LAYOUTS_WORLD2 = {"tp1_etp2": (dict(dp=2, etp=2), "moe", False)}
FSDP_LAYOUTS = {"fsdp_ep2_dp4": dict(dp=4, ep=2), "fsdp_ep4_dp4": dict(dp=4, ep=4), "fsdp_etp2_dp4": dict(dp=4, etp=2),
                "fsdp_ep2_dp4_overlap": dict(dp=4, ep=2)}  # *_overlap: with --overlap-moe-expert-parallel-comm
FSDP_STEPS = ("fsdp_ep2_dp4", "fsdp_etp2_dp4")
# name: (mesh sizes, sequence parallel, distributed optimizer), all with MOE_BIAS
STEPS = {"ep2_etp2_distopt": (EP2_TP2, False, True), "etp2_sp": (TP2, True, False),
         "tp1_etp2_ep2_distopt": (ETP2_EP2_DP4, False, True), "tp4_etp2_sp": (TP4_ETP2, True, False)}  # fmt: skip


def _full(tensor: torch.Tensor, meta, mesh: Mesh) -> torch.Tensor:
    """The one-process tensor from this rank's part: FSDP's shard gathered over its mesh, then tp and ep."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return gather_full(tensor.detach().clone(), meta, mesh)


def _fsdp_runner(mesh: Mesh, config):
    parallel = ParallelConfig(expert_parallel=mesh.ep, fsdp=True)
    return runner_for(_build(config), mesh, parallel, TRAIN, torch.float32)


def _fsdp_train_step(mesh: Mesh, config: str = "moe") -> dict:
    """``_train_step``'s loss, balancing terms and gradients, under FSDP2 (gradients are DTensor shards)."""
    runner = _fsdp_runner(mesh, CONFIGS[config])
    batches = _micro_batches()
    runner.optimizer.zero_grad()
    loss = runner.forward_backward([batches[i] for i in range(MICRO_BATCHES)[mesh.dp_rank :: mesh.dp]])
    runner.finalize_grads()
    grads = {n: _full(p.grad, runner.metas[n], mesh) for n, p in runner.model.named_parameters()}
    return {"loss": (loss.total / loss.count).item(), "aux": {k: v.item() for k, v in loss.aux.items()}, "grads": grads}


def _step(runner, save_dir: str) -> dict:
    """One training step of this rank's micro batches -> grad norm, full params and expert
    biases after it; the state is saved as a checkpoint in ``save_dir``."""
    mesh = runner.mesh
    batches = _micro_batches()
    runner.optimizer.zero_grad()
    runner.forward_backward([batches[i] for i in range(MICRO_BATCHES)[mesh.dp_rank :: mesh.dp]])
    runner.finalize_grads()
    result = runner.optimizer.step(TRAIN.lr)
    runner.after_step()
    params = {n: _full(p, runner.metas[n], mesh) for n, p in runner.model.named_parameters()}
    biases = {n: b.clone() for n, b in runner.model.named_buffers() if n.endswith("expert_bias")}
    save_checkpoint(save_dir, 1, runner.model, runner.optimizer, {}, mesh, metas=runner.metas)
    return {"grad_norm": result.grad_norm, "params": params, "biases": biases}


def _zero_tokens(mesh: Mesh, dispatcher: str) -> dict:
    """``test_expert_parallel``'s rows (rank 1 sends none, experts 1 and 2 receive none) through
    ep2 x etp2 experts under sequence parallelism: outputs, input gradients, whole weight gradients."""
    whole = _zero_token_experts()
    experts = ExpertParallelExperts(whole, mesh, dispatcher, Halves(2), sequence_parallel=True)
    x, sizes, weighting = _zero_token_inputs(mesh.rank)
    x.requires_grad_(True)
    out = experts(x, sizes)
    (out * weighting).sum().backward()
    grads = {}
    for name, param in experts.named_parameters():
        dim, layout = expert_tensor_parallel_split(name, Halves(2))
        meta = ParamMeta(tuple(getattr(whole, name).shape), tp_dim=dim, layout=layout, tp_size=mesh.etp, tp_rank=mesh.etp_rank,
                         ep_size=mesh.ep, ep_rank=mesh.ep_rank, split_over="etp")  # fmt: skip
        grads[name] = gather_full(param.grad, meta, mesh)
    return {"out": out.detach(), "x_grad": x.grad, "grads": grads}


def _mesh(rank: int, sizes: dict) -> Mesh:
    mesh = Mesh(**sizes, rank=rank)
    mesh.init_process_groups()
    return mesh


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    out = {}
    for name, (sizes, config, sp) in LAYOUTS.items():
        mesh = _mesh(rank, sizes)
        runner, out[name] = _train_step(_build(CONFIGS[config]), mesh, _parallel(mesh, sp))
        out[name]["local_shapes"] = {n: tuple(p.shape) for n, p in runner.model.named_parameters()}
    for name, sizes in FSDP_LAYOUTS.items():
        out[name] = _fsdp_train_step(_mesh(rank, sizes), "overlap" if name.endswith("_overlap") else "moe")
    for name, (sizes, sp, distributed) in STEPS.items():
        mesh = _mesh(rank, sizes)
        out[f"step/{name}"] = _step(_bias_runner(mesh, sp, distributed), f"{tmp}/step_{name}")
    for name in FSDP_STEPS:
        mesh = _mesh(rank, FSDP_LAYOUTS[name])
        out[f"step/{name}"] = _step(_fsdp_runner(mesh, MOE_BIAS), f"{tmp}/step_{name}")
    mesh = _mesh(rank, FSDP_LAYOUTS["fsdp_ep2_dp4"])
    runner = _fsdp_runner(mesh, MOE_BIAS)  # one process's checkpoint into FSDP2 ep2, saved again
    load_checkpoint(f"{tmp}/one_process", runner.model, runner.optimizer, load_rng=False, mesh=mesh, metas=runner.metas)
    save_checkpoint(f"{tmp}/reloaded_fsdp", 1, runner.model, runner.optimizer, {}, mesh, metas=runner.metas)
    # One process's checkpoint (saved by pytest's process before the spawn) into ep2 x etp2.
    mesh = _mesh(rank, EP2_TP2)
    _reload(mesh, f"{tmp}/one_process", f"{tmp}/reloaded")
    for dispatcher in ("alltoall", "allgather"):
        out[f"zero/{dispatcher}"] = _zero_tokens(mesh, dispatcher)
    return out


def _worker_world2(rank: int, world_size: int) -> dict:
    out = {}
    for name, (sizes, config, sp) in LAYOUTS_WORLD2.items():
        runner, out[name] = _train_step(_build(CONFIGS[config]), (mesh := _mesh(rank, sizes)), _parallel(mesh, sp))
        out[name]["local_shapes"] = {n: tuple(p.shape) for n, p in runner.model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def runs_world2() -> dict[str, list[dict]]:
    return by_name(run_distributed(_worker_world2, 2, timeout=120.0))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("expert_tensor_parallel"))


@pytest.fixture(scope="module")
def runs(tmp) -> dict[str, list[dict]]:
    _one_process_step(tmp)  # its checkpoint is what the spawn reshards
    return by_name(run_distributed(_worker, 4, tmp, timeout=300.0))


@pytest.mark.parametrize("name", [*LAYOUTS, *FSDP_LAYOUTS])
def test_expert_tensor_parallel_and_fsdp_match_one_process(runs, name):
    config = LAYOUTS[name][1] if name in LAYOUTS else "moe"
    _check(runs[name], _reference(config), f"{name} ({config})")


@pytest.mark.parametrize("name", sorted(LAYOUTS_WORLD2))
def test_expert_tensor_parallel_over_data_parallel_ranks_matches_one_process(runs_world2, name):
    sizes, config, _ = LAYOUTS_WORLD2[name]
    _check(runs_world2[name], _reference(config), f"{name} ({config})")
    _assert_expert_shapes(runs_world2[name], name, sizes)


@pytest.mark.parametrize("name", ["etp2", "ep2_etp2", "tp1_etp2_ep2", "tp4_etp2", "tp2_etp4", "tp2_etp1_ep4_sp"])
def test_experts_are_split_over_expert_tensor_parallel(runs, name):
    """What the comparison above is about: each rank holds 1/etp of every expert's fc1 rows
    ([gate | up] halves) and fc2 columns, and 1/ep of the experts, whatever tp is."""
    _assert_expert_shapes(runs[name], name, LAYOUTS[name][0])


def _assert_expert_shapes(results: list[dict], name: str, sizes: dict) -> None:
    ref = _reference("moe")["grads"]
    experts, etp = sizes.get("ep", 1), sizes.get("etp", 1)
    for rank, r in enumerate(results):
        for pname, shape in r["local_shapes"].items():
            e, rows, cols = ref[pname].shape if pname.endswith("experts.weight1") else (0, 0, 0)
            if pname.endswith("experts.weight1"):
                assert shape == (e // experts, rows // etp, cols), f"{name} rank {rank}: {pname} {shape}"
            elif pname.endswith("experts.weight2"):
                e, rows, cols = ref[pname].shape
                assert shape == (e // experts, rows, cols // etp), f"{name} rank {rank}: {pname} {shape}"


@pytest.mark.parametrize("name", [*STEPS, *FSDP_STEPS])
def test_optimizer_step_and_checkpoint_match_one_process(runs, tmp, name):
    ref = _one_process_step(tmp)
    assert ref["grad_norm"] > TRAIN.clip_grad  # clipping is active: the norm matters
    for rank, r in enumerate(runs[f"step/{name}"]):
        assert abs(r["grad_norm"] - ref["grad_norm"]) <= RTOL * ref["grad_norm"], f"{name} rank {rank}: grad norm"
        for bname, bias in ref["biases"].items():
            assert torch.equal(r["biases"][bname], bias), f"{name} rank {rank}: {bname}"
        for pname, param in r["params"].items():
            err = (param - ref["params"][pname]).norm() / ref["params"][pname].norm()
            assert err <= STEP_RTOL, f"{name} rank {rank}: {pname} after the step, relative error {err:.2e}"
    _assert_same_state(_state_in_one_process(f"{tmp}/step_{name}"), ref["state"], f"{name} checkpoint, loaded in one process")


def _continue_in_one_process(load_dir: str) -> tuple[float, float]:
    """A second step (the same batches again) of a one-process runner from the checkpoint in
    ``load_dir``: its loss and gradient norm."""
    runner = _bias_runner(Mesh())
    load_checkpoint(load_dir, runner.model, runner.optimizer, load_rng=False, metas=runner.metas)
    runner.optimizer.zero_grad()
    loss = runner.forward_backward(_micro_batches())
    runner.finalize_grads()
    return (loss.total / loss.count).item(), runner.optimizer.step(TRAIN.lr).grad_norm


@pytest.mark.parametrize("name", [*STEPS, *FSDP_STEPS])
def test_checkpoint_continues_in_one_process(runs, tmp, name):
    """Resharding to one process continues with the one-process run's next loss and norm."""
    _one_process_step(tmp)
    loss, norm = _continue_in_one_process(f"{tmp}/step_{name}")
    ref_loss, ref_norm = _continue_in_one_process(f"{tmp}/one_process")
    assert abs(loss - ref_loss) <= RTOL * ref_loss and abs(norm - ref_norm) <= RTOL * ref_norm, (loss, ref_loss, norm, ref_norm)


@pytest.mark.parametrize("name", ["reloaded", "reloaded_fsdp"])
def test_one_process_checkpoint_loads_into_expert_layouts(runs, tmp, name):
    """1 -> ep2 x etp2 (distributed optimizer) or FSDP2 ep2 -> 1 reads back the same state."""
    _assert_same_state(_state_in_one_process(f"{tmp}/{name}"), _one_process_step(tmp)["state"], f"1 -> {name} -> 1")


@pytest.mark.parametrize("layout", ["ep2_etp2", "tp1_etp2_ep2"])
def test_dispatchers_are_bit_identical_under_expert_tensor_parallelism(runs, layout):
    _assert_bit_identical(runs[layout], runs[f"{layout}_allgather"], f"{layout}: alltoall vs allgather")


@pytest.mark.parametrize("layout", ["ep2_etp2", "tp1_etp2_ep2", "fsdp_ep2_dp4"])
def test_overlapped_all_to_all_is_bit_identical_under_expert_tensor_parallelism(runs, layout):
    """etp = tp (rows shared by the etp group), etp over dp ranks (rows gathered over etp per
    chunk) and FSDP2 with ep2 (each chunk a slice of the unsharded expert weights)."""
    _assert_bit_identical(runs[f"{layout}_overlap"], runs[layout], f"{layout}: overlapped vs not")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ranks_and_experts_without_tokens_under_expert_tensor_parallelism(runs, dispatcher):
    """Rank 1 (an etp peer of rank 0) sends no row; experts 1 and 2 receive none: each rank's
    outputs and input gradients, and the weight gradients, equal one process's experts."""
    experts, outputs = _zero_token_reference()
    for rank, r in enumerate(runs[f"zero/{dispatcher}"]):
        _assert_rows_match(r, *outputs[rank])
        for pname, grad in r["grads"].items():
            torch.testing.assert_close(grad, getattr(experts, pname).grad, rtol=RTOL, atol=1e-6)
            assert not grad[1:3].any(), "experts 1 and 2 received no token but have a gradient"
