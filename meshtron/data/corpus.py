"""The embedded corpus: English prose that ships with every Python, so training needs no download.

Documents are the docstrings of the standard library's own modules, one document per file, in
sorted file order so every machine with the same Python builds the same corpus.
"""

from __future__ import annotations

import ast
import os
import sysconfig
import warnings

from meshtron.progress import progress

_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "turtledemo"}
MIN_DOC_CHARS = 200


def _file_docstrings(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escape sequences in old modules
                tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    nodes = [tree] + sorted(
        (n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))),
        key=lambda n: (n.lineno, n.col_offset),
    )
    docs = [ast.get_docstring(n) for n in nodes]
    return "\n\n".join(d.strip() for d in docs if d and d.strip())


def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test"))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py") and not f.startswith("test_"))
    return sorted(files, key=lambda p: os.path.relpath(p, root))


def embedded_corpus_documents(max_bytes: int = 4_000_000) -> list[str]:
    """Docstrings of the Python standard library, one document per file, up to ``max_bytes`` of UTF-8."""
    out, total = [], 0
    with progress(max_bytes, "embedded corpus", unit="B", unit_scale=True) as bar:
        for path in _stdlib_files():
            doc = _file_docstrings(path)
            if len(doc) < MIN_DOC_CHARS:
                continue
            out.append(doc)
            size = len(doc.encode("utf-8"))
            total += size
            bar.update(size)  # one file is one chunk: parsing it costs far more than the update
            if total >= max_bytes:
                break
    if not out:
        raise RuntimeError(f"no docstrings found under {sysconfig.get_paths()['stdlib']}; pass --data-path or --mock-data instead")
    return out
