"""``meshtron train --help`` teaches: every field has a one-line description (the comment beside it in
config.py), its Megatron aliases and its allowed values; ``--print-config`` shows the resolved config."""

from __future__ import annotations

from meshtron.cli import main
from meshtron.config import Config
from meshtron.config_help import field_descriptions


def test_every_field_has_a_description():
    fields = {f"{s}.{k}" for s, values in Config().to_dict().items() for k in values}
    descriptions = field_descriptions()
    assert set(descriptions) == fields
    assert not [f for f, d in descriptions.items() if not d], "describe these fields with a comment in config.py"


def test_help_lists_description_aliases_and_values(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.strip().startswith("num_layers "))
    assert "transformer blocks" in line and "[--num-layers]" in line
    line = next(l for l in out.splitlines() if l.strip().startswith("attention_backend "))
    assert "auto | sdpa | cudnn | flash | efficient | math" in line and "--use-flash-attn (= flash)" in line and "fused" in line
    assert "--overlap-grad-reduce: always on" in out
    assert "--rerun-mode disabled|validate_results|report_stats: no re-run engine" in out  # a noted flag's allowed values


def test_print_config_shows_the_resolved_values(capsys):
    assert main(["train", "--print-config", "--preset", "tiny-llama", "--attention-backend", "fused", "--recompute-activations"]) == 0
    out = capsys.readouterr().out
    assert "attention_backend = 'auto'" in out and "recompute_granularity = 'selective'" in out
    assert "normalization = 'RMSNorm'" in out  # from the preset
