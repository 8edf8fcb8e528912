"""One typed config for a whole run: file (TOML or YAML) + command-line overrides, validated early.

Every field has exactly one name here (``section.field``); the command line accepts
``--section.field VALUE``, the short ``--field VALUE`` when the field name is unique, and the
Megatron-LM flag names listed in ``meshtron/flags.py``. Validation happens before any tensor is
allocated, and every error says what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtron.flags import MEGATRON_ALIASES


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""


@dataclass
class ModelConfig:
    """Shape of a decoder. ``preset`` fills defaults; explicit fields win."""

    preset: str = ""
    num_layers: int = 4
    hidden_size: int = 128
    ffn_hidden_size: int = 0  # 0: 4*hidden (gelu) or Llama's 8/3 rule (swiglu)
    num_attention_heads: int = 4
    num_query_groups: int = 0  # kv heads; 0: same as attention heads (no GQA)
    kv_channels: int = 0  # head dim; 0: hidden / heads
    vocab_size: int = 0  # 0: taken from the tokenizer (padded, see below)
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 0  # 0: seq_length
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    norm_epsilon: float = 1e-5
    activation: str = "gelu"  # gelu | gelu_tanh | swiglu
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope
    rotary_base: float = 10000.0
    rope_scaling: str = ""  # "" | llama3
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    add_bias_linear: bool = True
    tie_embeddings: bool = True
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init_method_std: float = 0.02
    attention_backend: str = "auto"  # auto | sdpa | cudnn | flash | efficient | math
    fused_kernels: str = "auto"  # auto (Triton on a GPU where installed) | on | off (PyTorch references, unfused loss)
    recompute_granularity: str = ""  # "" | selective (core attention) | full (whole layers)
    recompute_method: str = "uniform"  # full: uniform (groups of N layers) | block (first N layers)
    recompute_num_layers: int = 1
    fp8_format: str = ""  # "" (off) | hybrid (e4m3 forward, e5m2 gradients) | e4m3: the blocks' linears in FP8
    fp8_backend: str = "auto"  # auto (torchao when installed and usable) | torchao | meshtron


@dataclass
class DataConfig:
    """Where tokens come from. Empty ``data_path`` and ``mock`` off means the embedded corpus."""

    data_path: list[str] = field(default_factory=list)  # ["prefix"] or ["0.3", "a", "0.7", "b"]
    split: str = "969,30,1"
    mock: bool = False
    seq_length: int = 128
    tokenizer_type: str = ""  # HuggingFaceTokenizer | GPT2BPETokenizer | SentencePieceTokenizer | TikTokenizer | ByteTokenizer
    tokenizer_model: str = ""
    vocab_file: str = ""
    merge_file: str = ""
    data_cache_path: str = ""
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    num_workers: int = 0


@dataclass
class TrainConfig:
    """Batches, optimizer, schedule and precision."""

    micro_batch_size: int = 8
    global_batch_size: int = 16
    train_iters: int = 300
    exit_interval: int = 0  # stop (after saving) once the iteration is a multiple of this
    exit_duration_in_mins: float = 0.0
    seed: int = 1234
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_decay_style: str = "cosine"  # constant | linear | cosine | wsd
    lr_warmup_iters: int = 30
    lr_decay_iters: int = 0  # 0: train_iters
    lr_wsd_decay_iters: int = 0  # wsd: length of the final decay phase; 0: 10% of decay iters
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    initial_loss_scale: float = 2.0**16
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False  # torch.compile each transformer block
    gemm_tuning: bool = False  # PyTorch TunableOp GEMM tuning (GPU); results kept in the save or cache dir
    gradient_accumulation_fusion: bool = False  # the blocks' linears compute weight gradients straight into the fp32 buffer
    check_for_nan_in_loss_and_grad: bool = True  # a non-finite loss or grad norm stops the run (fp16: see the next field)
    max_consecutive_skipped_steps: int = 10  # this many skipped steps in a row (fp16 overflow) stop the run; 0: no limit


@dataclass
class ParallelConfig:
    """Parallel sizes; data parallel is what remains of the world size."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    virtual_pipeline_parallel: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    num_layers_per_virtual_pipeline_stage: int = 0  # Megatron's way to set the above: layers / pp / this
    pipeline_schedule: str = "auto"  # auto (1f1b, interleaved with virtual stages) | 1f1b | afab | interleaved
    first_pipeline_stage_layers: int = 0  # 0: even split; fewer balance the embedding
    last_pipeline_stage_layers: int = 0  # 0: even split; fewer balance the output layer and loss
    account_for_embedding_in_pipeline_split: bool = False  # the embedding counts as a layer of the first chunk
    account_for_loss_in_pipeline_split: bool = False  # the output layer + loss counts as a layer of the last chunk
    cp_comm_type: str = "p2p"  # context parallel attention: p2p (ring) | all_gather (of keys and values)
    fsdp: bool = False  # PyTorch FSDP2 (fully_shard) instead of the distributed optimizer; needs tp = 1
    ddp_bucket_size: int = 40_000_000  # gradient elements per data-parallel reduction bucket


@dataclass
class CheckpointConfig:
    save: str = ""
    load: str = ""
    save_interval: int = 0  # 0: only at the end
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    ckpt_step: int = -1  # iteration to load; -1: the tracker's
    finetune: bool = False  # load the model weights only (no optimizer, no RNG) and start at iteration 0
    no_save_rng: bool = False
    ckpt_format: str = "torch_dist"  # the only format: DCP, reshardable
    dist_ckpt_strictness: str = "raise_all"  # raise_all | log_all (checkpoint tensors the run lacks are skipped)


@dataclass
class LoggingConfig:
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 10
    tensorboard_dir: str = ""
    generate_prompt: str = ""  # after training, print a sample from this prompt ("" skips)
    generate_tokens: int = 48


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Config":
        cfg = cls()
        for section_name, values in raw.items():
            if section_name not in _SECTIONS:
                raise ConfigError(_unknown("section", section_name, list(_SECTIONS)))
            if not isinstance(values, dict):
                raise ConfigError(f"config section [{section_name}] must be a table of fields")
            section = getattr(cfg, section_name)
            for key, value in values.items():
                key = key.replace("-", "_")
                if key not in _field_types(type(section)):
                    raise ConfigError(_unknown(f"field of [{section_name}]", key, list(_field_types(type(section)))))
                setattr(section, key, _coerce(value, _field_types(type(section))[key], f"{section_name}.{key}"))
        return cfg


_SECTIONS = typing.get_type_hints(Config)


def _field_types(section_cls) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _unknown(what: str, name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known: {', '.join(sorted(known))}"
    return f"unknown {what} '{name}'{hint}"


def _coerce(value: Any, typ: Any, name: str) -> Any:
    """Turn a file or command-line value into the field's type, or say why not."""
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if origin is list:
            if isinstance(value, str):
                return value.split()
            return [str(v) for v in value]
        if typ is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if typ is float:
            return float(value)
        if typ is str:
            return str(value)
    except (TypeError, ValueError):
        pass
    type_name = getattr(typ, "__name__", str(typ))
    raise ConfigError(f"{name} must be {type_name}, got {value!r}")

# Megatron flags that take several values until the next flag.
_MULTI_VALUE = {"data.data_path"}


def _all_flags() -> dict[str, Any]:
    """Every accepted spelling -> target (dotted field name, or (field, constant))."""
    flags: dict[str, Any] = {}
    short_owner: dict[str, list[str]] = {}
    for section_name, section_cls in _SECTIONS.items():
        for name, typ in _field_types(section_cls).items():
            dotted = f"{section_name}.{name}"
            flags[f"{section_name}.{name}"] = dotted
            flags[f"{section_name}.{name}".replace("_", "-")] = dotted
            short_owner.setdefault(name, []).append(dotted)
    for name, owners in short_owner.items():
        if len(owners) == 1:
            flags.setdefault(name, owners[0])
            flags.setdefault(name.replace("_", "-"), owners[0])
    flags.update(MEGATRON_ALIASES)
    return flags


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Parse ``--flag value`` / ``--flag=value`` / ``--switch`` into {dotted_field: raw value}."""
    flags = _all_flags()
    types = {f"{s}.{n}": t for s, cls in _SECTIONS.items() for n, t in _field_types(cls).items()}
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}': options look like --name value")
        name, eq, inline = arg[2:].partition("=")
        if name.startswith("no-") and name[3:] in flags and types.get(_target(flags[name[3:]])) is bool:
            if eq:
                raise ConfigError(f"--{name} takes no value")
            out[_target(flags[name[3:]])] = False
            i += 1
            continue
        if name not in flags:
            raise ConfigError(_unknown("flag", "--" + name, ["--" + f for f in flags]))
        target = flags[name]
        if isinstance(target, tuple):
            dotted, constant = target
            if constant is not None:
                out[dotted] = constant
            i += 1
            continue
        typ = types[target]
        if eq:
            out[target] = inline
            i += 1
        elif typ is bool and (i + 1 == len(args) or args[i + 1].startswith("--")):
            out[target] = True
            i += 1
        elif target in _MULTI_VALUE:
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            if j == i + 1:
                raise ConfigError(f"--{name} needs a value")
            out[target] = args[i + 1 : j]
            i = j
        else:
            if i + 1 == len(args):
                raise ConfigError(f"--{name} needs a value")
            out[target] = args[i + 1]
            i += 2
    return out


def _target(t: Any) -> str:
    return t[0] if isinstance(t, tuple) else t


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a TOML or YAML config file into nested dicts."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            import tomllib

            return tomllib.loads(text)
        if path.suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text) or {}
    except Exception as exc:  # the parser's own message names the line
        raise ConfigError(f"cannot parse config file '{path}': {exc}") from exc
    raise ConfigError(f"config file '{path}' must end in .toml, .yaml or .yml")


def build_config(config_file: str | None = None, overrides: list[str] | None = None, validate_now: bool = True) -> Config:
    """File, then preset defaults, then command-line overrides; validated before returning."""
    raw = load_file(config_file) if config_file else {}
    parsed = parse_overrides(overrides or [])
    preset = parsed.get("model.preset", raw.get("model", {}).get("preset", ""))
    merged: dict[str, dict[str, Any]] = {}
    if preset:
        from meshtron.models.presets import preset_fields

        for dotted, value in preset_fields(preset).items():
            section, name = dotted.split(".")
            merged.setdefault(section, {})[name] = value
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"config section [{section}] must be a table of fields")
        merged.setdefault(section, {}).update(values)
    for dotted, value in parsed.items():
        section, name = dotted.split(".")
        merged.setdefault(section, {})[name] = value
    cfg = Config.from_dict(merged)
    if validate_now:
        validate(cfg)
    return cfg


def world_size_from_env() -> int:
    """torchrun's WORLD_SIZE, else SLURM's task count, else one process."""
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def data_parallel_size(cfg: Config, world_size: int) -> int:
    p = cfg.parallel
    model_parallel = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
    return world_size // model_parallel


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Every check that needs no tensor. Raises ConfigError naming the fix."""
    world_size = world_size_from_env() if world_size is None else world_size
    m, d, t, p, c = cfg.model, cfg.data, cfg.train, cfg.parallel, cfg.checkpoint
    errors: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errors.append(msg)

    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        need(getattr(m, name) > 0, f"model.{name} must be positive, got {getattr(m, name)}")
    if m.hidden_size > 0 and m.num_attention_heads > 0 and not m.kv_channels:
        need(
            m.hidden_size % m.num_attention_heads == 0,
            f"--num-attention-heads {m.num_attention_heads} does not divide --hidden-size {m.hidden_size}; "
            f"pick heads that divide it (e.g. {_divisor_near(m.hidden_size, m.num_attention_heads)}) or set --kv-channels",
        )
    groups = m.num_query_groups or m.num_attention_heads
    need(
        m.num_attention_heads % groups == 0 if groups > 0 else False,
        f"--num-query-groups {groups} must divide --num-attention-heads {m.num_attention_heads}",
    )
    need(m.normalization in ("LayerNorm", "RMSNorm"), f"--normalization must be LayerNorm or RMSNorm, got '{m.normalization}'")
    need(m.activation in ("gelu", "gelu_tanh", "swiglu"), f"model.activation must be gelu, gelu_tanh or swiglu, got '{m.activation}'")
    need(
        m.position_embedding_type in ("learned_absolute", "rope"),
        f"--position-embedding-type must be learned_absolute or rope, got '{m.position_embedding_type}'",
    )
    need(m.rope_scaling in ("", "llama3"), f"model.rope_scaling must be '' or 'llama3', got '{m.rope_scaling}'")
    need(m.attention_backend in ("auto", "sdpa", "cudnn", "flash", "efficient", "math"),
         f"--attention-backend must be auto, sdpa, cudnn, flash, efficient or math, got '{m.attention_backend}'")  # fmt: skip
    need(m.fused_kernels in ("auto", "on", "off"), f"model.fused_kernels must be auto, on or off, got '{m.fused_kernels}'")
    need(m.recompute_granularity in ("", "selective", "full"),
         f"--recompute-granularity must be selective or full (or empty for none), got '{m.recompute_granularity}'")  # fmt: skip
    need(m.recompute_method in ("uniform", "block"), f"--recompute-method must be uniform or block, got '{m.recompute_method}'")
    need(m.fp8_format in ("", "hybrid", "e4m3"), f"--fp8-format must be hybrid or e4m3 (or empty for off), got '{m.fp8_format}'")
    need(m.fp8_backend in ("auto", "torchao", "meshtron"), f"--fp8-backend must be auto, torchao or meshtron, got '{m.fp8_backend}'")
    need(not (t.device == "cpu" and (m.fp8_format or t.gemm_tuning)), "--fp8-format and --gemm-tuning need a GPU; drop them for --device cpu")
    # torch.compile would trace the fused linear's backward, which reports to the gradient buffer from Python.
    need(not (t.compile and t.gradient_accumulation_fusion), "--gradient-accumulation-fusion does not combine with --compile; drop one")
    need(m.recompute_num_layers >= 1, f"--recompute-num-layers must be at least 1, got {m.recompute_num_layers}")
    max_pos = m.max_position_embeddings or d.seq_length
    need(d.seq_length > 0, f"--seq-length must be positive, got {d.seq_length}")
    if m.position_embedding_type == "learned_absolute":
        need(
            d.seq_length <= max_pos,
            f"--seq-length {d.seq_length} exceeds --max-position-embeddings {max_pos}; raise it or shorten the sequence",
        )

    need(t.micro_batch_size > 0, f"--micro-batch-size must be positive, got {t.micro_batch_size}")
    need(p.cp_comm_type in ("p2p", "all_gather"), f"--cp-comm-type must be p2p or all_gather, got '{p.cp_comm_type}'")
    if p.fsdp:
        need(p.pipeline_parallel == 1, "--fsdp does not combine with pipeline parallelism; use the distributed optimizer")
        need(p.tensor_parallel == 1, f"--fsdp needs --tensor-model-parallel-size 1 (got {p.tensor_parallel}); use the distributed optimizer with tp")
        need(not p.use_distributed_optimizer, "--fsdp and --use-distributed-optimizer both shard optimizer state; pick one")
    model_parallel = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
    for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
        need(getattr(p, name) >= 1, f"parallel.{name} must be at least 1")
    if model_parallel >= 1:
        need(
            world_size % model_parallel == 0,
            f"world size {world_size} is not a multiple of tp {p.tensor_parallel} x pp {p.pipeline_parallel} x "
            f"cp {p.context_parallel} = {model_parallel}; change the parallel sizes or the number of processes",
        )
    dp = max(1, world_size // max(1, model_parallel))
    need(p.pipeline_schedule in ("auto", "1f1b", "afab", "interleaved"), f"parallel.pipeline_schedule must be auto, 1f1b, afab or interleaved, got '{p.pipeline_schedule}'")
    if p.num_layers_per_virtual_pipeline_stage and p.pipeline_parallel > 0:
        per_rank = m.num_layers // max(1, p.pipeline_parallel)
        need(
            m.num_layers % p.pipeline_parallel == 0 and per_rank % p.num_layers_per_virtual_pipeline_stage == 0,
            f"--num-layers-per-virtual-pipeline-stage {p.num_layers_per_virtual_pipeline_stage} must divide the "
            f"{m.num_layers} layers / pp {p.pipeline_parallel} of each pipeline rank",
        )
    virtual = pipeline_virtual_size(cfg)
    need(virtual == 1 or p.pipeline_parallel > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
    if p.pipeline_parallel > 1 and (virtual > 1 or p.pipeline_schedule == "interleaved") and t.micro_batch_size > 0:
        micro = t.global_batch_size // max(1, t.micro_batch_size * dp)
        need(
            micro % p.pipeline_parallel == 0,
            f"the interleaved schedule needs the {micro} micro batches per step to be a multiple of pp "
            f"{p.pipeline_parallel}; change --global-batch-size or --micro-batch-size",
        )
    if t.micro_batch_size > 0:
        need(
            t.global_batch_size % (t.micro_batch_size * dp) == 0 and t.global_batch_size > 0,
            f"--global-batch-size {t.global_batch_size} is not a multiple of --micro-batch-size {t.micro_batch_size} "
            f"x data-parallel size {dp} = {t.micro_batch_size * dp}; use e.g. "
            f"{max(1, round(t.global_batch_size / (t.micro_batch_size * dp))) * t.micro_batch_size * dp}",
        )
    need(t.train_iters > 0, f"--train-iters must be positive, got {t.train_iters}")
    need(t.lr >= 0 and t.min_lr >= 0, "--lr and --min-lr must not be negative")
    need(t.min_lr <= t.lr, f"--min-lr {t.min_lr} is above --lr {t.lr}")
    need(t.lr_decay_style in ("constant", "linear", "cosine", "wsd"), f"--lr-decay-style must be constant, linear, cosine or wsd, got '{t.lr_decay_style}'")
    need(t.precision in ("auto", "fp32", "bf16", "fp16"), f"train.precision must be auto, fp32, bf16 or fp16, got '{t.precision}'")
    need(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, got '{t.device}'")
    need(t.clip_grad >= 0, f"--clip-grad must not be negative, got {t.clip_grad}")

    if d.mock and d.data_path:
        errors.append("--mock-data and --data-path are both set; keep one")
    if d.data_path:
        errors.extend(_check_data_path(d.data_path))
        if not d.tokenizer_type:
            errors.append("--data-path is set but --tokenizer-type is not; name the tokenizer the data was made with")
    try:
        parts = [float(x) for x in d.split.replace("/", ",").split(",")]
        need(len(parts) <= 3 and sum(parts) > 0 and min(parts) >= 0, f"--split '{d.split}' must be up to 3 non-negative weights like 969,30,1")
    except ValueError:
        errors.append(f"--split '{d.split}' must be comma-separated numbers like 969,30,1")
    if c.load and not Path(c.load).exists():
        errors.append(f"--load {c.load} does not exist; point it at a checkpoint directory written by --save")
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def pipeline_virtual_size(cfg: Config) -> int:
    """Model chunks per pipeline rank, from either of Megatron's two ways to ask for them."""
    p = cfg.parallel
    if p.num_layers_per_virtual_pipeline_stage:
        return max(1, cfg.model.num_layers // max(1, p.pipeline_parallel) // p.num_layers_per_virtual_pipeline_stage)
    return p.virtual_pipeline_parallel


def _divisor_near(n: int, k: int) -> int:
    divisors = [x for x in range(1, n + 1) if n % x == 0]
    return min(divisors, key=lambda x: abs(x - k))


def _check_data_path(tokens: list[str]) -> list[str]:
    """``prefix`` or ``w1 prefix1 w2 prefix2 ...``: each prefix must have .bin and .idx."""
    errors = []
    prefixes = tokens
    if len(tokens) > 1:
        if len(tokens) % 2:
            return [f"--data-path with several entries must be weight/prefix pairs, got {tokens}"]
        try:
            [float(w) for w in tokens[0::2]]
        except ValueError:
            return [f"--data-path with several entries must be weight/prefix pairs, got {tokens}"]
        prefixes = tokens[1::2]
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).is_file():
                errors.append(f"--data-path: '{prefix}{ext}' not found (give the prefix without extension, as written by `meshtron preprocess`)")
    return errors


def format_config(cfg: Config) -> str:
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines.extend(f"  {k} = {v!r}" for k, v in values.items())
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - a quick way to see the merged config
    print(format_config(build_config(None, sys.argv[1:])))
