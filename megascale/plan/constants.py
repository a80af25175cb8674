"""Every named constant of the planner with the comment that cites its source, for `plan --explain`.

Read from the modules that define them: each module-level assignment (and each default of `Features`) whose
value is written with a number other than 0, with the comment above or beside it (constants defined one
after another under one comment share it). A value derived from other code (`OverlapConfig().tp_chunks`)
is not a constant. `tests/plan/test_constants.py` fails on one whose comment matches no `CITATION`.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass

import megascale.plan

# What a source looks like: an arXiv id, a URL, a vendor's datasheet or product brief, or a measurement or
# code of this repository (a section of docs/, the bench that measures it, the module that does it).
CITATION = re.compile(
    r"arXiv:\d{4}\.\d{4,5}|https?://\S+|NVIDIA [\w -]+ (?:datasheet|product brief)"
    r"|docs/[\w-]+\.md#[\w-]+|bench/\w+\.py|megascale/[\w/]+\.py"
)


@dataclass(frozen=True)
class Constant:
    """One named constant: where it lives, its value and the comment that sources it."""

    module: str
    name: str
    value: object
    source: str


def _literal(node: ast.AST | None) -> bool:
    """Whether an expression is written with a number other than 0 (an index into another name's value
    does not count)."""
    if node is None or isinstance(node, ast.Subscript):
        return False
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float) and node.value != 0
    return any(_literal(child) for child in ast.iter_child_nodes(node))


def _comment(lines: list[str], index: int) -> str:
    """The comment beside line `index`, else the comment block above it and above the assignments right
    above it that share that block."""
    if "  # " in lines[index]:
        return lines[index].split("  # ", 1)[1].strip()
    above: list[str] = []
    while (index := index - 1) >= 0 and (line := lines[index].strip()):
        if line.startswith("#"):
            above.insert(0, line[1:].strip())
        elif above or not re.match(r"[A-Za-z_]\w*(: [^=]+)? = ", line):
            break
    return " ".join(above)


def _assignments(body: list[ast.stmt]) -> list[tuple[str, ast.AST | None, int]]:
    found: list[tuple[str, ast.AST | None, int]] = []
    for node in body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            found.append((node.targets[0].id, node.value, node.lineno - 1))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.append((node.target.id, node.value, node.lineno - 1))
    return found


def module_constants(name: str) -> list[Constant]:
    """The constants of `megascale.plan.<name>`, in the order it defines them."""
    module = importlib.import_module(f"megascale.plan.{name}")
    source = inspect.getsource(module)
    lines, tree = source.splitlines(), ast.parse(source)
    found = [
        Constant(name, target, getattr(module, target), _comment(lines, line))
        for target, value, line in _assignments(tree.body)
        if _literal(value)
    ]
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Features":
            found += [
                Constant(name, f"Features.{target}", ast.literal_eval(value), _comment(lines, line))
                for target, value, line in _assignments(node.body)
                if _literal(value) and value is not None
            ]
    return found


def model_constants() -> list[Constant]:
    """Every constant of every module of the planner."""
    names = [info.name for info in pkgutil.iter_modules(megascale.plan.__path__)]
    return [constant for name in names for constant in module_constants(name)]
