"""The import graph of megascale's modules: no cycles, the layers point one way (docs/architecture.md), and
every module serves the package, not only its tests.

Every import statement counts: at a module's top, inside a function, and under `if TYPE_CHECKING:` (an
annotation's import runs never, but names a dependency all the same: two modules that name each other are
one module in two files).
"""

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megascale"
# Where a module is started as a program (`python -m megascale.x`, or ["-m", "megascale.x"] in code).
RUN_AS_MAIN = re.compile(r"-m[\"',\s]+(megascale(?:\.\w+)*)")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> list[str]:
    """The megascale modules (and names in them) a module's code imports."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return [name for name in found if name.startswith("megascale")]


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {target for target in _imports(ast.parse(path.read_text())) if target in modules} - {name}
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


def entry_points() -> set[str]:
    """The modules run as programs: the console scripts of pyproject.toml, `__main__` modules, and the
    modules started with `-m` in the package itself (the executors, torchrun's agent), its docs, README and
    deploy/ files."""
    modules = _modules()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = {target.split(":")[0] for target in pyproject["project"]["scripts"].values()}
    found |= {name for name in modules if name.endswith(".__main__")}
    texts = [*PACKAGE.rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    texts += [path for path in (ROOT / "deploy").rglob("*") if path.is_file()]
    for path in texts:
        found |= set(RUN_AS_MAIN.findall(path.read_text(errors="replace")))
    return found & set(modules)


def _reached(graph: dict[str, set[str]], starts: set[str]) -> set[str]:
    """The modules that running `starts` imports: their imports, and the packages that hold each."""
    reached: set[str] = set()
    todo = sorted(starts)
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:end]) for end in range(1, len(parts))]  # its packages' __init__ run first
        todo += graph.get(module, set())  # a folder without __init__.py runs nothing
    return reached


def test_no_module_imports_itself_through_others():
    cycle = _cycle(import_graph())
    assert cycle is None, "an import loop: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_also_through_an_annotations_import():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megascale.x import Y\n")
    assert _imports(tree) == ["megascale.x", "megascale.x.Y"]


def test_models_and_the_planner_know_nothing_of_resilience_or_the_trainer():
    """Model code is parallelised from outside (models/ imports no parallel/ either); the cost model reads
    a layout's description, never the code that runs it."""
    forbidden = {
        "megascale.models": ("megascale.parallel", "megascale.resilience", "megascale.trainer"),
        "megascale.plan": ("megascale.resilience", "megascale.trainer"),
    }
    wrong = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for layer, above in forbidden.items()
        if module.startswith(layer)
        for target in targets
        if target.startswith(above)
    ]
    assert not wrong, "; ".join(wrong)


def test_the_planner_and_the_parallelism_import_nothing_of_each_other():
    """The cost model (plan/) and the code that applies a layout (parallel/) meet only in the trainer and
    the command line: a layout's description shared by both lives below them (config, models)."""
    wrong = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        for this, that in (("megascale.plan", "megascale.parallel"), ("megascale.parallel", "megascale.plan"))
        if (module == this or module.startswith(this + "."))
        and (target == that or target.startswith(that + "."))
    ]
    assert not wrong, "; ".join(wrong)


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


def test_only_the_entry_points_that_make_a_driver_import_the_driver():
    """The driver's parts (nodes, the attempt's watch, the takeover) are typed against the interfaces they
    need; only what creates a Driver imports driver.py."""
    importers = sorted(
        module for module, targets in import_graph().items() if "megascale.resilience.driver" in targets
    )
    assert importers == ["megascale.cli"], importers


def test_every_module_is_run_or_imported_by_the_package():
    """A module only tests import belongs with the tests: each one is an entry point or reached from one."""
    graph = import_graph()
    starts = entry_points()
    assert "megascale.cli" in starts and "megascale.resilience.executor" in starts
    unused = sorted(set(graph) - _reached(graph, starts))
    assert not unused, "imported by nothing of the package, and run as nothing: " + ", ".join(unused)


def test_the_reach_follows_imports_and_packages():
    graph = {"p": set(), "p.main": {"p.a"}, "p.a": {"q.b"}, "q": set(), "q.b": set(), "p.tests_only": set()}
    assert _reached(graph, {"p.main"}) == {"p", "p.main", "p.a", "q", "q.b"}


def test_the_control_plane_starts_without_torch():
    """The driver and the executors (`megascale launch`) import no torch: each starts in a fraction of a
    second, where importing torch (through the hang view's and the trace reader's modules) took 1.4 s of
    CPU per start."""
    probe = "import sys, megascale.resilience.driver, megascale.resilience.executor; "
    probe += "print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
