"""Every constant of the planner cites a source: an arXiv id, a URL, a vendor datasheet, or a measurement or
code of this repository; a comment that only explains does not count, and `megascale plan --explain` lists
them all."""

import ast
import inspect
from pathlib import Path

import pytest

from megascale.plan import constants, hardware, step
from megascale.plan.constants import CITATION, model_constants
from megascale.plan.hardware import PROFILES

PLAN = Path(constants.__file__).parent


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
