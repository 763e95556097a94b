"""The layers DESIGN.md draws, held by the code: no import cycle (imports inside functions
counted, `if TYPE_CHECKING:` blocks aside), passes never import the rest of fxpipe, and
planning never imports the runtime's façade (`fxpipe.pipeline`)."""

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Planning, and what it builds on: none of these may reach the Pipeline (`fxpipe.api`, the
# edge offering both `plan` and `compile`, is above them all).
PLANNING = ["fxpipe.measure", "fxpipe.checks", "fxpipe.search", "fxpipe.plan_data",
            "fxpipe.saved", "fxpipe.report", "fxpipe.reference", "fxpipe.runtime.calls"]


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "passes":
        parts[:1] = ["fxpipe", "passes"]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_name(p): p for folder in ("fxpipe", "passes") for p in (ROOT / folder).rglob("*.py")}


def _imported(name: str, path: pathlib.Path, modules) -> set[str]:
    """The modules of ours `name` imports anywhere but under `if TYPE_CHECKING:`; a package
    it imports from counts as its module where the name is one."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped = {id(sub) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for sub in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # Importing an enclosing package is importing oneself's ancestor: no edge.
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, target) for target in _imported(name, path, modules))
    return graph


def test_no_module_imports_itself_back():
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles)


def test_passes_import_nothing_of_fxpipe_above_them():
    graph = _graph()
    above = {(a, b) for a, b in graph.edges
             if a.startswith("fxpipe.passes") and not b.startswith("fxpipe.passes")
             and b != "fxpipe"}
    assert not above


def test_planning_never_reaches_the_pipeline_facade():
    graph = _graph()
    for module in PLANNING:
        assert module in graph, module
        reached = nx.descendants(graph, module)
        assert "fxpipe.pipeline" not in reached, (
            f"{module} reaches fxpipe.pipeline: "
            f"{' -> '.join(nx.shortest_path(graph, module, 'fxpipe.pipeline'))}")


def test_the_analysis_sees_imports_inside_functions_and_skips_type_checking(tmp_path):
    modules = {"fxpipe.a": tmp_path / "a.py", "fxpipe.b": tmp_path / "b.py",
               "fxpipe.c": tmp_path / "c.py"}
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from .c import C\n"
                                   "def f():\n    from .b import g\n")
    assert _imported("fxpipe.a", modules["fxpipe.a"], modules) == {"fxpipe.b"}
