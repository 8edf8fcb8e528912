"""Activation recompute changes memory, never numbers: losses and gradients equal a plain run,
the mixture-of-experts layer's own recompute (``--moe-layer-recompute``) included."""

import dataclasses

import pytest
import torch

from meshtron.config import build_config
from meshtron.layers.moe import MoELayer
from meshtron.models import build_model

SETTINGS = [
    ("selective", "uniform", 1),
    ("full", "uniform", 1),
    ("full", "uniform", 3),  # groups that do not divide the layers: the last group is shorter
    ("full", "block", 1),
    ("full", "block", 9),  # more than the layers: all of them
]


def _run(preset: str, dropout: float, document_ids: bool, **fields):
    cfg = build_config(overrides=["--model.preset", preset, "--num-layers", "4"]).model
    cfg = dataclasses.replace(cfg, hidden_dropout=dropout, attention_dropout=dropout, **fields)
    torch.manual_seed(0)
    model = build_model(cfg, 96, 32)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 96, (2, 32), generator=gen)
    docs = torch.cumsum(torch.rand(2, 32, generator=gen) < 0.1, dim=1) if document_ids else None
    torch.manual_seed(2)  # the dropout masks (and a router's jitter or random logits)
    loss = model(tokens, document_ids=docs, labels=torch.roll(tokens, -1, 1))
    # The balancing and z-losses the forward set (a rerun in backward keeps none: models/recompute.py).
    aux = sum(sum(m.last_aux_losses.values()) for m in model.modules() if isinstance(m, MoELayer))
    (loss.sum() + aux).backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("granularity,method,num_layers", SETTINGS)
@pytest.mark.parametrize("preset,dropout,document_ids", [("tiny-llama", 0.0, True), ("tiny-gpt", 0.1, False)])
def test_recompute_gradients_identical(preset, dropout, document_ids, granularity, method, num_layers):
    ref_loss, ref_grads = _run(preset, dropout, document_ids)
    loss, grads = _run(preset, dropout, document_ids, recompute_granularity=granularity,
                       recompute_method=method, recompute_num_layers=num_layers)  # fmt: skip
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name


def test_recompute_off_without_gradients():
    """Evaluation and generation (no autograd) run the plain path: nothing to recompute."""
    cfg = dataclasses.replace(build_config(overrides=["--model.preset", "tiny-llama"]).model, recompute_granularity="full")
    model = build_model(cfg, 96, 16)
    tokens = torch.randint(0, 96, (1, 16))
    with torch.no_grad():
        assert model(tokens).shape == (1, 16, 96)


MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=32, moe_layer_freq="([0]+[1]*3)",
           moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3, moe_jitter_eps=0.01)  # fmt: skip


@pytest.mark.parametrize("extra", [{}, {"moe_router_force_load_balancing": True, "moe_router_score_function": "sigmoid"},
                                   {"recompute_granularity": "full", "recompute_num_layers": 2}])  # fmt: skip
def test_moe_layer_recompute_gradients_identical(extra):
    """The MoE layers rerun in backward (inside full recompute too): same routing (the jitter's
    and the random logits' draws replayed), same loss and gradients, bit for bit."""
    ref_loss, ref_grads = _run("tiny-llama", 0.1, False, **MOE, **extra)
    loss, grads = _run("tiny-llama", 0.1, False, **MOE, **extra, moe_layer_recompute=True)
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name


def test_moe_layer_recompute_keeps_only_the_layer_input():
    """What autograd keeps for a MoE block with the layer recomputed: its MLP part shrinks to the
    input the checkpoint holds (the attention part is unchanged)."""
    def kept_bytes(**fields) -> int:
        cfg = dataclasses.replace(build_config(overrides=["--model.preset", "tiny-llama"]).model, **{**MOE, "moe_layer_freq": "1"}, num_layers=1, **fields)
        torch.manual_seed(0)
        model = build_model(cfg, 96, 32)
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, 96, (2, 32)), labels=torch.randint(0, 96, (2, 32)))
        return total[0]

    plain, recomputed = kept_bytes(), kept_bytes(moe_layer_recompute=True)
    assert recomputed < plain / 2, (plain, recomputed)


def test_megatron_recompute_modules():
    """``--recompute-modules`` (Megatron-Core's): moe is the MoE layer's recompute, core_attn the
    core attention's (the default); the modules meshtron keeps are accepted and said at start-up;
    unknown names and a granularity other than selective are refused."""
    from meshtron.config import recomputes_core_attention
    from meshtron.errors import ConfigError
    from meshtron.flags import noted_flag_lines
    from meshtron.validation import validate

    base = ["--preset", "tiny-mixtral", "--mock-data"]
    cfg = build_config(overrides=[*base, "--recompute-granularity", "selective", "--recompute-modules", "moe", "moe_act", "layernorm"])
    validate(cfg)
    assert cfg.model.moe_layer_recompute and not recomputes_core_attention(cfg.model)
    assert noted_flag_lines(cfg.logging.noted_flags) == [
        "--recompute-modules moe_act layernorm: not recomputed, their activations are kept (meshtron estimate counts them); "
        "meshtron recomputes core_attn and moe"]  # fmt: skip
    default = build_config(overrides=[*base, "--recompute-granularity", "selective"])
    assert recomputes_core_attention(default.model) and not default.model.moe_layer_recompute
    for flags, message in ((["--recompute-granularity", "selective", "--recompute-modules", "attn"], "unknown attn"),
                           (["--recompute-modules", "moe"], "needs --recompute-granularity selective")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            validate(build_config(overrides=[*base, *flags]))


@pytest.mark.parametrize("flags", [["--moe-layer-recompute"], ["--recompute-granularity", "selective", "--recompute-modules", "moe"]])
def test_moe_layer_recompute_without_experts_is_refused(flags):
    """A dense model has no MoE layer to rerun: said before anything is built, not silently ignored."""
    from meshtron.errors import ConfigError
    from meshtron.validation import validate

    with pytest.raises(ConfigError, match="this model has none; drop it"):
        validate(build_config(None, ["--mock-data", *flags]), world_size=1)
    validate(build_config(None, ["--preset", "tiny-mixtral", "--mock-data", *flags]), world_size=1)
