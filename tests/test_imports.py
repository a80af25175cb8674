"""The import graph of megascale's modules: no cycles, and the layers point one way (docs/architecture.md).

Every import a module runs counts, at its top or inside a function; one under `if TYPE_CHECKING:` is an
annotation's and runs never, so it does not.
"""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megascale"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST) -> list[str]:
    """The megascale modules (and names in them) a module's code imports when it runs."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []  # annotations only (cleared before the walk below reaches them)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return [name for name in found if name.startswith("megascale")]


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {
        name: {target for target in _runtime_imports(ast.parse(path.read_text())) if target in modules}
        - {name}
        for name, path in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target, [*path, target])):
                return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [module])):
            return found
    return None


def test_no_module_imports_itself_through_others():
    cycle = _cycle(import_graph())
    assert cycle is None, "an import loop: " + " -> ".join(cycle)


def test_models_and_the_planner_know_nothing_of_parallelism_resilience_or_the_trainer():
    """Model code is parallelised from outside; the cost model reads a layout's description (parallel/
    dims.py, and parallel/stages.py's split of the layers into stages), never the code that applies it."""
    forbidden = ("megascale.parallel", "megascale.resilience", "megascale.trainer")
    wrong = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.startswith(("megascale.models", "megascale.plan"))
        for target in targets
        if target.startswith(forbidden)
        and not target.startswith(("megascale.parallel.dims", "megascale.parallel.stages"))
    ]
    assert not wrong, "; ".join(wrong)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_layers_below_the_run_import_nothing_above_them():
    """Model, data, optimiser, parallelism, checkpoints, observation and the stores serve the trainer and
    the control plane; they never import them, the cost model, or the command line's tools."""
    below = (
        "megascale.models", "megascale.data", "megascale.optim", "megascale.parallel",
        "megascale.checkpoint", "megascale.observe", "megascale.stores", "megascale.host",
        "megascale.config", "megascale.errors", "megascale.options",
    )  # fmt: skip
    above = (
        "megascale.resilience", "megascale.trainer", "megascale.launch", "megascale.cli",
        "megascale.plan", "megascale.calibrate", "megascale.convert",
    )  # fmt: skip
    wrong = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.startswith(below)
        for target in targets
        if target.startswith(above)
    ]
    assert not wrong, "; ".join(wrong)


def test_the_control_plane_starts_without_torch():
    """The driver and the executors (`megascale launch`) import no torch: each starts in a fraction of a
    second, where importing torch (through the hang view's and the trace reader's modules) took 1.4 s of
    CPU per start."""
    probe = "import sys, megascale.resilience.driver, megascale.resilience.executor; "
    probe += "print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
