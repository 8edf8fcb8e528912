"""``meshtron generate``: a checkpoint's model continues a prompt, by its family's ``generate``
hook (``models.registry``; the sampling loops are ``sampling.py``'s)."""

from __future__ import annotations

import torch

from meshtron.checkpoint.saved_model import load_saved_model
from meshtron.models import spec_for


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
    hook = spec_for(cfg.model).generate
    if hook is None:
        raise ValueError(f"{load_dir} holds a --model-type {cfg.model.model_type} model, which does not generate text")
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    model.to(dev)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy, generator=torch.Generator(device=dev).manual_seed(seed))
    return hook(model, tokenizer, prompt, max_new_tokens, sampling)
