"""The package stays readable in pieces: no function over 80 lines, no module over 600 (docs/architecture.md).
A function that grows past the bar is split into the steps it already names; a module, into one idea each."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megascale"
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 600


def test_no_function_is_over_80_lines():
    long = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, "functions over 80 lines: " + "; ".join(long)


def test_no_module_is_over_600_lines():
    long = [
        f"{path.relative_to(PACKAGE.parent)} ({count})"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "modules over 600 lines: " + "; ".join(long)
