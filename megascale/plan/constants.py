"""Every named constant of the cost model with the comment that gives its source, for `plan --explain`.

They are read from the modules that define them (module-level UPPER_CASE numbers, tuples and dicts of
numbers, with the comment above or beside each), so a constant added to the model is listed without being
registered twice, and `tests/plan/test_constants.py` fails on one that has no source.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, fields
from types import ModuleType

from megascale.plan import comm, compute, context, experts, memory, search, step
from megascale.plan.hardware import HardwareProfile

# The modules whose constants price a step or bound the search.
MODEL_MODULES: tuple[ModuleType, ...] = (compute, step, comm, context, experts, memory, search)


@dataclass(frozen=True)
class Constant:
    """One named constant: where it lives, its value and the comment that sources it."""

    module: str
    name: str
    value: object
    source: str


def _numeric(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return True
    if isinstance(value, tuple):
        return all(_numeric(item) for item in value)
    if isinstance(value, dict):
        return all(_numeric(item) for item in value.values())
    return False


def _comment(lines: list[str], index: int) -> str:
    """The comment beside line `index`, else the comment block above it and the definitions right
    above it that share that block (a pair of constants under one comment)."""
    if "  # " in lines[index]:
        return lines[index].split("  # ", 1)[1].strip()
    above: list[str] = []
    index -= 1
    while index >= 0 and lines[index].strip():
        line = lines[index].strip()
        if line.startswith("#"):
            above.insert(0, line[1:].strip())
        elif above or not _defines(line):
            break
        index -= 1
    return " ".join(above)


def _defines(line: str) -> bool:
    """Whether a line assigns or declares a name (`NAME = ...`, `name: type`)."""
    head = line.split("=", 1)[0].split(":", 1)[0].strip()
    return head.isidentifier() and ("=" in line or ":" in line)


def module_constants(module: ModuleType) -> list[Constant]:
    """`module`'s public numeric constants, in the order it defines them."""
    source = inspect.getsource(module)
    lines = source.splitlines()
    found = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign | ast.AnnAssign):
            continue
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if isinstance(target, ast.Name) and target.id.isupper() and not target.id.startswith("_"):
                value = getattr(module, target.id)
                if _numeric(value):
                    short = module.__name__.rsplit(".", 1)[-1]
                    found.append(Constant(short, target.id, value, _comment(lines, node.lineno - 1)))
    return found


def model_constants() -> list[Constant]:
    """Every constant of the cost model's modules."""
    return [constant for module in MODEL_MODULES for constant in module_constants(module)]


def profile_constants(profile: HardwareProfile) -> list[Constant]:
    """A hardware profile's numbers, each with the comment its field carries in `HardwareProfile` (the
    datasheet figures are sourced by the profile's `source`)."""
    lines = inspect.getsource(HardwareProfile).splitlines()
    described = {
        line.strip().split(":", 1)[0]: _comment(lines, index)
        for index, line in enumerate(lines)
        if _defines(line.strip())
    }
    return [
        Constant("profile", field.name, value, described.get(field.name) or f"datasheet: {profile.source}")
        for field in fields(profile)
        if _numeric(value := getattr(profile, field.name))
    ]
