"""The token-shift family (``model.py``) and its registration: ``--model-type
tests.families.token_shift:token_shift`` imports this package, which registers it."""

from __future__ import annotations

from meshtron.config import Config, ModelConfig
from meshtron.data.builder import decoder_datasets
from meshtron.layers.mlp import ffn_hidden_size
from meshtron.models.flops import flops_per_token
from meshtron.models.registry import FamilySpec, register
from meshtron.parallel.pipeline_balance import PipelineCosts
from meshtron.models.sizes import model_sizes
from tests.families.token_shift.model import TokenShiftLM


def flops_shape(cfg: ModelConfig, vocab_size: int, seq_length: int) -> tuple[int, int]:
    """Every parameter multiplies (the tied table once, as the output layer); no layer attends."""
    return model_sizes(cfg, vocab_size, seq_length).total(), 0


def pipeline_costs(cfg: ModelConfig, vocab_size: int, seq_length: int) -> PipelineCosts:
    """Blocks by their parameters, the head by the output projection and final norm."""
    sizes = model_sizes(cfg, vocab_size, seq_length)
    counts = sizes.block_counts()
    blocks = [flops_per_token(n, 0, seq_length, cfg.hidden_size) for n in counts]
    return PipelineCosts(embed=0.0, blocks=blocks, head=flops_per_token(sizes.total() - sum(counts), 0, seq_length, cfg.hidden_size))


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
    name="token_shift", build=TokenShiftLM, layout_errors=layout_errors, flops_shape=flops_shape, causal=True, pipeline_costs=pipeline_costs,
    datasets=decoder_datasets, config_errors=config_errors,
))  # fmt: skip
