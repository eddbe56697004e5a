"""The size limits the layout keeps (issue 31): no product file over 400 lines and no function
over 80, so a reader finds one concern per file and one step per function. Read with ``ast``
like the import-cycle test, without importing anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_import_cycles import ROOT, product_modules

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def oversized_files(modules: dict[str, Path]) -> list[str]:
    """``module (N lines)`` for every module longer than :data:`MAX_FILE_LINES`."""
    found = []
    for module, path in modules.items():
        num_lines = len(path.read_text().splitlines())
        if num_lines > MAX_FILE_LINES:
            found.append(f"{module} ({num_lines} lines)")
    return found


def long_functions(modules: dict[str, Path]) -> list[str]:
    """``module.function (N lines)`` for every function longer than :data:`MAX_FUNCTION_LINES`
    (decorators and docstring included: what a reader scrolls through)."""
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                num_lines = node.end_lineno - node.lineno + 1
                if num_lines > MAX_FUNCTION_LINES:
                    found.append(f"{module}.{node.name} ({num_lines} lines)")
    return found


def test_no_product_file_over_the_limit() -> None:
    assert oversized_files(product_modules(ROOT)) == []


def test_no_product_function_over_the_limit() -> None:
    assert long_functions(product_modules(ROOT)) == []


def test_the_limits_are_seen(tmp_path: Path) -> None:
    """The checks find what they look for: a long file and a long function in a made-up tree."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"def long_one():\n{body}\n\n\ndef short_one():\n    return 1\n"
    source += "\n" * (MAX_FILE_LINES - source.count("\n") + 1)
    path = tmp_path / "big.py"
    path.write_text(source)
    modules = {"pkg.big": path}
    assert oversized_files(modules) == [f"pkg.big ({MAX_FILE_LINES + 1} lines)"]
    assert long_functions(modules) == [f"pkg.big.long_one ({MAX_FUNCTION_LINES + 1} lines)"]
