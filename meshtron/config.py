"""One typed config for a whole run: file (TOML or YAML) + command-line overrides, validated early.

Every field has exactly one name here (``section.field``); the command line accepts
``--section.field VALUE``, the short ``--field VALUE`` when the field name is unique, and the
Megatron-LM flag names listed in ``meshtron/flags.py``. Validation happens before any tensor is
allocated, and every error says what to change.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtron.data.data_sources import resolve_data_sources
from meshtron.errors import ConfigError, unknown_name
from meshtron.flags import MEGATRON_ALIASES, NOTED_FLAGS, VALUE_ALIASES
from meshtron.model_config import ModelConfig
from meshtron.presets import preset_fields
from meshtron.training.batch_schedule import resolve_sample_based_training


@dataclass
class DataConfig:
    """Where tokens come from. Empty ``data_path`` and ``mock`` off means the embedded corpus."""

    data_path: list[str] = field(default_factory=list)  # ["prefix"] or ["0.3", "a", "0.7", "b"]
    # Per-split data (Megatron's; meshtron/data/data_sources.py): each split its own blend, no --split.
    train_data_path: list[str] = field(default_factory=list)  # the train split's blend, written as data_path
    valid_data_path: list[str] = field(default_factory=list)  # the validation split's blend
    test_data_path: list[str] = field(default_factory=list)  # the test split's blend
    data_args_path: str = ""  # a file holding the data_path value (read at start-up into data_path)
    per_split_data_args_path: str = ""  # a JSON file with "train", "valid", "test" blends (read into the three above)
    split: str = "969,30,1"  # train,valid,test weights of the documents
    mock: bool = False  # random tokens (sentences, for BERT/T5/ICT) instead of data: benchmarks, smoke runs
    seq_length: int = 128  # tokens per sample
    tokenizer_type: str = ""  # HuggingFaceTokenizer | GPT2BPETokenizer | SentencePieceTokenizer | TikTokenizer | ByteTokenizer
    tokenizer_model: str = ""  # tokenizer file or folder (tokenizer.json, .model, tiktoken file)
    vocab_file: str = ""  # GPT-2 vocab.json or WordPiece vocab.txt
    merge_file: str = ""  # GPT-2 merges.txt
    data_cache_path: str = ""  # where sample indices are cached (default: beside the data)
    reset_position_ids: bool = False  # positions restart after each end-of-document token
    reset_attention_mask: bool = False  # no attention across end-of-document tokens
    eod_mask_loss: bool = False  # no loss on end-of-document tokens
    num_workers: int = 0  # data loader worker processes (0: in the training process)
    sft: bool = False  # fine-tune on the chat jsonl in --data-path: loss on assistant tokens, conversations packed
    sft_chat_template: str = "auto"  # auto | tokenizer | plain: --sft layout (auto: the tokenizer's chat template if any)
    # BERT / T5 / ICT data (sentence-split files); checked by meshtron.data.masked_lm.masked_data_config_errors.
    # N-gram limits are Megatron's fixed 3 (BERT) and 10 (T5), so no field sets them.
    mask_prob: float = 0.15  # BERT/T5: fraction of tokens masked
    short_seq_prob: float = 0.1  # a sample's target length is drawn shorter with this probability
    vocab_extra_ids: int = 0  # T5 sentinels <extra_id_N> appended to a WordPiece vocabulary
    encoder_seq_length: int = 0  # T5; 0: seq_length
    decoder_seq_length: int = 0  # T5; must be set for T5
    titles_data_path: str = ""  # ICT: document-level indexed titles, one per document
    query_in_block_prob: float = 0.1  # ICT: the query sentence stays in its block this often
    use_one_sent_docs: bool = False  # ICT: one-sentence documents make blocks too


@dataclass
class TrainConfig:
    """Batches, optimizer, schedule and precision."""

    micro_batch_size: int = 8  # samples per forward/backward on one rank
    global_batch_size: int = 16  # samples per optimizer step over all data-parallel ranks
    train_iters: int = 300  # optimizer steps (with train_samples: the iterations those take, set when the config is built)
    exit_interval: int = 0  # stop (after saving) once the iteration is a multiple of this
    exit_duration_in_mins: float = 0.0  # stop (after saving) after this many minutes; 0: no limit
    exit_signal: str = "SIGTERM"  # SIGTERM | SIGINT | SIGUSR1 | SIGUSR2: the signal that saves and stops (SIGINT always does too)
    train_timeout_minutes: float = 0.0  # a step (or save) taking longer names the ranks that did not arrive and stops the run; 0: --distributed-timeout-minutes
    hang_step_factor: float = 0.0  # a step this many times the median of recent steps counts as a hang too; 0: only the timeout
    log_straggler: bool = False  # every log interval, gather each rank's step times and log the slowest ranks
    straggler_minmax_count: int = 3  # --log-straggler: how many of the slowest ranks to name
    manual_gc: bool = False  # Python's automatic garbage collector off while training; collections only as the two fields below say
    manual_gc_interval: int = 0  # --manual-gc: collect every this many iterations (every rank at the same one); 0: never between steps
    manual_gc_eval: bool = True  # --manual-gc: collect before and after each evaluation
    empty_unused_memory_level: int = 0  # 1: empty the CUDA cache after each forward-backward and evaluation step; 2: also after each optimizer step
    seed: int = 1234  # seed of init, data order and dropout
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # learning rate at the end of decay
    lr_decay_style: str = "cosine"  # constant | linear | cosine | wsd
    lr_warmup_iters: int = 30  # linear warm-up steps
    lr_warmup_fraction: float = 0.0  # Megatron's: warm up over this fraction of the decay span (iterations or samples, rounded), in place of the two warm-up counts; 0: off
    decoupled_lr: float = 0.0  # Megatron's: the word embeddings' and output layer's own peak rate, on the same warm-up and decay; 0: off
    decoupled_min_lr: float = 0.0  # --decoupled-lr: their rate at the end of decay
    lr_decay_iters: int = 0  # 0: train_iters
    lr_wsd_decay_iters: int = 0  # wsd: length of the final decay phase; 0: 10% of decay iters
    # Sample-based training (Megatron's; meshtron/training/batch_schedule.py): excludes the iteration flags above.
    train_samples: int = 0  # train this many samples; 0: train_iters (else train_iters becomes the iterations they take)
    rampup_batch_size: list[int] = field(default_factory=list)  # START INCREMENT RAMP_SAMPLES: the global batch grows to global_batch_size
    lr_warmup_samples: int = 0  # with train_samples: linear warm-up samples
    lr_decay_samples: int = 0  # with train_samples; 0: train_samples
    lr_wsd_decay_samples: int = 0  # with train_samples, wsd: length of the final decay phase; 0: 10% of decay samples
    weight_decay: float = 0.1  # AdamW decoupled weight decay (not on norms and biases)
    adam_beta1: float = 0.9  # Adam first-moment decay
    adam_beta2: float = 0.95  # Adam second-moment decay
    adam_eps: float = 1e-8  # Adam epsilon
    clip_grad: float = 1.0  # clip the global gradient norm to this; 0: off
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    initial_loss_scale: float = 2.0**16  # fp16: starting loss scale
    min_loss_scale: float = 1.0  # fp16: the scale never drops below this
    loss_scale_window: int = 1000  # fp16: steps without overflow before the scale doubles
    hysteresis: int = 2  # fp16: overflows tolerated before the scale halves
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False  # torch.compile each transformer block
    gemm_tuning: bool = False  # PyTorch TunableOp GEMM tuning (GPU); results kept in the save or cache dir
    gradient_accumulation_fusion: bool = True  # weight gradients of the blocks' linears and experts straight into the fp32 buffer (not under compile)
    check_for_nan_in_loss_and_grad: bool = True  # a non-finite loss or grad norm stops the run (fp16: see the next field)
    max_consecutive_skipped_steps: int = 10  # this many skipped steps in a row (fp16 overflow) stop the run; 0: no limit
    optimizer: str = "adam"  # adam (AdamW: Megatron's adam, decoupled weight decay) | sgd (momentum, L2 decay) | muon (linear weights; AdamW for the rest)
    sgd_momentum: float = 0.9  # --optimizer sgd: momentum
    muon_momentum: float = 0.9  # --optimizer muon: momentum (an average: lerp towards the gradient by 1 - momentum)
    muon_nesterov: bool = False  # Muon: Nesterov-style look-ahead update
    muon_split_qkv: bool = True  # Muon: orthogonalize a fused QKV weight's q, k and v rows apart (SwiGLU's halves always apart)
    muon_num_ns_steps: int = 5  # Muon: Newton-Schulz iterations
    muon_coefficient_type: str = "quintic"  # Muon: quintic (5 tuned coefficient sets) | simple (one set)
    muon_scale_mode: str = "spectral"  # Muon: spectral (sqrt(max(out, in))) | unit_rms_norm (sqrt(out/in)) | shape_scaling (sqrt(max(1, out/in)))
    muon_extra_scale_factor: float = 1.0  # Muon: the update's further multiplier
    muon_fp32_matmul_prec: str = "medium"  # Muon: low | medium (Newton-Schulz in bf16) | high (in fp32)
    muon_tp_mode: str = "duplicated"  # Muon under tp: duplicated (gather each matrix whole) | blockwise (each shard alone)
    optimizer_impl: str = "auto"  # auto (fused on a GPU with Triton) | fused (one Triton kernel per step) | reference
    use_precision_aware_optimizer: bool = False  # Megatron's: lets --exp-avg-dtype / --exp-avg-sq-dtype take effect
    exp_avg_dtype: str = "fp32"  # fp32 | bf16 | fp16: the Adam first moment's storage (math stays fp32; fused step only)
    exp_avg_sq_dtype: str = "fp32"  # fp32 | bf16 | fp16: the second moment's storage


@dataclass
class ParallelConfig:
    """Parallel sizes; data parallel is what remains of the world size."""

    tensor_parallel: int = 1  # ranks splitting each layer's weights
    pipeline_parallel: int = 1  # ranks splitting the layers into stages
    context_parallel: int = 1  # ranks splitting each sequence
    expert_parallel: int = 1  # ranks splitting the experts
    sequence_parallel: bool = False  # with tp: norms and dropout on sequence shards
    tp_comm_overlap: bool = False  # with sp: pipeline the linears' sequence all-gathers / reduce-scatters with their GEMMs
    tp_comm_overlap_backend: str = "p2p"  # p2p (send/recv, any backend: NCCL, RCCL, gloo) | bulk (one collective per op; the input-gradient reduce-scatter behind the wgrad GEMM) | symm_mem (PyTorch async-TP ops; CUDA builds, else p2p)
    use_distributed_optimizer: bool = False  # shard fp32 masters and Adam moments over data-parallel ranks
    overlap_param_gather: bool = False  # with --use-distributed-optimizer: all-gather the updated params during the next forward (each bucket waited at its first use), not at the end of the step
    virtual_pipeline_parallel: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    num_layers_per_virtual_pipeline_stage: int = 0  # Megatron's way to set the above: layers / pp / this
    pipeline_schedule: str = "auto"  # auto (1f1b, interleaved with virtual stages) | 1f1b | afab | interleaved | zb-h1 | zbv (zero bubble: backward split, V with 2 virtual stages)
    pipeline_split: str = "cost"  # cost (layers balanced by modeled FLOPs, output layer included) | uniform; explicit counts below override
    first_pipeline_stage_layers: int = 0  # 0: by --pipeline-split; fewer balance the embedding
    last_pipeline_stage_layers: int = 0  # 0: by --pipeline-split; fewer balance the output layer and loss
    account_for_embedding_in_pipeline_split: bool = False  # the embedding counts as a layer of the first chunk
    account_for_loss_in_pipeline_split: bool = False  # the output layer + loss counts as a layer of the last chunk
    cp_comm_type: str = "p2p"  # context parallel attention: p2p (ring) | all_gather (of keys and values)
    fsdp: bool = False  # PyTorch FSDP2 (fully_shard) instead of the distributed optimizer; needs tp = 1
    ddp_bucket_size: int = 40_000_000  # gradient elements per data-parallel reduction bucket
    expert_tensor_parallel: int = 1  # ranks splitting each expert's FFN (the expert grid's etp x ep x edp); 1: whole
    grad_reduce_in_bf16: bool = False  # reduce a bf16 copy of each gradient bucket; accumulation stays fp32
    distributed_timeout_minutes: int = 10  # how long a collective may wait before the process group fails


@dataclass
class CheckpointConfig:
    save: str = ""  # checkpoint directory to write
    load: str = ""  # checkpoint directory to resume from
    save_interval: int = 0  # 0: only at the end
    no_save_optim: bool = False  # checkpoints without optimizer state
    no_load_optim: bool = False  # resume without the optimizer state
    no_load_rng: bool = False  # resume without the random states
    ckpt_step: int = -1  # iteration to load; -1: the tracker's
    finetune: bool = False  # load the model weights only (no optimizer, no RNG) and start at iteration 0
    no_save_rng: bool = False  # checkpoints without random states
    ckpt_format: str = "torch_dist"  # the only format: DCP, reshardable
    dist_ckpt_strictness: str = "raise_all"  # raise_all | log_all (checkpoint tensors the run lacks are skipped)
    exit_on_missing_checkpoint: bool = False  # --load finds no checkpoint: stop instead of starting from scratch
    async_save: bool = False  # copy the shards to host and write them in a background thread
    ckpt_keep_last: int = 0  # keep only the newest N complete checkpoints in --save; 0: keep all
    allow_existing_checkpoints: bool = False  # let a run that did not resume from --save write there although it holds checkpoints
    save_failure: str = "continue"  # continue (train on, the next save retries) | stop: what a failed save does
    bert_load: str = ""  # ICT: a BERT checkpoint whose weights start both towers (unless --load finds one)


@dataclass
class LoggingConfig:
    log_interval: int = 10  # steps per log line
    eval_interval: int = 100  # steps between validations; 0: none
    eval_iters: int = 10  # global batches per validation
    tensorboard_dir: str = ""  # write TensorBoard events here (`meshtron plot` reads them)
    generate_prompt: str = ""  # after training, print a sample from this prompt ("" skips)
    generate_tokens: int = 48  # tokens of that sample
    tensorboard_queue_size: int = 1000  # scalars TensorBoard buffers before writing to disk
    wandb_project: str = ""  # log to Weights & Biases too (needs `pip install wandb`; WANDB_MODE=offline honoured)
    wandb_exp_name: str = ""  # the W&B run name
    wandb_save_dir: str = ""  # where W&B keeps its files ("": its default, ./wandb)
    profile: bool = False  # PyTorch profiler trace of iterations [profile_step_start, profile_step_end) under the run directory
    profile_step_start: int = 10  # first profiled iteration
    profile_step_end: int = 12  # profiling stops before this iteration
    noted_flags: list[str] = field(default_factory=list)  # Megatron flags given whose behaviour is fixed here; logged at start-up


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
                raise ConfigError(unknown_name("section", section_name, list(_SECTIONS)))
            if not isinstance(values, dict):
                raise ConfigError(f"config section [{section_name}] must be a table of fields")
            section = getattr(cfg, section_name)
            for key, value in values.items():
                key = key.replace("-", "_")
                if key not in _field_types(type(section)):
                    raise ConfigError(unknown_name(f"field of [{section_name}]", key, list(_field_types(type(section)))))
                setattr(section, key, _coerce(value, _field_types(type(section))[key], f"{section_name}.{key}"))
        return cfg


_SECTIONS = typing.get_type_hints(Config)


@functools.cache  # typing.get_type_hints is slow, and the sections never change
def _field_types(section_cls) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


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
            item = typing.get_args(typ)[0]
            return [item(v) for v in (value.split() if isinstance(value, str) else value)]
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
_MULTI_VALUE = {"data.data_path", "data.train_data_path", "data.valid_data_path", "data.test_data_path", "train.rampup_batch_size",
                "model.retriever_report_topk_accuracies", "model.recompute_modules"}


@functools.cache  # the sections and alias tables never change
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
        if name in NOTED_FLAGS:
            i = _note_flag(name, NOTED_FLAGS[name][0], inline if eq else None, args, i, out)
            continue
        if name not in flags:
            raise ConfigError(unknown_name("flag", "--" + name, ["--" + f for f in [*flags, *NOTED_FLAGS]]))
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
    _translate_values(out)
    return out


def _target(t: Any) -> str:
    return t[0] if isinstance(t, tuple) else t


def _note_flag(name: str, takes_value: bool, inline: str | None, args: list[str], i: int, out: dict[str, Any]) -> int:
    """Record a flag of ``NOTED_FLAGS`` (with its value, if it takes one) in ``logging.noted_flags``;
    returns the index of the next argument."""
    value, i = (inline, i + 1) if inline is not None else (None, i + 1)
    if takes_value and value is None:
        if i == len(args) or args[i].startswith("--"):
            raise ConfigError(f"--{name} needs a value")
        value, i = args[i], i + 1
    elif not takes_value and value is not None:
        raise ConfigError(f"--{name} takes no value")
    out.setdefault("logging.noted_flags", []).append(f"--{name}" + (f" {value}" if value is not None else ""))
    return i


def _translate_values(out: dict[str, Any]) -> None:
    """Megatron's values of a flag (``--attention-backend fused``) become meshtron's, noted for the log."""
    for target, table in VALUE_ALIASES.items():
        if isinstance(out.get(target), str) and out[target] in table:
            ours, meaning = table[out[target]]
            flag = "--" + target.split(".")[1].replace("_", "-")
            said = f"meshtron's {ours}, {meaning}" if ours else meaning  # "": meshtron's default, which the meaning names
            out.setdefault("logging.noted_flags", []).append(f"{flag} {out[target]}: {said}")
            out[target] = ours


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


def build_config(config_file: str | None = None, overrides: list[str] | None = None) -> Config:
    """File, then preset defaults, then command-line overrides. Checked for types here; checked
    for sense (and against the parallel layout) by ``meshtron.validation.validate``."""
    raw = load_file(config_file) if config_file else {}
    parsed = parse_overrides(overrides or [])
    preset = parsed.get("model.preset", raw.get("model", {}).get("preset", ""))
    merged: dict[str, dict[str, Any]] = {}
    if preset:
        user_model = {**{k.replace("-", "_"): v for k, v in raw.get("model", {}).items()},
                      **{k.split(".")[1]: v for k, v in parsed.items() if k.startswith("model.")}}  # fmt: skip
        layers = str(user_model.get("num_layers", ""))  # checked for type below, with the rest
        layers = int(layers) if layers.isdigit() and "moe_layer_freq" not in user_model else None
        for dotted, value in preset_fields(preset, layers).items():
            section, name = dotted.split(".")
            merged.setdefault(section, {})[name] = value
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"config section [{section}] must be a table of fields")
        merged.setdefault(section, {}).update(values)
    for dotted, value in parsed.items():
        section, name = dotted.split(".")
        merged.setdefault(section, {})[name] = value
    explicit_data = {**raw.get("data", {}), **{k.split(".")[1]: v for k, v in parsed.items() if k.startswith("data.")}}
    if explicit_data.get("encoder_seq_length") and "seq_length" not in explicit_data:
        merged["data"]["seq_length"] = explicit_data["encoder_seq_length"]  # Megatron's rule: T5's sequence is its encoder's
    model = merged.get("model", {})
    if model.get("position_embedding_type") == "yarn":  # Megatron's spelling of RoPE with YaRN's scaling
        model.update(position_embedding_type="rope", rope_scaling="yarn")
    cfg = Config.from_dict(merged)
    given = {section: {k.replace("-", "_") for k in raw.get(section, {})} | {k.split(".")[1] for k in parsed if k.startswith(section + ".")}
             for section in ("train", "data")}  # fmt: skip
    resolve_sample_based_training(cfg.train, given["train"])
    resolve_data_sources(cfg.data, split_given="split" in given["data"])
    _resolve_shared_experts(cfg.model)
    _resolve_device_limited_routing(cfg)
    _resolve_recompute_modules(cfg)
    return cfg


def _resolve_shared_experts(m: ModelConfig) -> None:
    """PAI-Megatron's ``--num-shared-experts N`` is Megatron-Core's shared MLP of N expert widths."""
    if m.moe_num_shared_experts and not m.moe_shared_expert_intermediate_size:
        m.moe_shared_expert_intermediate_size = m.moe_num_shared_experts * (m.moe_ffn_hidden_size or m.ffn_hidden_size)


RECOMPUTED_MODULES = ("core_attn", "moe")
KEPT_MODULES = ("moe_act", "layernorm", "mla_up_proj", "mlp", "shared_experts")


def recomputes_core_attention(m: ModelConfig, granularity: str | None = None) -> bool:
    """Selective recompute of the core attention (Megatron's default ``--recompute-modules core_attn``),
    at ``m``'s granularity or the one given (the estimate compares them)."""
    return (granularity if granularity is not None else m.recompute_granularity) == "selective" and "core_attn" in m.recompute_modules


def _resolve_recompute_modules(cfg: Config) -> None:
    """``--recompute-modules``: ``moe`` is ``--moe-layer-recompute``; the modules meshtron keeps
    are noted at start-up (unknown names and a granularity other than selective are refused by
    ``validation``)."""
    m = cfg.model
    if m.recompute_granularity == "selective" and "moe" in m.recompute_modules:
        m.moe_layer_recompute = True
    kept = [name for name in m.recompute_modules if name in KEPT_MODULES]
    if kept:
        cfg.logging.noted_flags.append(f"--recompute-modules {' '.join(kept)}: not recomputed, their activations are kept (meshtron "
                                       f"estimate counts them); meshtron recomputes {' and '.join(RECOMPUTED_MODULES)}")  # fmt: skip


def _resolve_device_limited_routing(cfg: Config) -> None:
    """Megatron's ``--moe-router-topk-limited-devices N`` (DeepSeek-V2's device-limited routing,
    since folded into group-limited routing there too): the experts of each ep rank form a group
    and a token picks its top-k from the N best groups."""
    m = cfg.model
    if not m.moe_router_topk_limited_devices:
        return
    if m.moe_router_num_groups or m.moe_router_group_topk:
        raise ConfigError("--moe-router-topk-limited-devices N is the older spelling of --moe-router-num-groups <ep> "
                          "--moe-router-group-topk N; give one of them")  # fmt: skip
    m.moe_router_num_groups = cfg.parallel.expert_parallel
    m.moe_router_group_topk = m.moe_router_topk_limited_devices


def world_size_from_env() -> int:
    """torchrun's WORLD_SIZE, else SLURM's task count, else one process."""
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def data_parallel_size(cfg: Config, world_size: int) -> int:
    p = cfg.parallel
    model_parallel = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
    return world_size // model_parallel


def encoder_decoder_layers(m: ModelConfig) -> tuple[int, int]:
    """T5's (encoder, decoder) block counts: ``--encoder-num-layers`` / ``--decoder-num-layers``,
    each ``--num-layers`` when unset (Megatron's rule)."""
    return m.encoder_num_layers or m.num_layers, m.decoder_num_layers or m.num_layers


def virtual_stages(p: ParallelConfig, num_blocks: int) -> int:
    """Model chunks per pipeline rank for a model of ``num_blocks`` blocks (``models.num_blocks``),
    from either of Megatron's two ways to ask for them."""
    if p.num_layers_per_virtual_pipeline_stage:
        return max(1, num_blocks // max(1, p.pipeline_parallel) // p.num_layers_per_virtual_pipeline_stage)
    return p.virtual_pipeline_parallel


def format_config(cfg: Config) -> str:
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines.extend(f"  {k} = {v!r}" for k, v in values.items())
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - a quick way to see the merged config
    print(format_config(build_config(None, sys.argv[1:])))
