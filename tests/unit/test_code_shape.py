"""Promises about the shape of the code that a test can hold: the model contract keeps model
knowledge in ``models/`` (and ``layers/``), no library file outgrows one concept, and no module
imports a module that imports it back, directly or through others, at any depth of a function."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "meshtron"
MODEL_KNOWLEDGE = ("models", "layers")
# The decoder's class and its submodules' attribute names: what code outside models/ must not name.
DECODER_NAMES = re.compile(r"\b(Decoder|TransformerBlock|final_norm|position_embedding|self_attention|linear_qkv|"
                           r"linear_proj|linear_fc1|linear_fc2|input_layernorm|pre_mlp_layernorm)\b|(?<!meshtron)\.layers\b|(?<!F)\.embedding\b")  # fmt: skip


def _sources() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in ROOT.rglob("*.py")}


def test_no_library_file_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these by concept: {long}"


def test_no_class_assignment_on_live_modules():
    """Kernel options (FP8 linears, fused weight gradients) enter by module replacement, as the
    parallel plan does: no ``obj.__class__ = ...`` anywhere in the library."""
    offenders = []
    for module, path in _sources().items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets):
                offenders.append(f"{module}:{node.lineno}")
    assert not offenders, offenders


def _mentions_model_type(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "model_type" or isinstance(n, ast.Name) and n.id == "model_type"
               for n in ast.walk(node))  # fmt: skip


def test_only_models_dispatch_on_the_family():
    """Outside ``models/`` code asks the family's spec (``models.registry``): no comparison (``==``,
    ``!=``, ``in``) or ``match`` on ``model_type`` or a family's name, and no dict keyed by a family's
    name, so a family registered elsewhere is never left out of a branch."""
    from meshtron.models import family_names

    names = set(family_names())

    def is_name(n: ast.AST) -> bool:
        return isinstance(n, ast.Constant) and n.value in names

    offenders = []
    for module, path in _sources().items():
        if module.split(".")[1:2] == ["models"]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
            if (any(_mentions_model_type(o) or is_name(o) for o in operands)
                    or isinstance(node, ast.Match) and _mentions_model_type(node.subject)
                    or isinstance(node, ast.Dict) and any(k is not None and is_name(k) for k in node.keys)):  # fmt: skip
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert not offenders, "outside models/, code dispatches on the model type instead of asking its spec:\n" + "\n".join(offenders)


def test_only_models_and_layers_name_the_decoder():
    offenders = []
    for module, path in _sources().items():
        if module.split(".")[1:2] and module.split(".")[1] in MODEL_KNOWLEDGE:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if DECODER_NAMES.search(code):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "outside models/ and layers/, code names the decoder:\n" + "\n".join(offenders)


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Every meshtron module ``module`` imports, at top level or inside functions, with the
    packages whose ``__init__`` that import runs first (but not ``module``'s own packages, which
    are already running when it is imported)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            names = [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            base, names = None, [a.name for a in node.names]
        else:
            continue
        for name in names + ([base] if base else []):
            if name in known and name != module:
                out.add(name)
    own = {module.rsplit(".", i)[0] for i in range(module.count("."))}
    parents = {name.rsplit(".", i)[0] for name in out for i in range(1, name.count("."))}
    return (out | parents) - own - {"meshtron"}


def test_no_import_cycles():
    sources = _sources()
    graph = {m: _imports(m, p, set(sources)) & set(sources) for m, p in sources.items()}
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
