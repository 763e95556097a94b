"""The layers DESIGN.md draws, held by the code: no import cycle (imports inside functions
counted, `if TYPE_CHECKING:` blocks aside), passes never import the rest of fxpipe, planning
never imports the runtime's façade (`fxpipe.pipeline`), no module is over 600 lines, and one
module, the device seam, names `torch.cuda`."""

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Planning, and what it builds on: none of these may reach the Pipeline (`fxpipe.api`, the
# edge offering both `plan` and `compile`, is above them all).
PLANNING = ["fxpipe.planning.measure", "fxpipe.planning.checks", "fxpipe.planning.checks.verification",
            "fxpipe.planning.checks.rounding", "fxpipe.planning.checks.meta", "fxpipe.planning.checks.runs", "fxpipe.planning.search",
            "fxpipe.plans.plan_data", "fxpipe.plans.saved", "fxpipe.plans.report", "fxpipe.planning.reference",
            "fxpipe.runtime.calls", "fxpipe.weights"]

# A module longer than this is split by what it does (a package whose docstring says what each
# part is for); the cost model's parts stay under the tighter limit.
MAX_LINES = 600
TIGHTER = {"passes/cost_model": 400}
# The one module that names `torch.cuda`: everything else asks it.
DEVICE_SEAM = "passes/device.py"


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "passes":
        parts[:1] = ["fxpipe", "passes"]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _too_long(root: pathlib.Path, folders=("fxpipe", "passes")) -> dict[str, int]:
    """The modules under `root`'s `folders` over their limit (`MAX_LINES`, or `TIGHTER`'s for
    a folder it names), by path relative to `root`: their line counts."""
    found = {}
    for path in sorted(p for folder in folders for p in (root / folder).rglob("*.py")):
        name = path.relative_to(root).as_posix()
        limit = next((n for folder, n in TIGHTER.items() if name.startswith(folder + "/")),
                     MAX_LINES)
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found[name] = lines
    return found


def _names_cuda(source: str) -> list[int]:
    """The lines of `source` whose code names `torch.cuda` (an attribute read, an import):
    docstrings and comments aside."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "cuda" and \
                isinstance(node.value, ast.Name) and node.value.id == "torch":
            found.append(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name.startswith("torch.cuda")
                                                  for a in node.names):
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.cuda"):
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and \
                any(a.name == "cuda" for a in node.names):
            found.append(node.lineno)
    return sorted(found)


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


def test_no_module_is_over_600_lines():
    over = _too_long(ROOT)
    assert not over, (f"over {MAX_LINES} lines (the cost model's parts: {TIGHTER}): {over}; "
                      f"split each by what it does, a package whose docstring names its parts")


def test_the_line_count_finds_the_601st_line(tmp_path):
    (tmp_path / "fxpipe" / "sub").mkdir(parents=True)
    (tmp_path / "passes" / "cost_model").mkdir(parents=True)
    (tmp_path / "fxpipe" / "fits.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "fxpipe" / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "passes" / "cost_model" / "part.py").write_text("x = 1\n" * 401)
    assert _too_long(tmp_path) == {"fxpipe/sub/long.py": MAX_LINES + 1,
                                   "passes/cost_model/part.py": 401}


def test_only_the_device_seam_names_torch_cuda():
    named = {path.relative_to(ROOT).as_posix(): lines
             for folder in ("fxpipe", "passes") for path in sorted((ROOT / folder).rglob("*.py"))
             if (lines := _names_cuda(path.read_text()))}
    assert DEVICE_SEAM in named
    others = {name: lines for name, lines in named.items() if name != DEVICE_SEAM}
    assert not others, (f"torch.cuda named outside {DEVICE_SEAM} (module: lines): {others}; "
                        f"ask {DEVICE_SEAM} (add what it lacks there)")


def test_the_seam_check_sees_code_not_prose():
    assert _names_cuda('"""torch.cuda.synchronize"""\n# torch.cuda\nx = "torch.cuda"\n') == []
    assert _names_cuda("import torch\ntorch.cuda.synchronize()\n"
                       "def f(s: torch.cuda.Stream): pass\n"
                       "import torch.cuda\nfrom torch.cuda import Event\n"
                       "from torch import cuda\n") == [2, 3, 4, 5, 6]
