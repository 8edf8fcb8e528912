"""The benchmarks' child-process protocol: a side's RESULT line comes back, a failing side is None."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from child import run_child  # noqa: E402


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); {code}"]


def test_result_of_the_child_comes_back(capsys):
    code = "from child import report; print('noise'); report({'side': 'a', 'tokens': 1}); report({'side': 'a', 'tokens': 2})"
    assert run_child(_python(code), "a") == {"side": "a", "tokens": 2}


def test_a_failing_child_is_reported_and_gives_none(capsys):
    assert run_child(_python("from child import report; report({'x': 1}); raise SystemExit(3)"), "b") is None
    assert "b: failed (exit 3)" in capsys.readouterr().out
    assert run_child(_python("print('no result')"), "c") is None
