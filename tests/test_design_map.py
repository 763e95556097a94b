"""DESIGN.md stays a map, and the docstrings it points at stay runnable.

The map is at most `MAX_LINES` lines and its Layout block names every module and package under
`fxpipe/` and `passes/` (and nothing that is not there). `fxpipe.compile`'s `Args:` list names
every option it takes. Each pass's docstring example runs (doctest), and so does compile's.
"""

import doctest
import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DESIGN = ROOT / "DESIGN.md"
MAX_LINES = 250
# Where a Layout entry's description starts: a line indented less than this names a module.
DESCRIPTION_COLUMN = 24
ENTRY = re.compile(r"^(?P<indent> *)(?P<names>[\w.]+/?(?:, [\w.]+/?)*)(?:  +|$)")
FILE_NAME = re.compile(r"\b[\w]+\.py\b")

# The passes whose docstrings carry a runnable example (`>>>`), run below.
PASSES = ["fxpipe.passes.capture", "fxpipe.passes.functionalize", "fxpipe.passes.randomness",
          "fxpipe.passes.annotate_costs", "fxpipe.passes.partition", "fxpipe.passes.codegen",
          "fxpipe.passes.split_wide", "fxpipe.passes.recompute", "fxpipe.passes.materialize",
          "fxpipe.passes.state", "fxpipe.passes.blocks", "fxpipe.passes.signature",
          "fxpipe.passes.compare", "fxpipe.passes.user_code", "fxpipe.passes.graph_values",
          "fxpipe.passes.errors", "fxpipe.passes.device", "fxpipe.passes.stage",
          "fxpipe.passes.trace"]


def layout_block(text: str) -> list[str]:
    """The lines of the fenced block under DESIGN.md's `## Layout` heading."""
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1].splitlines()[1:]


def named(lines: list[str]) -> tuple[set[str], dict[str, str]]:
    """What a Layout block names: the paths of its entries (`fxpipe/runtime/`,
    `fxpipe/api.py`), and for each package the text that speaks for it (its own entry's lines
    and those of the modules listed directly under it, not its sub-packages')."""
    entries: set[str] = set()
    text: dict[str, str] = {}
    stack: list[tuple[int, str]] = []        # (depth, package path) of the open packages
    owner = ""                               # the package the current lines speak for
    for line in lines:
        match = ENTRY.match(line)
        if match and len(match.group("indent")) < DESCRIPTION_COLUMN:
            depth = len(match.group("indent")) // 2
            while stack and stack[-1][0] >= depth:
                stack.pop()
            parent = stack[-1][1] if stack else ""
            names = match.group("names").split(", ")
            entries.update(parent + name for name in names)
            packages = [parent + name for name in names if name.endswith("/")]
            if packages:
                stack.append((depth, packages[0]))
                owner = packages[0]
            else:
                owner = parent
        text[owner] = text.get(owner, "") + line + "\n"
    return entries, text


def unnamed(root: pathlib.Path, lines: list[str]) -> list[str]:
    """The modules and packages under `root`'s fxpipe/ and passes/ the Layout block leaves
    out: a package must be an entry, a module an entry or a file name in its package's text
    (its `__init__.py` is the package's own entry)."""
    entries, text = named(lines)
    missing = []
    for folder in ("fxpipe", "passes"):
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            package = relative.rpartition("/")[0] + "/"
            if package not in entries:
                missing.append(package)
            if path.name == "__init__.py":
                continue
            if relative not in entries and path.name not in FILE_NAME.findall(
                    text.get(package, "")):
                missing.append(relative)
    return sorted(set(missing))


def not_there(root: pathlib.Path, lines: list[str]) -> list[str]:
    """The Layout block's entries that name no file or folder under `root`."""
    entries, text = named(lines)
    gone = [entry for entry in entries if not (root / entry).exists()]
    for package, words in text.items():
        gone += [package + name for name in FILE_NAME.findall(words)
                 if package and not any((root / package).rglob(name))]
    return sorted(set(gone))


def test_the_map_is_at_most_250_lines():
    lines = len(DESIGN.read_text().splitlines())
    assert lines <= MAX_LINES, (f"DESIGN.md has {lines} lines, over {MAX_LINES}: move the why "
                                f"into the docstring of the module it explains")


def test_the_map_names_every_module_and_package():
    missing = unnamed(ROOT, layout_block(DESIGN.read_text()))
    assert not missing, (f"DESIGN.md's Layout leaves out {missing}: add a line saying what "
                         f"each is for (a package's parts may be listed on its own line)")


def test_the_map_names_nothing_that_is_not_there():
    gone = not_there(ROOT, layout_block(DESIGN.read_text()))
    assert not gone, f"DESIGN.md's Layout names {gone}, which do not exist: update its lines"


def test_the_map_check_finds_a_module_left_out(tmp_path):
    for path in ["fxpipe/__init__.py", "fxpipe/api.py", "fxpipe/runtime/__init__.py",
                 "fxpipe/runtime/step.py", "fxpipe/runtime/as_is.py", "fxpipe/cli/__init__.py",
                 "fxpipe/cli/commands.py", "passes/__init__.py", "passes/state.py"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    lines = ["fxpipe/                 the product",
             "  api.py                compile; step.py named here speaks for fxpipe/ only",
             "  cli/                  the command line: commands.py",
             "  runtime/              executes a timetable",
             "    step.py             the train-step contract",
             "passes/                 the passes",
             "  state.py              buffers written in forward",
             "  gone.py               a module since removed"]
    assert unnamed(tmp_path, lines) == ["fxpipe/runtime/as_is.py"]
    assert not_there(tmp_path, lines) == ["passes/gone.py"]
    assert unnamed(tmp_path, lines[:2] + lines[3:]) == ["fxpipe/cli/",
                                                         "fxpipe/cli/commands.py",
                                                         "fxpipe/runtime/as_is.py"]


def test_compile_documents_every_option_in_its_args_list():
    import fxpipe
    doc = inspect.getdoc(fxpipe.compile)
    args = doc.split("\nArgs:\n", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"^    (\w+):", args, flags=re.M)
    assert documented == list(inspect.signature(fxpipe.compile).parameters)


@pytest.mark.parametrize("name", PASSES)
def test_the_pass_docstring_example_runs(name):
    module = importlib.import_module(name)
    assert ">>>" in (module.__doc__ or ""), f"{name}'s docstring has no runnable example"
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted and not result.failed, f"{name}'s example failed (see above)"


def test_the_compile_docstring_example_runs():
    import fxpipe
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner()
    for test in finder.find(fxpipe.compile, "fxpipe.compile", globs={}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted and not result.failed, "fxpipe.compile's example failed (see above)"
