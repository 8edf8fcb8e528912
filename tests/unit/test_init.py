"""Layout-invariant initialization (``models/init.py``): a rank's shard, drawn alone, equals the
same rows or columns of the whole tensor, for every split the plans use; a meta-built model
materialized in one process equals the model built whole, bit for bit."""

import math

import pytest
import torch

from meshtron.config import build_config
from meshtron.models import build_model
from meshtron.models.contract import Contiguous, GroupedHeads, Halves, ParamMeta
from meshtron.models.init import CHUNK_ELEMENTS, WeightInit, _draw, materialize

SHAPES = [(96, 40), (CHUNK_ELEMENTS // 8 + 3, 16), (7, CHUNK_ELEMENTS // 2 + 5), (33,)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout,dim,tp", [(Contiguous(), 0, 4), (Contiguous(), 1, 2), (Halves(2), 0, 2),
                                           (GroupedHeads(2, 2, 12), 0, 4)])  # fmt: skip
def test_a_shard_drawn_alone_is_the_shard_of_the_whole(shape, layout, dim, tp):
    grouped_rows = isinstance(layout, GroupedHeads) and shape[0] == (2 * 2 + 2 * 2) * 12  # 2 kv groups of 2 queries, head dim 12
    if dim >= len(shape) or not layout.divisible(shape[dim], tp) or (isinstance(layout, GroupedHeads) and not grouped_rows):
        pytest.skip("the split does not apply to this shape")
    def draw(name="w", seed=3, index=None):
        out = torch.empty(shape) if index is None else torch.empty(shape).index_select(dim, index)
        _draw(name, seed, 0.02, shape, dim, index, out)
        return out

    whole = draw()
    for rank in range(tp):
        index = layout.local_index(shape[dim], tp, rank)
        torch.testing.assert_close(draw(index=index), whole.index_select(dim, index), rtol=0, atol=0)
    assert math.isclose(whole.std().item(), 0.02, rel_tol=0.2)
    assert not torch.equal(whole, draw(name="w2"))  # keyed by name
    assert not torch.equal(whole, draw(seed=4))  # and by seed


def test_experts_draw_per_global_expert_under_ep_and_etp():
    """Stacked experts [E, ffn, h]: ep takes a run of experts, etp a run of each expert's rows."""
    rule = WeightInit(0.02, 0.01, (), ("experts.weight1",))
    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.weight1 = torch.nn.Parameter(torch.empty(4, 8, 6, device="meta"))
    whole = ParamMeta((4, 8, 6))
    materialize(model, {"experts.weight1": whole}, rule, torch.device("cpu"), seed=5)
    full = model.experts.weight1.detach().clone()
    model.experts.weight1 = torch.nn.Parameter(torch.empty(2, 4, 6, device="meta"))
    part = ParamMeta((4, 8, 6), tp_dim=1, layout=Contiguous(), tp_size=2, tp_rank=1, ep_size=2, ep_rank=1, split_over="etp")
    materialize(model, {"experts.weight1": part}, rule, torch.device("cpu"), seed=5)
    torch.testing.assert_close(model.experts.weight1.detach(), full[2:, 4:], rtol=0, atol=0)
    assert not torch.equal(full[0], full[1])


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mixtral", "tiny-deepseek", "tiny-bert", "tiny-t5", "tiny-ict"])
def test_meta_build_materialized_equals_the_whole_build(preset):
    cfg = build_config(None, ["--preset", preset]).model
    torch.manual_seed(11)
    eager = build_model(cfg, 96, 64)
    with torch.device("meta"):
        lazy = build_model(cfg, 96, 64)
    assert all(p.is_meta for p in lazy.parameters())
    materialize(lazy, {}, lazy.weight_init, torch.device("cpu"), seed=11)
    state = lazy.state_dict()
    for name, tensor in eager.state_dict().items():
        assert torch.equal(state[name], tensor), name
    norms = [p for n, p in eager.named_parameters() if "norm" in n and n.endswith("weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)


@pytest.mark.parametrize("preset", ["olmoe-1b-7b", "llama3-8b", "deepseek-v2-lite", "bert-large", "t5-base"])
def test_every_norm_gain_starts_at_one(preset):
    """Each norm's gain is 1 at initialization, the full-width q/k norms (OLMoE's) among them: drawn
    as a weight, N(0, 0.02), they scaled every query and key by ~0.02 and left attention uniform."""
    from meshtron.models.init import norm_parameters

    cfg = build_config(None, ["--model.preset", preset, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                              "--ffn-hidden-size", "64", "--vocab-size", "128", "--seq-length", "16"])  # fmt: skip
    if cfg.model.num_experts:
        cfg.model.num_experts, cfg.model.moe_ffn_hidden_size = 4, 32
    model = build_model(cfg.model, 128, 16)
    norms = norm_parameters(model)
    gains = {name: p for name, p in model.named_parameters() if "norm" in name and name.endswith("weight")}
    assert gains and all(id(p) in norms for p in gains.values())
    assert [name for name, p in gains.items() if not torch.equal(p, torch.ones_like(p))] == []
