"""The layers DESIGN.md draws, held by the code: every module of fxpipe/ and passes/ on exactly
one layer of its `layers` block, importing only from its own layer or those below (imports
inside functions and under `if TYPE_CHECKING:` counted); no import cycle, type-only imports
included; passes never import the rest of fxpipe, planning never reaches the runtime's façade
(`fxpipe.pipeline`), no module is over 600 lines, and one module, the device seam, names
`torch.cuda`."""

import ast
import functools
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent

DESIGN = ROOT / "DESIGN.md"
# Planning and the layers below it: none of their modules may reach the Pipeline.
PLANNING_AND_BELOW = "planning"

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


def _imported(name: str, path: pathlib.Path, modules, type_checking: bool = False) -> set[str]:
    """The modules of ours `name` imports anywhere (in functions too), but under `if
    TYPE_CHECKING:` unless `type_checking`; a package it imports from counts as its module
    where the name is one."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped = set() if type_checking else {
        id(sub) for node in ast.walk(tree)
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


@functools.cache
def _graph(type_checking: bool = False) -> nx.DiGraph:
    """Who imports whom among our modules (read once a run: the tests only read it)."""
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, target)
                             for target in _imported(name, path, modules, type_checking))
    return graph


def layers_block(text: str) -> list[tuple[str, list[str]]]:
    """DESIGN.md's `layers` block, top to bottom: (layer, its entries). An entry names a module
    of fxpipe/ by its path there (`api`, `runtime.schedules`), `fxpipe` the package's own
    `__init__`, and one ending in `/` a package with everything under it (`passes/` is
    fxpipe.passes)."""
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    layers = []
    for line in block.splitlines():
        if line.strip() and not line.startswith("#"):
            layer, _, entries = line.partition(":")
            layers.append((layer.strip(), entries.split()))
    return layers


def _matches(entry: str, module: str) -> bool:
    name = "fxpipe" if entry == "fxpipe" else "fxpipe." + entry.rstrip("/")
    return module == name or (entry.endswith("/") and module.startswith(name + "."))


def placement(layers, modules) -> tuple[dict[str, int], list[str]]:
    """Each module's layer (its index, 0 the top), and the problems: a module on no layer, or
    on more than one."""
    where, problems = {}, []
    for module in sorted(modules):
        found = [i for i, (_, entries) in enumerate(layers)
                 if any(_matches(entry, module) for entry in entries)]
        if not found:
            problems.append(f"{module} is on no layer")
        elif len(found) > 1:
            problems.append(f"{module} is on layers {', '.join(layers[i][0] for i in found)}")
        else:
            where[module] = found[0]
    return where, problems


def upward(layers, where: dict[str, int], graph: nx.DiGraph) -> list[str]:
    """The imports that go up: from a module to one on a layer above its own."""
    return [f"{a} ({layers[where[a]][0]}) imports {b} ({layers[where[b]][0]}, above)"
            for a, b in sorted(graph.edges) if a in where and b in where and where[b] < where[a]]


def test_every_module_is_on_exactly_one_layer():
    _, problems = placement(layers_block(DESIGN.read_text()), _modules())
    assert not problems, ("DESIGN.md's layers block must place every module once: "
                          + "; ".join(problems) + "; add each to the layer of what it imports")


def test_each_module_imports_only_from_its_layer_or_below():
    layers = layers_block(DESIGN.read_text())
    where, _ = placement(layers, _modules())
    up = upward(layers, where, _graph(type_checking=True))
    assert not up, ("imports against DESIGN.md's layer order: " + "; ".join(up) +
                    "; move what is imported down, or the importer up")


def test_the_layer_check_finds_an_upward_import_and_an_unplaced_module():
    layers = [("edge", ["api"]), ("planning", ["planning/"]), ("passes", ["passes/"])]
    modules = ["fxpipe.api", "fxpipe.planning", "fxpipe.planning.search",
               "fxpipe.passes.errors", "fxpipe.stray"]
    where, problems = placement(layers, modules)
    assert problems == ["fxpipe.stray is on no layer"]
    graph = nx.DiGraph([("fxpipe.api", "fxpipe.planning.search"),
                        ("fxpipe.planning.search", "fxpipe.passes.errors"),
                        ("fxpipe.passes.errors", "fxpipe.planning")])
    assert upward(layers, where, graph) == [
        "fxpipe.passes.errors (passes) imports fxpipe.planning (planning, above)"]
    twice = [("edge", ["api", "planning/"]), *layers[1:]]
    assert placement(twice, ["fxpipe.planning.search"])[1] == [
        "fxpipe.planning.search is on layers edge, planning"]


def test_no_module_imports_itself_back():
    cycles = list(nx.simple_cycles(_graph(type_checking=True)))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles)


def test_passes_import_nothing_of_fxpipe_above_them():
    graph = _graph()
    above = {(a, b) for a, b in graph.edges
             if a.startswith("fxpipe.passes") and not b.startswith("fxpipe.passes")
             and b != "fxpipe"}
    assert not above


def test_planning_never_reaches_the_pipeline_facade():
    graph = _graph()
    layers = layers_block(DESIGN.read_text())
    where, _ = placement(layers, graph.nodes)
    first = [name for name, _ in layers].index(PLANNING_AND_BELOW)
    planning = [module for module, layer in where.items() if layer >= first]
    assert "fxpipe.planning.build" in planning and "fxpipe.pipeline" not in planning
    for module in planning:
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
    assert _imported("fxpipe.a", modules["fxpipe.a"], modules, type_checking=True) == {
        "fxpipe.b", "fxpipe.c"}


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


# ---- device kinds: only the seam tests one ---------------------------------------------------

# Modules allowed to test a device's kind themselves, each with its reason (none today: ask
# `fxpipe.passes.device.kind_of`, `is_cpu`, `is_gpu`).
KIND_TESTS_ALLOWED: dict[str, str] = {}
NOT_A_KIND = {"meta"}    # a tensor without values: no device kind, tested where it is


def _tests_a_kind(source: str) -> list[int]:
    """The lines of `source` whose code tests a device's kind by name: "cuda" compared
    (`dev.type == "cuda"`, `"cuda" in str(dev)`), a `.type` compared to a kind's name, an
    `is_cuda` read, a `torch.device("cuda", i)` made; docstrings, comments and messages aside."""
    def cuda(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and \
            node.value.split(":")[0] == "cuda"

    def a_type(node):
        return isinstance(node, ast.Attribute) and node.attr == "type"

    def a_kind(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and \
            node.value not in NOT_A_KIND

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(cuda, sides)) or (any(map(a_type, sides)) and any(map(a_kind, sides))):
                found.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "is_cuda":
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("device") and \
                node.args and cuda(node.args[0]):
            found.append(node.lineno)
    return sorted(found)


def test_only_the_device_seam_tests_a_device_kind():
    found = {path.relative_to(ROOT).as_posix(): lines
             for folder in ("fxpipe", "passes") for path in sorted((ROOT / folder).rglob("*.py"))
             if (lines := _tests_a_kind(path.read_text()))}
    found.pop(DEVICE_SEAM, None)
    others = {name: lines for name, lines in found.items() if name not in KIND_TESTS_ALLOWED}
    assert not others, (f"a device's kind tested outside {DEVICE_SEAM} (module: lines): "
                        f"{others}; ask it (is_cpu, is_gpu, kind_of(device).<what you need>)")


def test_the_kind_check_sees_tests_not_messages():
    assert _tests_a_kind('"""d.type == "cuda" """\n# d.type == "cuda"\n'
                         'raise E(f"use \'cuda:N\'")\nx = d.type == "meta"\n') == []
    assert _tests_a_kind('a = d.type == "cuda"\nb = "cuda" in str(d)\nc = t.is_cuda\n'
                         'e = d.type != "cpu"\nf = torch.device("cuda", 1)\n'
                         'g = "cuda:0" == name\n') == [1, 2, 3, 4, 5, 6]


# The Pipeline is a façade (issue 52): it holds the plan, the runtime and the model watch and
# forwards each way of running to its driver in runtime/, so its module stays short.
FACADE_LINES = 300


def test_the_pipeline_facade_is_at_most_300_lines():
    defining = [path for path in _modules().values()
                if "\nclass Pipeline(" in "\n" + path.read_text()]
    assert len(defining) == 1, f"one module defines class Pipeline, found {defining}"
    lines = len(defining[0].read_text().splitlines())
    assert lines <= FACADE_LINES, (
        f"{defining[0].relative_to(ROOT)} has {lines} lines, over the façade's {FACADE_LINES}; "
        f"move what a way of running does into its driver in fxpipe/runtime/ (calls, training, "
        f"streaming), leaving Pipeline the forward")
