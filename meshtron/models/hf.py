"""Hugging Face weight exchange: ``meshtron convert hf-import | hf-export``.

Reads and writes the files ``save_pretrained`` produces (``config.json``, ``model.safetensors``
or shards listed in ``model.safetensors.index.json``, ``tokenizer.json``) with the ``safetensors``
library alone, so neither direction needs ``transformers`` installed. The export streams: it
reads the checkpoint one tensor at a time (``checkpoint/tensor_reader.py``, any saving layout,
no GPU, no process group), the exporters yield the HF tensors layer by layer, and
``hf_shards.py`` writes them into shards of ``--max-shard-size``, so it needs about one shard
plus one layer of memory, not the model's size. Llama-style models
(RMSNorm, SwiGLU, RoPE incl. Llama 3.1 scaling, GQA) go both ways; GPT-2, Mixtral
(``models/hf_mixtral.py``: Llama with routed experts), Qwen2-MoE, Qwen3 and Qwen3-MoE
(``models/hf_qwen.py``: plus q/k/v biases and a gated shared expert, or per-head q/k norms), OLMoE
(``models/hf_olmoe.py``: experts and q/k norms over the whole projections), DeepSeek-V2 (``models/hf_deepseek.py``: latent
attention, YaRN, experts), DeepSeek-V3 (``models/hf_deepseek_v3.py``: sigmoid routing with the expert bias, prediction depths) and BERT (``models/hf_bert.py``: post-LN, token types, masked-LM and
next-sentence heads) go both ways too.

What changes between the two layouts:

* Llama's separate ``q_proj``/``k_proj``/``v_proj`` become the fused ``linear_qkv`` in meshtron's
  per-group order (each kv group's query heads, then its key head, then its value head, see
  ``layers/attention.py``); GPT-2's ``c_attn`` holds [all q | all k | all v] and is regrouped the
  same way. Both use the rotate-half RoPE convention, so no row permutation is needed.
* ``gate_proj``/``up_proj`` become the fused ``linear_fc1`` = [gate | up].
* GPT-2's ``Conv1D`` stores weights as [in, out]; they are transposed to ``nn.Linear``'s [out, in].

Vocabulary: the import keeps the model's exact vocabulary (``make_vocab_size_divisible_by = 1``)
instead of padding it with zero rows. A zero row gives a logit of 0, which a sampler can pick and
a tokenizer cannot decode; exact rows keep logits identical to the source model. A training run
under tp pads the table again for its split (GPT-2's 50257 rows become 50258 at tp2); the padded
rows take no part in any logit or loss, and checkpoints store the real rows only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from meshtron.checkpoint.checkpoint import CheckpointError, save_checkpoint
from meshtron.checkpoint.tensor_reader import CheckpointWeights
from meshtron.config import Config, ModelConfig
from meshtron.models import build_model, spec_for
from meshtron.models.hf_bert import bert_export_tokenizer, bert_import, bert_model_config
from meshtron.models.hf_common import fuse_qkv, import_llama_decoder, llama_model_config
from meshtron.models.hf_decoder import gpt2_pairs
from meshtron.models.hf_deepseek import deepseek_import, deepseek_model_config
from meshtron.models.hf_deepseek_v3 import deepseek_v3_import, deepseek_v3_model_config
from meshtron.models.hf_mixtral import mixtral_import, mixtral_model_config
from meshtron.models.hf_olmoe import olmoe_import, olmoe_model_config
from meshtron.models.hf_qwen import QWEN_TYPES, qwen_import, qwen_model_config
from meshtron.models.hf_shards import DEFAULT_MAX_SHARD_SIZE, INDEX, WEIGHTS, parse_size, write_shards
from meshtron.progress import progress

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
# Written beside an imported checkpoint: ``meshtron train --config`` it to fine-tune that model.
TRAIN_CONFIG = "model_config.yaml"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
EXPORT_DTYPES = {**DTYPES, "fp16": torch.float16}
# Non-parameter buffers some checkpoints carry (recomputed by every implementation).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias", "embeddings.position_ids", "embeddings.token_type_ids")
# TF-era names of LayerNorm parameters in old BERT checkpoints, which transformers renames on load.
_LEGACY_NORM_NAMES = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


# -- configs --------------------------------------------------------------------------------------


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: --hf-dir must be a Hugging Face model folder (save_pretrained's output)")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def model_config_from_hf(hf: dict[str, Any], source: str = CONFIG, names: set[str] | None = None) -> ModelConfig:
    """The meshtron shape of a Hugging Face config; unsupported features raise, naming ``source``.
    BERT's heads are read off its tensor ``names`` (BertForMaskedLM or BertForPreTraining)."""
    kind = hf.get("model_type", "")
    if kind == "bert":
        return bert_model_config(hf, source, names or set())
    if kind == "llama":
        return llama_model_config(hf, source, {}, "Llama (silu, no biases)")
    if kind == "gpt2":
        return _gpt2_model_config(hf, source)
    if kind == "deepseek_v2":
        return deepseek_model_config(hf, source)
    if kind == "deepseek_v3":
        return deepseek_v3_model_config(hf, source, names or set())
    if kind == "mixtral":
        return mixtral_model_config(hf, source)
    if kind in QWEN_TYPES:
        return qwen_model_config(hf, source)
    if kind == "olmoe":
        return olmoe_model_config(hf, source)
    raise CheckpointError(f"{source}: model_type '{kind}' is not supported; hf-import reads 'llama', 'gpt2', 'mixtral', "
                          "'qwen2_moe', 'qwen3', 'qwen3_moe', 'olmoe', 'deepseek_v2', 'deepseek_v3' and 'bert'")  # fmt: skip


def _gpt2_model_config(hf: dict[str, Any], source: str) -> ModelConfig:
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise CheckpointError(f"{source}: GPT-2 attention scaling variants are not supported")
    activations = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
    activation = activations.get(hf.get("activation_function", "gelu_new"))
    if activation is None:
        raise CheckpointError(f"{source}: activation_function '{hf['activation_function']}' is not supported")
    hidden = hf["n_embd"]
    return ModelConfig(
        num_layers=hf["n_layer"], hidden_size=hidden, ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
        num_attention_heads=hf["n_head"], vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=1,
        max_position_embeddings=hf["n_positions"], normalization="LayerNorm",
        norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), activation=activation, position_embedding_type="learned_absolute",
        add_bias_linear=True, tie_embeddings=True,
    )  # fmt: skip


# -- tensors --------------------------------------------------------------------------------------


class HFTensors:
    """The tensors of a Hugging Face folder, handed out once each with their shape checked, so that
    an error names the file and a tensor nobody took (another architecture) is noticed."""

    def __init__(self, hf_dir: str | Path):
        from safetensors.torch import load_file

        root = Path(hf_dir)
        index = root / INDEX
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"{index} is not a safetensors index (no weight_map): {exc}") from None
        elif (root / WEIGHTS).is_file():
            files = [WEIGHTS]
        else:
            raise CheckpointError(f"{root} has neither {WEIGHTS} nor {INDEX}; hf-import reads safetensors weights only")
        self.tensors: dict[str, torch.Tensor] = {}
        self.origin: dict[str, Path] = {}
        missing = [root / name for name in files if not (root / name).is_file()]
        if missing:
            raise CheckpointError(f"weights file {missing[0]} is missing (listed in {index})")
        with progress(sum((root / name).stat().st_size for name in files), "reading safetensors", unit="B", unit_scale=True) as bar:
            for name in files:  # one file is one chunk
                path = root / name
                for key, tensor in load_file(str(path)).items():
                    key = key.removeprefix("transformer.")  # GPT2LMHeadModel's prefix; GPT2Model has none
                    for old, new in _LEGACY_NORM_NAMES.items():
                        key = key.removesuffix(old) + new if key.endswith(old) else key
                    self.tensors[key], self.origin[key] = tensor, path
                bar.update(path.stat().st_size)
        self.root = root

    def take(self, name: str, shape: list[int]) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"tensor {name} is missing from the weights in {self.root} ({CONFIG} implies it)")
        tensor = self.tensors.pop(name)
        if list(tensor.shape) != shape:
            raise CheckpointError(f"{self.origin[name]}: {name} has shape {list(tensor.shape)}, {CONFIG} implies {shape}")
        return tensor

    def check_all_taken(self) -> None:
        left = [k for k in self.tensors if not k.endswith(_IGNORED_SUFFIXES)]
        if left:
            raise CheckpointError(f"{self.origin[left[0]]}: {len(left)} tensors fit no meshtron parameter, e.g. {left[:3]}")


def _gpt2_import(t: HFTensors, m: ModelConfig, expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """``expected``: the meshtron shapes (a Conv1D weight is stored as their transpose)."""
    h, heads = m.hidden_size, m.num_attention_heads
    state = {}
    for hf, mt, transposed in gpt2_pairs(m):
        shape = list(expected[mt])
        state[mt] = t.take(hf, shape[::-1]).T.contiguous() if transposed else t.take(hf, shape)
    for i in range(m.num_layers):
        weight = t.take(f"h.{i}.attn.c_attn.weight", [h, 3 * h]).T
        bias = t.take(f"h.{i}.attn.c_attn.bias", [3 * h])
        state[f"layers.{i}.self_attention.linear_qkv.weight"] = fuse_qkv(*weight.chunk(3), heads)
        state[f"layers.{i}.self_attention.linear_qkv.bias"] = fuse_qkv(*bias.chunk(3), heads)
    t.tensors.pop("lm_head.weight", None)  # tied: the embedding itself, when saved at all
    return state


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Build the model directly in ``dtype``: a bf16 import never holds an fp32 copy of it."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# -- the two directions ---------------------------------------------------------------------------


def import_hf(hf_dir: str | Path, save_dir: str | Path, dtype: str = "bf16") -> Path:
    """Write the Hugging Face model in ``hf_dir`` as a meshtron checkpoint (iteration 0, no
    optimizer) in ``save_dir``, with its tokenizer and a ``model_config.yaml`` for fine-tuning.

    The weights go through a real ``Decoder`` (built in ``dtype``, then loaded strictly), so what
    is saved is exactly what ``meshtron generate`` and ``meshtron train --load`` rebuild.
    """
    hf_dir, save_dir = Path(hf_dir), Path(save_dir)
    hf = read_hf_config(hf_dir)
    tensors = HFTensors(hf_dir)
    m = model_config_from_hf(hf, str(hf_dir / CONFIG), set(tensors.tensors))
    cfg = Config(model=m)
    # The training context: Llama 3.1's original window (the scaled one is for inference), else the table size.
    cfg.data.seq_length = m.rope_original_max_position_embeddings if m.rope_scaling else m.max_position_embeddings
    with _default_dtype(DTYPES[dtype]):
        model = build_model(m, m.vocab_size, cfg.data.seq_length)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if hf["model_type"] == "llama":
        state = import_llama_decoder(tensors, m, m.vocab_size)
    elif hf["model_type"] == "deepseek_v2":
        state = deepseek_import(tensors, m, m.vocab_size)
    elif hf["model_type"] == "deepseek_v3":
        state = deepseek_v3_import(tensors, m, m.vocab_size)
    elif hf["model_type"] == "bert":
        state = bert_import(tensors, m, shapes)
    elif hf["model_type"] == "mixtral":
        state = mixtral_import(tensors, m, m.vocab_size)
    elif hf["model_type"] in QWEN_TYPES:
        state = qwen_import(tensors, m, m.vocab_size)
    elif hf["model_type"] == "olmoe":
        state = olmoe_import(tensors, m, m.vocab_size)
    else:
        state = _gpt2_import(tensors, m, shapes)
    tensors.check_all_taken()
    kept = model.state_dict()  # each tensor in the model's own dtype (a router's fp32 expert bias stays fp32)
    model.load_state_dict({k: v.to(kept[k].dtype) for k, v in state.items()}, strict=True)

    tokenizer = {"tokenizer_type": ""}
    if (hf_dir / TOKENIZER).is_file():
        (save_dir / "tokenizer").mkdir(parents=True, exist_ok=True)
        shutil.copy2(hf_dir / TOKENIZER, save_dir / "tokenizer" / TOKENIZER)
        tokenizer = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": f"tokenizer/{TOKENIZER}"}
        cfg.data.tokenizer_type = "HuggingFaceTokenizer"
        cfg.data.tokenizer_model = str((save_dir / "tokenizer" / TOKENIZER).resolve())
    meta = {"iteration": 0, "consumed_samples": 0, "config": cfg.to_dict(), "vocab_size": m.vocab_size,
            "tokenizer": tokenizer, "hf_source": str(hf_dir.resolve())}  # fmt: skip
    final = save_checkpoint(save_dir, 0, model, None, meta, save_optim=False)
    fields = {"model": cfg.to_dict()["model"], "data": {k: v for k, v in cfg.to_dict()["data"].items() if k.startswith(("tokenizer", "seq"))}}
    (save_dir / TRAIN_CONFIG).write_text(yaml.safe_dump(fields, sort_keys=False))
    return final


def export_hf(load_dir: str | Path, hf_dir: str | Path, dtype: str | None = None, iteration: int | None = None,
              max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> Path:  # fmt: skip
    """Write the newest checkpoint in ``load_dir`` (or ``iteration``'s) as a Hugging Face model folder ``hf_dir``.

    Streamed: the checkpoint (saved under any layout) is read one tensor at a time on the CPU and
    written into safetensors shards of at most ``max_shard_size`` bytes, so memory stays near one
    shard plus one layer's tensors. The model is built on the ``meta`` device only, for its names
    and shapes, which the checkpoint must match exactly. The family's ``hf_export`` hook gives the
    config.json and the tensors under Hugging Face's names (``hf_decoder.py``, ``hf_bert.py``).
    A decoder's vocabulary keeps every row the checkpoint has (a padded one included: HF models
    may have more rows than their tokenizer, as Llama's do), so the logits are those meshtron
    computes; BERT's is cropped to its tokenizer's (``hf_bert.py``), and what changed is printed.
    ``dtype`` (bf16, fp16, fp32): the weights' type; default: the checkpoint's (an fp32 one stays fp32).
    """
    load_dir, hf_dir = Path(load_dir), Path(hf_dir)
    weights = CheckpointWeights(load_dir, iteration, EXPORT_DTYPES[dtype] if dtype else None)
    weights.dtype = weights.dtype or weights.stored_dtype()
    meta = weights.meta
    cfg = Config.from_dict(meta["config"])
    m = cfg.model
    adapter = spec_for(m).hf_export
    if adapter is None:
        raise CheckpointError(f"hf-export: --model-type {m.model_type} has no Hugging Face exporter (its family's hf_export)")
    with torch.device("meta"):  # names and shapes, no memory
        model = build_model(m, meta["vocab_size"], cfg.data.seq_length)
    weights.check_shapes({k: tuple(v.shape) for k, v in model.state_dict().items()})
    hf_config, exported = adapter(weights, cfg, meta, load_dir, weights.dtype, model.max_positions)
    hf_dir.mkdir(parents=True, exist_ok=True)
    write_shards(exported, hf_dir, max_shard_size)
    (hf_dir / CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")
    source = meta.get("tokenizer", {}).get("tokenizer_model", "")
    if source and Path(source).name == TOKENIZER and (load_dir / source).is_file():
        shutil.copy2(load_dir / source, hf_dir / TOKENIZER)
    bert_export_tokenizer(load_dir, hf_dir, meta.get("tokenizer", {}))
    return hf_dir


def main(argv: list[str]) -> int:
    """``meshtron convert hf-import|hf-export``."""
    parser = argparse.ArgumentParser(prog="meshtron convert", description="exchange weights with Hugging Face")
    sub = parser.add_subparsers(dest="direction", required=True)
    imp = sub.add_parser("hf-import", help="Hugging Face folder -> meshtron checkpoint (iteration 0)")
    imp.add_argument("--hf-dir", required=True, help="folder with config.json and *.safetensors (save_pretrained's output)")
    imp.add_argument("--save", required=True, help="meshtron checkpoint directory to write")
    imp.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    exp = sub.add_parser("hf-export", help="meshtron checkpoint -> Hugging Face folder")
    exp.add_argument("--load", required=True, help="checkpoint directory written by --save")
    exp.add_argument("--hf-dir", required=True, help="folder to write config.json and the safetensors shards into")
    exp.add_argument("--dtype", choices=list(EXPORT_DTYPES), default=None, help="the weights' type (default: the checkpoint's)")
    exp.add_argument("--ckpt-step", type=int, default=None, help="iteration to export (default: the newest)")
    exp.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_SIZE,
                     help="largest safetensors file to write, e.g. 5GB (the default, as save_pretrained), 500MB; "
                          "more shards come with model.safetensors.index.json")  # fmt: skip
    args = parser.parse_args(argv)
    if args.direction == "hf-import":
        final = import_hf(args.hf_dir, args.save, args.dtype)
        print(f"wrote {final}; fine-tune with: meshtron train --config {Path(args.save) / TRAIN_CONFIG} "
              f"--load {args.save} --no-load-optim --no-load-rng ...")  # fmt: skip
    else:
        print(f"wrote {export_hf(args.load, args.hf_dir, args.dtype, args.ckpt_step, args.max_shard_size)}")
    return 0
