"""The README's and the docs' examples run as written.

Every ```python block of README.md and docs/*.md runs. A page's blocks run in order, in one
namespace, in a fresh working directory (the examples save plans and checkpoints under relative
paths), so a block may use what an earlier block of its page defined. A block whose first line
says that torchrun starts it (`# run.py, started with: torchrun --nproc-per-node 2 run.py`) is a
script: it is written to that file and launched with torchrun in the page's directory, where the
blocks before it saved what it loads. The block that defines hypothesis tests (docs/testing.md)
has its tests called, under hypothesis' own default settings, on fewer examples.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings

from test_distributed import torchrun

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w+-]*)[ ]*\n(?P<body>.*?)^(?P=indent)```[ ]*$",
                   re.M | re.S)
TORCHRUN = re.compile(r"# (?P<script>[\w-]+\.py), started with: "
                      r"torchrun --nproc-per-node (?P<processes>\d+) (?P=script)\b")
HYPOTHESIS_MARKER = "from fxpipe.testing import"
HYPOTHESIS_EXAMPLES = 10          # of the example's 200: each compiles a pipeline
TORCHRUN_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    line: int                     # where its fence opens, 1-based
    code: str


def python_blocks(page: Path) -> list[Block]:
    """The page's ```python blocks in order, each dedented by its fence's indent (a block may sit
    in a list item)."""
    text = page.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        if match.group("lang") != "python":
            continue
        indent = len(match.group("indent"))
        lines = [line[indent:] for line in match.group("body").splitlines()]
        blocks.append(Block(text.count("\n", 0, match.start()) + 1, "\n".join(lines) + "\n"))
    opened = len(re.findall(r"^[ ]*```python[ ]*$", text, flags=re.M))
    assert len(blocks) == opened, f"{page.name}: a ```python fence this test does not parse"
    return blocks


def _torchrun(script: str, processes: int, cwd: Path) -> tuple[int, str]:
    """`script` under torchrun in `cwd`, with the repository importable (examples, benchmarks)."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return torchrun([script], processes, {"PYTHONPATH": path}, cwd=cwd,
                    timeout_s=TORCHRUN_TIMEOUT_S)


def run_script(block: Block, where: str, cwd: Path) -> None:
    match = TORCHRUN.match(block.code)
    script, processes = match.group("script"), int(match.group("processes"))
    (cwd / script).write_text(block.code)
    code, text = _torchrun(script, processes, cwd)
    assert code == 0, f"{where} ({script} under torchrun):\n{text[-3000:]}"


def run_hypothesis_tests(block: Block, where: str, namespace: dict) -> None:
    """Under hypothesis' own default settings, as a user's test suite would run them, on
    HYPOTHESIS_EXAMPLES of the example's 200 examples."""
    assert "max_examples=200," in block.code
    code = block.code.replace("max_examples=200,", f"max_examples={HYPOTHESIS_EXAMPLES},")
    ours = settings._current_profile
    settings.load_profile("default")
    try:
        exec(compile(code, where, "exec"), namespace)
        tests = [f for name, f in namespace.items() if name.startswith("test_") and callable(f)]
        assert tests, f"{where} defines no test"
        for test in tests:
            test()
    finally:
        settings.load_profile(ours)


WITH_CODE = [page for page in PAGES if python_blocks(page)]


@pytest.mark.parametrize("page", WITH_CODE, ids=[str(p.relative_to(ROOT)) for p in WITH_CODE])
def test_every_python_block_of_the_page_runs(page, tmp_path, monkeypatch):
    blocks = python_blocks(page)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for block in blocks:
        where = f"{page.relative_to(ROOT)}:{block.line}"
        if TORCHRUN.match(block.code):
            run_script(block, where, tmp_path)
        elif HYPOTHESIS_MARKER in block.code:
            run_hypothesis_tests(block, where, namespace)
        else:
            exec(compile(block.code, where, "exec"), namespace)


ILLUSTRATIVE = re.compile(r"<!-- illustrative: (?P<why>[^>]+?) -->\n\Z")


def fxpipe_commands(page: Path) -> list[tuple[int, list[list[str]]]]:
    """The page's ```sh blocks that run `python -m fxpipe`, each as the command lines it runs
    (continuations joined, comments dropped, the arguments after `python -m fxpipe`), with the
    line its fence opens on; a block right after `<!-- illustrative: why -->` is left out."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        body = match.group("body")
        if match.group("lang") not in ("sh", "bash", "shell") or "python -m fxpipe" not in body:
            continue
        if ILLUSTRATIVE.search(text[:match.start()]):
            continue
        joined = re.sub(r"\\\n\s*", " ", body)
        commands = [shlex.split(line, comments=True) for line in joined.splitlines()]
        found.append((text.count("\n", 0, match.start()) + 1,
                      [c[3:] for c in commands if c[:3] == ["python", "-m", "fxpipe"]]))
    return found


WITH_COMMANDS = [page for page in PAGES if fxpipe_commands(page)]


@pytest.mark.parametrize("page", WITH_COMMANDS,
                         ids=[str(p.relative_to(ROOT)) for p in WITH_COMMANDS])
def test_every_fxpipe_command_of_the_page_runs(page, tmp_path, monkeypatch, capsys):
    """Each in order, in one fresh working directory (a command reads what an earlier one
    saved), exiting 0."""
    from fxpipe.__main__ import main
    monkeypatch.chdir(tmp_path)
    for line, commands in fxpipe_commands(page):
        for argv in commands:
            code = main(argv)
            assert code == 0, (f"{page.relative_to(ROOT)}:{line}: fxpipe {' '.join(argv)}\n"
                               f"{capsys.readouterr().err[-2000:]}")


def test_every_illustrative_command_block_says_why():
    """A ```sh block left out names its reason (a GPU, a checkpoint), and every other block
    running fxpipe is run above."""
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if "python -m fxpipe" not in match.group("body"):
                continue
            marked = ILLUSTRATIVE.search(text[:match.start()])
            assert marked is None or len(marked.group("why")) > 10, page.name
    assert any("python -m fxpipe plan" in " ".join(["python -m fxpipe", *c])
               for page in WITH_COMMANDS for _, cs in fxpipe_commands(page) for c in cs)


def test_a_script_started_by_torchrun_says_so_on_its_first_line():
    """A block that mentions torchrun in its first line is launched by it, so that line must
    have the form the runner reads."""
    for page in PAGES:
        for block in python_blocks(page):
            first = block.code.splitlines()[0]
            if "torchrun" in first:
                assert TORCHRUN.match(block.code), f"{page.name}:{block.line}: {first}"


def test_the_readme_fits_a_newcomer_and_names_the_test_command():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert "The test command is `make test`; CI runs it" in text
    assert "make demo" in text


def test_every_docs_page_is_in_the_navigation_and_every_readme_link_resolves():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.glob("*.md"):
        assert f" {page.name}" in nav, f"{page.name} is missing from mkdocs.yml's nav"
    for target in re.findall(r"\]\((docs/[^)#]+)", README.read_text()):
        assert (ROOT / target).is_file(), target
