"""A conversation as text pieces, each marked as the assistant's (trained on) or not.

Two ways to lay a conversation out:

- the tokenizer's own chat template: the Jinja ``chat_template`` of the Hugging Face
  ``tokenizer_config.json`` (or ``chat_template.jinja``) beside ``--tokenizer-model``, rendered
  with ``jinja2`` as ``transformers`` renders it. Assistant turn ``i`` is the text between the
  rendering of the first ``i`` messages with the generation prompt and the rendering of the
  first ``i + 1`` messages, so what the template appends after the reply (``<|im_end|>``,
  ``<|eot_id|>``) is trained on too and the model learns to stop;
- the plain default, for tokenizers without a template (``--sft-chat-template plain``)::

      System: {content}\\n\\n
      User: {content}\\n\\n
      Assistant: {content}<end of document>

  where ``Assistant: `` is prompt and the reply with the tokenizer's end-of-document id is
  trained on. Other roles are written as their capitalized name.

A piece is text, or a list of token ids (the end-of-document id, which has no spelling in every
tokenizer).
"""

from __future__ import annotations

import json
import os
from datetime import datetime

from meshtron.data.tokenizers import HF_TOKENIZER_ALIASES

PLAIN = "plain"
TEMPLATE_CHOICES = ("auto", "tokenizer", PLAIN)

Piece = tuple[str | list[int], bool]  # (text or token ids, trained on)


def _special_text(value) -> str:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _generation_tag():
    """``{% generation %}...{% endgeneration %}`` (templates that mark the assistant's text for
    transformers) rendered as its body: the turns are located by rendering prefixes instead."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


class ChatTemplate:
    """A Jinja chat template and the special tokens it may name."""

    def __init__(self, source: str, text: str, special_tokens: dict[str, str]):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template {source}: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _generation_tag()])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            self._template = env.from_string(text)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template {source} does not parse: {exc}") from exc
        self.source, self.text, self.special_tokens = source, text, special_tokens

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens)

    def pieces(self, messages: list[dict]) -> list[Piece]:
        """The whole conversation, cut at the start and end of each assistant turn."""
        full = self.render(messages, add_generation_prompt=False)
        out: list[Piece] = []
        done = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix, upto = self.render(messages[:i], add_generation_prompt=True), self.render(messages[: i + 1], add_generation_prompt=False)
            start, end = len(prefix), len(upto)
            if not (full.startswith(upto) and upto.startswith(prefix) and done <= start < end):
                raise ValueError(
                    f"chat template {self.source} renders turn {i} differently in a longer conversation (it rewrites earlier "
                    f"turns), so the assistant's tokens cannot be located; use --sft-chat-template plain"
                )
            out += [(full[done:start], False), (full[start:end], True)]
            done = end
        out.append((full[done:], False))
        return [p for p in out if p[0]]


def find_chat_template(tokenizer_model: str) -> ChatTemplate | None:
    """The chat template of the Hugging Face tokenizer at ``tokenizer_model`` (its folder, or the
    folder of its tokenizer.json), or None when it has none."""
    folder = tokenizer_model if os.path.isdir(tokenizer_model) else os.path.dirname(os.path.abspath(tokenizer_model))
    config_path, jinja_path = os.path.join(folder, "tokenizer_config.json"), os.path.join(folder, "chat_template.jinja")
    config = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    text, source = config.get("chat_template"), config_path
    if isinstance(text, list):  # named templates: the one called "default"
        text = next((t.get("template") for t in text if t.get("name") == "default"), None)
    if not text and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            text, source = f.read(), jinja_path
    if not text:
        return None
    specials = {k: _special_text(v) for k, v in config.items() if k.endswith("_token") and _special_text(v)}
    return ChatTemplate(source, text, specials)


def plain_pieces(messages: list[dict], eod: int) -> list[Piece]:
    """The plain default layout (module docstring)."""
    out: list[Piece] = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "assistant":
            out += [("Assistant: ", False), (content, True), ([eod], True)]
        else:
            out.append((f"{role.capitalize()}: {content}\n\n", False))
    return [p for p in out if p[0]]


def conversation_template(choice: str, tokenizer_type: str, tokenizer_model: str) -> ChatTemplate | None:
    """The template ``--sft-chat-template`` picks: the tokenizer's (``tokenizer``: required;
    ``auto``: when it has one) or None for the plain layout."""
    if choice == PLAIN:
        return None
    found = find_chat_template(tokenizer_model) if tokenizer_model and tokenizer_type in HF_TOKENIZER_ALIASES else None
    if found is None and choice == "tokenizer":
        raise ValueError(
            f"--sft-chat-template tokenizer: no chat_template in the tokenizer_config.json (or chat_template.jinja) beside "
            f"--tokenizer-model '{tokenizer_model}'; use --sft-chat-template plain (or auto)"
        )
    return found
