"""Style rules that ruff does not check: no function in services/ or shared/ over 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 60


def long_functions(base: Path, roots: tuple[str, ...]) -> list[str]:
    """`path:line name (n lines)` for each function or method under `base / root` longer
    than the limit, counted from its `def` line to its last line (decorators not counted)."""
    found = []
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found.append(f"{path.relative_to(base)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_60_lines() -> None:
    found = long_functions(REPO, ("services", "shared"))
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them into helpers): " + "; ".join(found)


def test_the_check_names_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        f"def short():\n    pass\n\n\nclass C:\n    async def too_long(self):\n{body}\n"
    )
    assert long_functions(tmp_path, ("pkg",)) == [f"pkg/m.py:6 too_long ({MAX_FUNCTION_LINES + 1} lines)"]
