"""BERT's fused elementwise paths against the unfused ones, whole model, on the CPU through
Triton's interpreter (fp32): the fused residual dropout + add (``--bias-dropout-fusion``) and fc1's
bias + GELU (``--bias-gelu-fusion``)."""

import os

import pytest
import torch

from meshtron.config import build_config
from meshtron.kernels import triton_available
from meshtron.models import build_model

pytestmark = pytest.mark.skipif(
    not triton_available() or torch.cuda.is_available(), reason="needs Triton, and no GPU (then tests/gpu covers it)"
)
if triton_available() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from meshtron.kernels.dropout_add import dropout_add  # noqa: E402
from meshtron.kernels.grad_accum_fusion import apply_gradient_accumulation_fusion  # noqa: E402
from meshtron.layers.mlp import enable_bias_gelu_fusion  # noqa: E402
from meshtron.models import decoder  # noqa: E402

VOCAB, SEQ, HIDDEN_DROPOUT = 96, 12, 0.2
POST_LN_BERT = ["--model-type", "bert", "--preset", "tiny-bert", "--num-layers", "2", "--hidden-size", "32",
                "--apply-residual-connection-post-layernorm", "--attention-dropout", "0", "--fused-kernels", "on",
                "--bias-gelu-fusion", "--bias-dropout-fusion"]  # fmt: skip  (off by default: model_config says why)


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.where(torch.rand(2, SEQ, generator=g) < 0.3, tokens, -100)
    labels[0, 0] = tokens[0, 0]
    return {"tokens": tokens, "types": (torch.arange(SEQ) >= 4).long().expand(2, SEQ), "padding_mask": torch.ones(2, SEQ, dtype=torch.bool),
            "labels": labels, "loss_mask": (labels >= 0).float(), "is_random": torch.tensor([0, 1])}  # fmt: skip


def _loss_and_grads(*flags: str, bias_gelu: bool = False, dropout: float = HIDDEN_DROPOUT):
    """Loss and parameter gradients of one step; ``bias_gelu``: the blocks' linears swapped as training
    swaps them (gradient-accumulation fusion's class, which falls back to the plain product without a
    gradient buffer) and the bias + GELU fusion switched on."""
    cfg = build_config(overrides=[*POST_LN_BERT, "--hidden-dropout", str(dropout), *flags]).model
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB, SEQ).train()
    if bias_gelu:
        apply_gradient_accumulation_fusion(model.layers)
        assert enable_bias_gelu_fusion(model.layers) == cfg.num_layers
    batch = _batch()
    out, _ = model.run_stage(None, batch, list(model.layers), True, True)
    loss = model.loss(batch, out)
    (loss.total / loss.count + loss.aux["sop_loss"]).backward()
    return loss.total.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_fused_dropout_add_equals_the_unfused_blocks_given_its_masks(monkeypatch):
    """The fused pass draws its masks from its own Philox stream, so the unfused model replays
    them (the elements where the fused output differs from the residual): loss and every
    parameter's gradient then agree within 1e-6 relative (fp32; the arithmetic is F.dropout's), and
    the backward used the forward's masks. Four calls: two blocks, each with two branches."""
    masks = []

    def recording(x, residual, p, training, mode):
        assert mode == "on" and training and p == HIDDEN_DROPOUT
        out = dropout_add(x, residual, p, training, mode)
        masks.append((out != residual).detach())
        return out

    monkeypatch.setattr(decoder, "dropout_add", recording)
    fused_loss, fused_grads = _loss_and_grads()
    assert len(masks) == 4 and all(0.5 < m.float().mean() < 0.95 for m in masks)
    replay = iter(masks)

    def replaying(x, residual, p, training, mode):
        assert mode == "off"
        return residual + x * next(replay) * (1 / (1 - p))

    monkeypatch.setattr(decoder, "dropout_add", replaying)
    loss, grads = _loss_and_grads("--no-bias-dropout-fusion")
    torch.testing.assert_close(fused_loss, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-6, atol=1e-9, msg=name)


def test_unfused_flag_runs_the_reference():
    """Megatron's ``--no-bias-dropout-fusion`` turns the fused pass off: the blocks run F.dropout;
    so does leaving ``--bias-dropout-fusion`` out (the default, slower kernels)."""
    cfg = build_config(overrides=[*POST_LN_BERT, "--no-bias-dropout-fusion"]).model
    assert not cfg.bias_dropout_fusion
    assert build_model(cfg, VOCAB, SEQ).layers[0].dropout_add_kernels == "off"
    assert build_model(build_config(overrides=POST_LN_BERT).model, VOCAB, SEQ).layers[0].dropout_add_kernels == "on"
    default = [flag for flag in POST_LN_BERT if flag not in ("--bias-gelu-fusion", "--bias-dropout-fusion")]
    assert build_model(build_config(overrides=default).model, VOCAB, SEQ).layers[0].dropout_add_kernels == "off"


def test_fused_bias_gelu_equals_the_unfused_mlp():
    """fc1 without its bias, then bias + GELU in one kernel whose backward sums the bias gradient:
    loss and every gradient as the plain linear + F.gelu within 1e-5 relative (fp32; only
    the order of the bias gradient's sum differs). No dropout, so nothing else differs."""
    fused_loss, fused_grads = _loss_and_grads(bias_gelu=True, dropout=0.0)
    loss, grads = _loss_and_grads(dropout=0.0)
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert "layers.0.mlp.linear_fc1.bias" in grads


def _column_parallel(linear):
    from meshtron.parallel.tensor_parallel import ColumnParallelLinear

    new = ColumnParallelLinear(linear.in_features, linear.out_features, True, None)
    new.weight, new.bias = linear.weight, linear.bias
    return new


def _fp8_class(linear):
    from meshtron.kernels.fp8 import Fp8Linear
    from meshtron.kernels.linear_swap import with_parameters_of

    new = with_parameters_of(Fp8Linear, linear)
    new.fp8 = None  # its bf16 path: what matters here is where the bias goes
    return new


@pytest.mark.parametrize("swap", [_column_parallel, _fp8_class])
def test_every_linear_that_takes_the_switch_leaves_its_bias_to_the_mlp(swap):
    """The column-parallel linear (tp's, here over one rank) and FP8's class honour ``skip_bias_add``
    (gradient-accumulation fusion's is the model test's): the MLP's output and fc1's gradients are
    the unfused MLP's; a plain ``nn.Linear`` is left alone."""
    from meshtron.layers.mlp import MLP

    cfg = build_config(overrides=POST_LN_BERT).model
    torch.manual_seed(0)
    mlp = MLP(cfg)
    x = torch.randn(2, 5, cfg.hidden_size)
    assert enable_bias_gelu_fusion(mlp) == 0
    expected = mlp(x)
    expected.square().sum().backward()
    reference_grads = [p.grad.clone() for p in mlp.linear_fc1.parameters()]
    mlp.zero_grad()
    mlp.linear_fc1 = swap(mlp.linear_fc1)
    assert enable_bias_gelu_fusion(mlp) == 1
    out = mlp(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for grad, reference in zip((p.grad for p in mlp.linear_fc1.parameters()), reference_grads):
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags, switched", [((), True), (("--no-bias-gelu-fusion",), False), (("--compile",), False)])
def test_the_runner_switches_bias_gelu_on_where_it_applies(flags, switched):
    """Training's block preparation (``parallel/setup.py``) switches the fusion on where the kernels
    run (here ``--fused-kernels on``, the interpreter), not with ``--no-bias-gelu-fusion``, not under
    ``--compile`` (inductor fuses those ops itself)."""
    from meshtron.parallel.mesh import Mesh
    from meshtron.parallel.setup import build_runner

    cfg = build_config(overrides=[*POST_LN_BERT, "--vocab-size", str(VOCAB), "--seq-length", str(SEQ), "--micro-batch-size", "1",
                                  "--global-batch-size", "1", "--device", "cpu", "--fp32", *flags])  # fmt: skip
    mesh = Mesh.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0)
    runner = build_runner(cfg, mesh, 128, torch.device("cpu"), torch.float32)
    assert [getattr(block.mlp.linear_fc1, "skip_bias_add", False) for block in runner.model.layers] == [switched] * 2
