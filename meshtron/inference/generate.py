"""Text generation with a KV cache: greedy, or sampled with temperature, top-k and top-p; for
decoders (the prompt continued) and encoder–decoders (T5: the prompt encoded, the output decoded).

Meant for sanity checks after training and for evaluation, one prompt at a time: the prompt is
run through the model once (prefill), then each new token costs one single-position forward.
"""

from __future__ import annotations

import re
import sys
from typing import Callable

import torch

from meshtron.checkpoint.saved_model import load_saved_model


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of the last dim (others -inf); k <= 0 keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least ``p``."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already reach p; the top one never is.
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> int:
    """One token id from logits [V]; greedy (or temperature 0) takes the argmax."""
    if greedy or temperature <= 0:
        return int(logits.argmax())
    logits = top_p_filter(top_k_filter(logits.float() / temperature, top_k), top_p)
    return int(torch.multinomial(logits.softmax(dim=-1), 1, generator=generator))


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    eod: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Continue ``prompt_ids`` with ``model`` (a language model with ``new_kv_cache``); returns only the new tokens.

    Stops after ``max_new_tokens``, at ``eod`` (which is not returned), or when the model's
    position tables are full. The model runs in eval mode (no dropout) and is put back after.
    ``generator`` (on the model's device) makes sampling reproducible.
    """
    _check_prompt(model, prompt_ids)
    sampling = (temperature, top_k, top_p, greedy, generator)
    return _decode(model, prompt_ids, len(prompt_ids) + max_new_tokens, max_new_tokens, eod, sampling,
                   lambda tokens, cache: model(tokens, kv_cache=cache))  # fmt: skip


@torch.no_grad()
def generate_encoder_decoder(
    model,
    encoder_ids: list[int],
    max_new_tokens: int,
    start: int,
    end: int | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The decoder's output for encoder input ``encoder_ids`` (T5: text with sentinels), after
    the ``start`` token; returns the new tokens, stopping at ``end`` (not returned).

    The encoder runs once, and so do the cross-attention's key and value projections of its
    output; each decoder step is one single-position forward, its self-attention reading the
    decoder's KV cache.
    """
    _check_prompt(model, encoder_ids)
    sampling = (temperature, top_k, top_p, greedy, generator)
    memory = {}  # the encoder's output, projected once: computed in eval mode inside _decode

    def step(tokens: torch.Tensor, cache) -> torch.Tensor:
        if not memory:
            memory["kv"] = model.cross_attention_memory(model.encode(torch.tensor([encoder_ids], device=tokens.device)))
        return model.decode(tokens, memory["kv"], kv_cache=cache)

    return _decode(model, [start], 1 + max_new_tokens, max_new_tokens, end, sampling, step)


def _check_prompt(model, ids: list[int]) -> None:
    if not ids:
        raise ValueError("generate needs a non-empty prompt")
    if len(ids) > model.max_positions:
        raise ValueError(f"prompt of {len(ids)} tokens exceeds the model's {model.max_positions} positions")


def _decode(model, first: list[int], length: int, max_new_tokens: int, stop: int | None, sampling: tuple,
            step: Callable[[torch.Tensor, object], torch.Tensor]) -> list[int]:  # fmt: skip
    """The sampling loop both generators share: ``step(tokens, cache)`` gives logits [1, t, V] for
    the new positions; ``first`` goes in at once, then one sampled token per step until
    ``max_new_tokens``, ``stop`` (not returned) or ``length`` positions (capped by the model's).
    The model runs in eval mode and is put back after."""
    param = next(model.parameters())
    max_length = min(length, model.max_positions)
    cache = model.new_kv_cache(1, max_length, param.dtype, param.device)
    was_training = model.training
    model.eval()
    try:
        tokens = torch.tensor([first], device=param.device)
        out: list[int] = []
        while len(out) < max_new_tokens and cache.length < max_length:
            token = sample_next(step(tokens, cache)[0, -1], *sampling)
            if token == stop:
                break
            out.append(token)
            tokens = torch.tensor([[token]], device=param.device)
    finally:
        model.train(was_training)
    return out


def encode_with_sentinels(tokenizer, text: str) -> list[int]:
    """``text`` as ids, each ``<extra_id_N>`` in it as the tokenizer's sentinel N (T5 prompts:
    WordPiece would otherwise split the marker into pieces)."""
    sentinels = list(getattr(tokenizer, "additional_special_tokens_ids", []))
    ids: list[int] = []
    for i, piece in enumerate(re.split(r"<extra_id_(\d+)>", text)):
        if i % 2 == 0:
            ids += tokenizer.encode(piece) if piece.strip() else []
        elif int(piece) < len(sentinels):
            ids.append(sentinels[int(piece)])
        else:
            raise ValueError(f"<extra_id_{piece}> is beyond the tokenizer's {len(sentinels)} sentinels (--vocab-extra-ids)")
    return ids


def generate_from_checkpoint(
    load_dir: str,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    seed: int = 0,
    device: str = "auto",
    iteration: int | None = None,
    tokenizer: dict[str, str] | None = None,
) -> str:
    """``meshtron generate``: rebuild the model and tokenizer a ``--save`` directory describes (its
    newest checkpoint, or ``iteration``'s; ``checkpoint/saved_model.py``), and return ``prompt``
    followed by its continuation (T5: the decoder's output for ``prompt``, whose ``<extra_id_N>``
    markers are the sentinels). Unlike ``hf-export``, which streams the checkpoint tensor by tensor,
    this loads the whole model into one process: generating needs every weight in memory anyway.
    ``tokenizer``: ``build_tokenizer``'s arguments where the checkpoint has none (or another is wanted)."""
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    saved = load_saved_model(load_dir, iteration, tokenizer=tokenizer)
    model, tokenizer, cfg = saved.model, saved.tokenizer, saved.config
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    model.to(dev)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy, generator=torch.Generator(device=dev).manual_seed(seed))
    if cfg.model.model_type == "t5":  # the prompt is the encoder's input; the output, the decoder's
        ids = generate_encoder_decoder(model, encode_with_sentinels(tokenizer, prompt), max_new_tokens, tokenizer.bos, tokenizer.eos, **sampling)
        return tokenizer.decode(ids)
    ids = tokenizer.encode(prompt)
    room = model.max_positions - len(ids)
    if max_new_tokens > room:
        print(f"note: the model has {model.max_positions} positions: at most {max(room, 0)} new tokens follow the "
              f"{len(ids)}-token prompt, not {max_new_tokens}", file=sys.stderr)  # fmt: skip
    return prompt + tokenizer.decode(generate(model, ids, max_new_tokens, eod=tokenizer.eod, **sampling))
