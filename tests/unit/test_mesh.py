"""The rank grid (no processes), model-fit validation, and the one-process degenerate mesh."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.checkpoint.sharded import save_state
from meshtron.config import ConfigError, ModelConfig, ParallelConfig, build_config
from meshtron.models import build_model
from meshtron.parallel.mesh import GROUP_DIMS, Mesh, launch_env
from meshtron.parallel.plan import parallelize
from meshtron.validation import validate
from meshtron.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


def test_world8_tp2_dp2_pp2_groups_written_out():
    mesh = Mesh.from_config(ParallelConfig(tensor_parallel=2, pipeline_parallel=2), world_size=8, rank=5)
    assert (mesh.tp, mesh.cp, mesh.dp, mesh.pp) == (2, 1, 2, 2)
    assert mesh.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.group_ranks("cp") == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert mesh.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.group_ranks("dp_cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.group_ranks("ep") == [[r] for r in range(8)]
    # rank 5 = tp 1 + 2 * (dp 0) + 4 * (pp 1)
    assert (mesh.tp_rank, mesh.cp_rank, mesh.dp_rank, mesh.pp_rank) == (1, 0, 0, 1)
    assert mesh.pp_rank == mesh.pp - 1 and not mesh.is_first_stage
    text = mesh.describe()
    assert "tp groups: [0, 1] [2, 3] [4, 5] [6, 7]" in text and "pp groups: [0, 4] [1, 5] [2, 6] [3, 7]" in text


def test_cp_and_ep_fold_inside_dp():
    # world 8 = tp 1 x cp 2 x dp 4; ep 4 takes runs of 4 consecutive dp x cp ranks.
    mesh = Mesh.from_config(ParallelConfig(context_parallel=2, expert_parallel=4), world_size=8, rank=6)
    assert mesh.group_ranks("cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.group_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh.group_ranks("dp_cp") == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert mesh.group_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.group_ranks("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (mesh.ep_rank, mesh.edp_rank, mesh.ep, mesh.edp) == (2, 1, 4, 2)
    # With tp 2 and etp 2 the same blocks are formed among ranks of equal tp rank.
    mesh = Mesh.from_config(ParallelConfig(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=2), world_size=8)
    assert mesh.group_ranks("etp") == mesh.group_ranks("tp")
    assert mesh.group_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.group_ranks("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("etp", [1, 2, 4])
def test_every_dimension_partitions_the_world(etp):
    mesh = Mesh(tp=2, cp=2, dp=3, pp=2, ep=3, etp=etp)
    for dim in GROUP_DIMS:
        groups = mesh.group_ranks(dim)
        assert sorted(r for g in groups for r in g) == list(range(24)), dim
        assert {len(g) for g in groups} == {mesh.size(dim)}, dim
        for g in groups:
            assert [mesh.coords(r)[dim] for r in g] == list(range(len(g))), dim
    # Both grids share pp: a pipeline stage's ranks are the same for dense layers and experts.
    for dim in ("etp", "ep", "edp", "etp_ep"):
        assert all(len({mesh.coords(r)["pp"] for r in g}) == 1 for g in mesh.group_ranks(dim)), dim


def test_expert_grid_written_out():
    """Megatron-Core's expert grid (etp fastest, then ep, then edp, pp slowest) by hand."""
    # world 8, tp 2, etp 1, ep 4: ep takes runs of 4 ranks across tp pairs; edp pairs the runs.
    mesh = Mesh(tp=2, dp=4, ep=4, etp=1, rank=6)
    assert mesh.group_ranks("etp") == [[r] for r in range(8)]
    assert mesh.group_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.group_ranks("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (mesh.etp_rank, mesh.ep_rank, mesh.edp_rank) == (0, 2, 1)
    # tp 1, etp 2 (world 2): the experts' FFN split over two data-parallel ranks.
    mesh = Mesh(tp=1, dp=2, etp=2)
    assert mesh.group_ranks("etp") == mesh.group_ranks("dp") == [[0, 1]] and mesh.edp == 1
    # tp 4, etp 2: etp groups are halves of the tp group; edp joins the other half.
    mesh = Mesh(tp=4, etp=2, rank=3)
    assert mesh.group_ranks("etp") == [[0, 1], [2, 3]] and mesh.group_ranks("edp") == [[0, 2], [1, 3]]
    assert (mesh.etp_rank, mesh.edp_rank) == (1, 1)
    # tp 2, etp 4, ep 2, pp 2 (world 16): etp spans two tp groups, ep the next two, per stage.
    mesh = Mesh(tp=2, dp=4, pp=2, ep=2, etp=4)
    assert mesh.group_ranks("etp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert mesh.group_ranks("ep") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert mesh.group_ranks("edp") == [[r] for r in range(16)]
    assert mesh.group_ranks("etp_ep") == [list(range(8)), list(range(8, 16))]
    assert "experts: etp 4 x ep 2 x edp 1 x pp 2" in mesh.describe()
    with pytest.raises(ConfigError, match="expert parallel size 2 x expert tensor parallel size 4 must divide the 4 ranks"):
        Mesh(tp=4, ep=2, etp=4)


def test_layout_errors_say_what_to_change():
    with pytest.raises(ConfigError, match="world size 6 is not a multiple of tp 4"):
        Mesh.from_config(ParallelConfig(tensor_parallel=4), world_size=6, rank=0)
    with pytest.raises(ConfigError, match="expert parallel size 3 x expert tensor parallel size 1 must divide the 4 ranks"):
        Mesh.from_config(ParallelConfig(expert_parallel=3), world_size=4, rank=0)


def test_launch_env_torchrun_then_slurm(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    assert launch_env() == (1, 0, 0)
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_PROCID", "9")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert launch_env() == (16, 9, 1)
    mesh = Mesh.from_config(ParallelConfig(tensor_parallel=8))
    assert (mesh.world_size, mesh.rank, mesh.local_rank, mesh.tp_rank, mesh.dp_rank) == (16, 9, 1, 1, 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert launch_env() == (4, 3, 3)


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(**{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, **kw})


def _fits(tp: int, *flags: str) -> None:
    """Validate a tiny model's flags for a world of ``tp`` ranks, all tensor parallel."""
    base = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--global-batch-size", "8", "--micro-batch-size", "8", "--tp", str(tp)]  # fmt: skip
    validate(build_config(None, base + list(flags)), world_size=tp)


def test_model_fits_the_layout_before_any_process_group():
    _fits(2, "--num-query-groups", "2")
    _fits(2, "--num-query-groups", "1")  # kv heads replicated on both ranks
    _fits(4, "--num-query-groups", "2")  # each kv head on two ranks
    with pytest.raises(ConfigError, match="--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"):
        _fits(8)
    with pytest.raises(ConfigError, match="--num-query-groups 3 .* must divide"):
        _fits(2, "--hidden-size", "96", "--num-attention-heads", "6", "--num-query-groups", "3")
    with pytest.raises(ConfigError, match="ffn-hidden-size"):
        _fits(4, "--ffn-hidden-size", "90")
    with pytest.raises(ConfigError, match="--seq-length 30"):
        _fits(4, "--seq-length", "30", "--sequence-parallel")
    with pytest.raises(ConfigError, match="2 x --context-parallel-size"):
        validate(build_config(None, ["--mock-data", "--cp", "2", "--seq-length", "30"]), world_size=2)
    with pytest.raises(ConfigError, match="--attention-dropout 0"):
        validate(build_config(None, ["--mock-data", "--cp", "2", "--attention-dropout", "0.1"]), world_size=2)
    with pytest.raises(ConfigError, match="pipeline stage split"):
        validate(build_config(None, ["--mock-data", "--pp", "4", "--num-layers", "2"]), world_size=4)


def test_expert_parallel_layouts_are_checked():
    """ep > 1 used to build groups and train a dense model: refused. With experts, ep must divide
    them, ep x etp the ranks of a pipeline stage; etp must divide those ranks and the expert FFN;
    ep, etp below, equal to and above tp, FSDP with ep, sequence parallelism, the expert bias and the balancing losses under
    context parallelism (ep carved out of dp x cp too) are accepted."""
    cfg = build_config(None, ["--mock-data", "--expert-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 2 needs a mixture-of-experts model"):
        validate(cfg, world_size=2)
    moe = ["--mock-data", "--num-experts", "4", "--disable-bias-linear"]
    for flags in (["--tp", "2"], ["--ep", "2"], ["--tp", "2", "--sequence-parallel"], ["--cp", "2"],
                  ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"],
                  ["--tp", "2", "--expert-tensor-parallel-size", "2"], ["--expert-tensor-parallel-size", "2"],
                  ["--tp", "2", "--expert-tensor-parallel-size", "1", "--ep", "2"], ["--ep", "2", "--use-torch-fsdp2"],
                  ["--cp", "2", "--ep", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"],
                  ["--cp", "2", "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3"]):  # fmt: skip
        validate(build_config(None, moe + flags), world_size=2)
    validate(build_config(None, moe + ["--ep", "4", "--moe-token-dispatcher-type", "allgather", "--global-batch-size", "32"]), world_size=4)
    for flags in (["--tp", "4", "--expert-tensor-parallel-size", "2"], ["--tp", "2", "--expert-tensor-parallel-size", "4"],
                  ["--ep", "2", "--expert-tensor-parallel-size", "2", "--global-batch-size", "32"]):  # fmt: skip
        validate(build_config(None, moe + flags), world_size=4)
    for flags, world, message in ((["--ep", "4"], 2, "--expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 = 4 must "
                                   "divide the 2 ranks of a pipeline stage"),
                                  (["--ep", "2", "--expert-tensor-parallel-size", "2"], 2, "= 4 must divide the 2 ranks"),
                                  (["--ep", "3"], 3, "must divide --num-experts 4"),
                                  (["--expert-tensor-parallel-size", "3"], 2, "--expert-tensor-parallel-size 3 must divide the 2 ranks"),
                                  (["--expert-tensor-parallel-size", "0"], 2, "expert_tensor_parallel must be at least 1"),
                                  (["--tp", "2", "--expert-tensor-parallel-size", "2", "--moe-ffn-hidden-size", "33"], 2,
                                   "must divide the experts' FFN width 33"),
                                  (["--tp", "2", "--expert-tensor-parallel-size", "2", "--num-experts", "0"], 2,
                                   "--expert-tensor-parallel-size 2 needs a mixture-of-experts model"),
                                  (["--moe-token-dispatcher-type", "deepep"], 2, "alltoall or allgather")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            validate(build_config(None, moe + flags), world_size=world)


def test_sampling_after_a_sharded_run_is_refused_before_training():
    for flags in (["--tp", "2"], ["--cp", "2"], ["--pp", "2"]):
        cfg = build_config(None, ["--mock-data", "--generate-prompt", "Hello", *flags])
        with pytest.raises(ConfigError, match="meshtron generate --load"):
            validate(cfg, world_size=2)
    validate(build_config(None, ["--mock-data", "--generate-prompt", "Hello"]), world_size=2)  # dp: every rank whole


def test_one_process_mesh_is_free():
    mesh = Mesh.from_config(ParallelConfig(), world_size=1, rank=0)
    mesh.init_process_groups()  # no torch.distributed needed
    assert (mesh.tp, mesh.tp_rank, mesh.tp_group, mesh.dp_cp_group) == (1, 0, None, None)
    assert mesh.is_first_stage and mesh.pp_rank == mesh.pp - 1

    torch.manual_seed(0)
    model = build_model(_cfg(vocab_size=128), 128, 8)
    modules = dict(model.named_modules())
    metas = parallelize(model, mesh, sequence_parallel=True)
    assert all(modules[n] is m for n, m in model.named_modules()), "nothing is replaced at tp = cp = 1"
    assert metas.keys() == dict(model.named_parameters()).keys()
    assert {k.removeprefix("model.") for k in save_state(model, None, mesh, with_optimizer=False, metas=metas)} == model.state_dict().keys()

    x = torch.randn(2, 8, 16)
    col = ColumnParallelLinear(16, 12, True, None)
    row = RowParallelLinear(12, 16, True, None, sequence_parallel=True)
    emb = VocabParallelEmbedding(50, 16, None)
    for param in (*col.parameters(), *row.parameters(), *emb.parameters()):
        torch.nn.init.normal_(param)  # torch.empty may hold NaN, which would never compare equal
    assert torch.equal(col(x), F.linear(x, col.weight, col.bias))
    h = torch.randn(2, 8, 12)
    assert torch.equal(row(h), F.linear(h, row.weight, row.bias))
    ids = torch.randint(0, 50, (2, 8))
    assert torch.equal(emb(ids), F.embedding(ids, emb.weight))
    logits, labels = torch.randn(2, 8, 50), torch.randint(0, 50, (2, 8))
    labels[0, 0] = -100
    want = F.cross_entropy(logits.view(-1, 50), labels.view(-1), reduction="none").view(2, 8)
    assert torch.equal(vocab_parallel_cross_entropy(logits, labels, None), want)


def test_torchrun_restarts_over_a_shared_store_are_noted(monkeypatch):
    from meshtron.parallel.mesh import restart_store_note

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_store_note()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what torchrun tells its workers under that variable
    assert restart_store_note() is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert restart_store_note() is None
