"""The ``deepseek-v3`` preset's sizes, read off the meta build (``models/sizes.py``): DeepSeek's
published counts (README_WEIGHTS.md of deepseek-ai/DeepSeek-V3: 671 B main model, 36.6 B active
with the 0.9 B output head; 11.5 B of its own in the prediction depth), and ``meshtron estimate``
on the CPU for a 256-GPU layout, which builds nothing whole."""

from __future__ import annotations

import dataclasses
import re

import torch

from meshtron.cli import main
from meshtron.config import build_config
from meshtron.models import parameter_count
from meshtron.models.mtp import mtp_parameter_count

VOCAB, SEQ = 129280, 4096
# Hugging Face's count of the main model's tensors, which includes each MoE layer's expert bias
# (a buffer here: 58 layers x 256 experts).
HUB_MAIN_TENSORS = 671_026_419_200


def test_counts_are_deepseeks():
    m = build_config(overrides=["--model.preset", "deepseek-v3"]).model
    total, depth = parameter_count(m, VOCAB, SEQ), mtp_parameter_count(m, VOCAB, SEQ)
    assert total - depth == HUB_MAIN_TENSORS - 58 * 256
    assert 11.5e9 < depth < 11.7e9
    main_model = dataclasses.replace(m, mtp_num_layers=0)
    active_without_input_embedding = parameter_count(main_model, VOCAB, SEQ, active=True) - VOCAB * m.hidden_size
    assert abs(active_without_input_embedding / 36.6e9 - 1) < 0.005


def test_estimate_command_on_the_cpu(capsys, monkeypatch):
    """No tensor with storage beyond a few megabytes is made: the sizes come from the meta build."""
    made = []
    empty = torch.empty

    def counted(*args, **kwargs):
        out = empty(*args, **kwargs)
        if out.device.type != "meta":
            made.append(out.numel())
        return out

    monkeypatch.setattr(torch, "empty", counted)
    assert main(["estimate", "--preset", "deepseek-v3", "--world-size", "256", "--pp", "8", "--ep", "32", "--use-distributed-optimizer",
                 "--bf16", "--micro-batch-size", "1", "--global-batch-size", "256"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "682.64 B parameters (671.03 B main model, 11.61 B in 1 multi-token prediction depth), 38.24 B active per token" in out
    assert "256 experts, top-8, 8 per ep rank" in out and "ep 32, etp 1, edp 1" in out
    total_gib = float(re.search(r"total +([\d.]+) GiB", out).group(1))
    assert 50 < total_gib < 400  # one H100-class rank's order of magnitude, not the whole model's 12 TiB
    assert max(made, default=0) < 2**22


def test_estimate_counts_the_depths_where_they_run():
    """At pp 1 each depth keeps one more block of the last one's kind and one more output-layer call;
    with pp > 1 they run on the last stage, whose modeled cost (the head's) they raise, so the
    cost-balanced split gives the first stage more of the blocks."""
    from meshtron.estimate import activation_bytes, block_activations, first_stage_blocks, loss_bytes

    def cfg(depths: int, *flags: str):
        return build_config(overrides=["--preset", "tiny-deepseek-v3", "--vocab-size", "512", "--mtp-num-layers", str(depths),
                                       "--micro-batch-size", "2", "--global-batch-size", "8", *flags])  # fmt: skip

    last_block = block_activations(cfg(0))[-1][1]
    assert activation_bytes(cfg(2)) - activation_bytes(cfg(0)) == int(2 * last_block)
    assert loss_bytes(cfg(2)) > loss_bytes(cfg(1)) > loss_bytes(cfg(0))
    first = [first_stage_blocks(cfg(depths, "--pp", "2"), 4, 2) for depths in (0, 2)]
    assert len(first[1]) > len(first[0]), first
