"""``meshtron train --help``: every config field with its one-line description, type, default and
Megatron alias(es), then the Megatron flags accepted for what meshtron does its own way.

The descriptions are the trailing comments of the fields in ``meshtron/config.py`` (and
``model_config.py``, the model section), read once with
``tokenize`` and ``ast`` (the comment is the one source of truth; allowed values are written
there as ``a | b | c``). The aliases come from ``meshtron/flags.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import tokenize
from pathlib import Path

from meshtron import config, model_config
from meshtron.flags import MEGATRON_ALIASES, NOTED_FLAGS, NOTED_VALUE_CHOICES, VALUE_ALIASES


def field_descriptions() -> dict[str, str]:
    """``section.field`` -> the comment at the end of its line in the module defining its section ("" when none)."""
    section_of = {cls.__name__: name for name, cls in config._SECTIONS.items()}
    out = {}
    for module in (config, model_config):
        source = Path(module.__file__).read_text()
        comments = {tok.start[0]: tok.string.lstrip("# ").strip()
                    for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}  # fmt: skip
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef) and node.name in section_of:
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        out[f"{section_of[node.name]}.{item.target.id}"] = comments.get(item.end_lineno, "")
    return out


def megatron_aliases() -> dict[str, list[str]]:
    """``section.field`` -> the Megatron flags that set it (a switch shows the value it sets)."""
    out: dict[str, list[str]] = {}
    for flag, target in MEGATRON_ALIASES.items():
        if isinstance(target, tuple):
            dotted, constant = target
            if constant is None:
                continue
            out.setdefault(dotted, []).append(f"--{flag}" if constant is True else f"--{flag} (= {constant})")
        else:
            out.setdefault(target, []).append(f"--{flag}")
    return out


def help_text(cfg: config.Config) -> str:
    descriptions, aliases = field_descriptions(), megatron_aliases()
    lines = ["usage: meshtron train [--config FILE.toml|.yaml] [--print-config] [--section.field VALUE | --field VALUE | Megatron flag ...]",
             "", "Fields: --section.field (or --field where the name is unique), its type and default, what it does, [Megatron's flags].",
             "A switch (bool) takes no value, or true/false; --no-FIELD turns it off."]  # fmt: skip
    for section, values in cfg.to_dict().items():
        lines.append(f"\n[{section}]")
        for f in dataclasses.fields(getattr(cfg, section)):
            dotted = f"{section}.{f.name}"
            typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            also = f"  [{', '.join(aliases[dotted])}]" if dotted in aliases else ""
            translated = VALUE_ALIASES.get(dotted)
            if translated:
                also += f"  (also Megatron's values: {', '.join(translated)})"
            lines.append(f"  {f.name:<34} {typ:<9} {values[f.name]!r:<14} {descriptions.get(dotted, '')}{also}")
    lines.append("\nMegatron flags accepted for what meshtron does its own way (the start-up log repeats the note):")
    for flag, (takes_value, note) in NOTED_FLAGS.items():
        value = f" {'|'.join(NOTED_VALUE_CHOICES[flag])}" if flag in NOTED_VALUE_CHOICES else " VALUE" if takes_value else ""
        lines.append(f"  --{flag}{value}: {note}")
    return "\n".join(lines)
