"""Every constant of the planner cites a source: an arXiv id, a URL, a vendor datasheet, or a measurement or
code of this repository; a comment that only explains does not count.

The constants are read from the modules that define them: each module-level assignment (and each default of
`Features`) whose value is written with a number other than 0, with the comment above or beside it
(constants defined one after another under one comment share it). A value derived from other code
(`OverlapConfig().tp_chunks`) is not a constant.
"""

import ast
import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import megascale.plan
from megascale.plan import hardware, step
from megascale.plan.hardware import PROFILES

PLAN = Path(megascale.plan.__file__).parent

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


def module_constants(name: str) -> list[Constant]:
    """The constants of `megascale.plan.<name>` (and of its `Features`), in the order it defines them."""
    module = importlib.import_module(f"megascale.plan.{name}")
    lines = inspect.getsource(module).splitlines()
    tree = ast.parse("\n".join(lines))
    features = [node.body for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Features"]
    found = []
    for prefix, body in [("", tree.body), *(("Features.", body) for body in features)]:
        for node in body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and _literal(node.value):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                assert isinstance(target, ast.Name) and node.value is not None
                value = ast.literal_eval(node.value) if prefix else getattr(module, target.id)
                found.append(Constant(name, prefix + target.id, value, _comment(lines, node.lineno - 1)))
    return found


def model_constants() -> list[Constant]:
    """Every constant of every module of the planner."""
    names = [info.name for info in pkgutil.iter_modules(megascale.plan.__path__)]
    return [constant for name in names for constant in module_constants(name)]


def test_every_constant_of_the_planner_cites_a_source():
    found = model_constants()
    uncited = [
        f"{c.module}.{c.name}: {c.source or '(no comment)'}" for c in found if not CITATION.search(c.source)
    ]
    assert not uncited, "\n".join(uncited)
    names = {(c.module, c.name) for c in found}
    assert {
        ("hardware", "GEMM_EFFICIENCY"),
        ("compute", "FLOAT8_GRAD_CAST_BYTES"),
        ("search", "MEMORY_HEADROOM"),
    } <= names
    assert ("job", "Features.loss_bytes_per_logit") in names and ("systems", "MEGATRON_CORE") in names


def test_a_value_derived_from_other_code_is_no_constant_and_a_shared_comment_is_shared():
    names = {c.name: c for c in model_constants()}
    assert "TP_OVERLAP_CHUNKS" not in names and step.TP_OVERLAP_CHUNKS == 4  # OverlapConfig().tp_chunks
    assert names["ELEMENTWISE_PASSES_FUSED"].source == names["ELEMENTWISE_PASSES_UNFUSED"].source
    assert names["NETWORK_LATENCY_S"].value == hardware.NETWORK_LATENCY_S


def numbers(node: ast.AST) -> list[object]:
    """The numbers an expression is written with, leaving out indexes into other names' values."""
    if isinstance(node, ast.Subscript):
        return numbers(node.value)
    if isinstance(node, ast.Constant):
        return [node.value] if type(node.value) in (int, float) else []
    return [number for child in ast.iter_child_nodes(node) for number in numbers(child)]


def test_every_number_assigned_at_a_modules_top_is_listed():
    """The listing reads the same assignments the planner's modules make: none escapes it."""
    listed = {(c.module, c.name) for c in model_constants()}
    for path in PLAN.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value and any(numbers(node.value)):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                assert (path.stem, getattr(target, "id", None)) in listed, (path.name, ast.unparse(target))


@pytest.mark.parametrize(
    "comment",
    [
        "about 80% of the link rate",  # a bare claim
        "the paper's §3.2, Fig. 3",  # a section of a paper it does not name
        "see docs/planning.md",  # a page, not the measurement in it
    ],
)
def test_a_comment_that_names_no_source_is_no_citation(comment):
    assert not CITATION.search(comment)


def test_every_gpu_profile_cites_its_vendors_datasheet():
    for profile in PROFILES.values():
        assert CITATION.search(profile.source), profile.source
    assert "NVIDIA GB200 NVL72 datasheet" in inspect.getsource(hardware)
