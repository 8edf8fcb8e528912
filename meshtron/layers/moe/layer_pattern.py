"""Which layers are MoE: Megatron-Core's ``--moe-layer-freq``, an int or a Python-list expression.

Megatron evaluates the list form (``([0]+[1]*26)``) as Python. A config value must never run code,
so this reads the few forms such lists take with a tiny grammar of its own:

    expr := term ('+' term)*          term := [INT '*'] atom ['*' INT]
    atom := '[' INT (',' INT)* ']' | '(' expr ')'
"""

from __future__ import annotations

import re

from meshtron.config import ModelConfig

_TOKEN = re.compile(r"\s*(\d+|[\[\](),+*])")
_MAX_ENTRIES = 100_000  # far above any layer count; stops "[1]*10**12"-sized lists before they are built


def parse_layer_freq(text: str, num_layers: int) -> list[bool]:
    """``moe_layer_freq`` -> one bool per layer (True: MoE). Raises ValueError naming the problem."""
    text = text.strip()
    if text.isdigit():
        every = int(text)
        if every < 1:
            raise ValueError(f"--moe-layer-freq {text}: an integer frequency must be at least 1")
        return [i % every == 0 for i in range(num_layers)]
    pattern = _ListExpression(text).parse()
    if any(v not in (0, 1) for v in pattern):
        raise ValueError(f"--moe-layer-freq {text}: entries must be 0 (dense) or 1 (MoE)")
    if len(pattern) != num_layers:
        raise ValueError(f"--moe-layer-freq {text} names {len(pattern)} layers but --num-layers is {num_layers}")
    return [v == 1 for v in pattern]


def moe_layer_pattern(cfg: ModelConfig) -> list[bool]:
    """One bool per layer: True where the MLP is a mixture of experts (all False without experts)."""
    if cfg.num_experts == 0:
        return [False] * cfg.num_layers
    return parse_layer_freq(cfg.moe_layer_freq, cfg.num_layers)


class _ListExpression:
    """Recursive-descent reader of the grammar above; anything else is refused, never evaluated."""

    def __init__(self, text: str):
        self.text = text = text.strip()
        self.tokens: list[str] = []
        pos = 0
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None:
                raise self.error(f"unexpected '{text[pos:].strip()[:20]}'")
            self.tokens.append(match.group(1))
            pos = match.end()
        self.pos = 0

    def error(self, why: str) -> ValueError:
        return ValueError(f"--moe-layer-freq '{self.text}': {why}; write an integer or a list like ([0]+[1]*26)")

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise self.error(f"expected '{expected or 'more'}' at token {self.pos + 1}")
        self.pos += 1
        return token

    def integer(self) -> int:
        token = self.take()
        if not token.isdigit():
            raise self.error(f"expected a number, got '{token}'")
        return int(token)

    def parse(self) -> list[int]:
        result = self.expr()
        if self.peek() is not None:
            raise self.error(f"unexpected '{self.peek()}' at token {self.pos + 1}")
        return result

    def expr(self) -> list[int]:
        result = self.term()
        while self.peek() == "+":
            self.take("+")
            result = result + self.term()
            if len(result) > _MAX_ENTRIES:
                raise self.error(f"more than {_MAX_ENTRIES} entries")
        return result

    def term(self) -> list[int]:
        repeat = 1
        if self.peek() is not None and self.peek().isdigit():
            repeat = self.integer()
            self.take("*")
        result = self.repeated(self.atom(), repeat)
        if self.peek() == "*":
            self.take("*")
            result = self.repeated(result, self.integer())
        return result

    def repeated(self, items: list[int], times: int) -> list[int]:
        if len(items) * times > _MAX_ENTRIES:
            raise self.error(f"more than {_MAX_ENTRIES} entries")
        return items * times

    def atom(self) -> list[int]:
        if self.peek() == "(":
            self.take("(")
            result = self.expr()
            self.take(")")
            return result
        self.take("[")
        result = [self.integer()]
        while self.peek() == ",":
            self.take(",")
            result.append(self.integer())
        self.take("]")
        return result
