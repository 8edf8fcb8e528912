"""The token-shift family (``model.py``) and its registration: ``--model-type
tests.families.token_shift:token_shift`` imports this package, which registers it."""

from __future__ import annotations

from meshtron.config import Config, ModelConfig
from meshtron.data.builder import decoder_datasets
from meshtron.layers.mlp import ffn_hidden_size
from meshtron.models.flops import flops_per_token
from meshtron.models.registry import FamilySpec, register
from meshtron.parallel.pipeline_balance import PipelineCosts
from tests.families.token_shift.model import TokenShiftLM, rank_parameters


def parameter_count(cfg: ModelConfig, vocab_size: int, max_seq_length: int = 0, active: bool = False) -> int:
    return rank_parameters(cfg, vocab_size, max_seq_length).total


def flops_shape(cfg: ModelConfig, vocab_size: int, seq_length: int) -> tuple[int, int]:
    """Every parameter multiplies (the tied table once, as the output layer); no layer attends."""
    return parameter_count(cfg, vocab_size, seq_length), 0


def pipeline_costs(cfg: ModelConfig, vocab_size: int, seq_length: int) -> PipelineCosts:
    """Blocks by their parameters, the head by the output projection and final norm."""
    parts = rank_parameters(cfg, vocab_size, seq_length)
    blocks = [flops_per_token(b.dense, 0, seq_length, cfg.hidden_size) for b in parts.blocks]
    return PipelineCosts(embed=0.0, blocks=blocks, head=flops_per_token(parts.head + parts.tail, 0, seq_length, cfg.hidden_size))


def config_errors(cfg: Config) -> list[str]:
    p, errors = cfg.parallel, []
    if p.sequence_parallel or p.context_parallel > 1:
        errors.append("token_shift reads each token's predecessor, which a sequence cut over ranks would lose; "
                      "drop --sequence-parallel / --context-parallel-size")  # fmt: skip
    return errors


def layout_errors(cfg: ModelConfig, tp: int) -> list[str]:
    ffn = ffn_hidden_size(cfg)
    return [f"token_shift splits its MLP width {ffn} over tp; set --ffn-hidden-size to a multiple of {tp}"] if ffn % tp else []


TOKEN_SHIFT = register(FamilySpec(
    name="token_shift", build=TokenShiftLM, parameter_count=parameter_count, rank_parameters=rank_parameters,
    layout_errors=layout_errors, flops_shape=flops_shape, causal=True, pipeline_costs=pipeline_costs,
    datasets=decoder_datasets, config_errors=config_errors,
))  # fmt: skip
