"""Errors read in one line: the first line of every message fxpipe raises names the problem in
at most about 80 characters, and the fix, where there is one, follows on its own line(s).

The static test walks, with `ast`, every construction of an FxpipeError subclass in fxpipe/
and passes/ (each `raise E(...)`, and the errors helpers build for a caller to raise) and reads
its message: a str literal, an f-string (each `{...}` counted as PLACEHOLDER_CHARS characters,
its value varies, unless it is a choice between literals), an implicit or `+` concatenation (a
part that is not text counts as a placeholder), a name bound to one of those in the same
function or at the top of its module, a conditional expression of them, a `.format(...)` of
one, or the call of a function of the same module that returns one. A raise whose message
cannot be read so is listed in UNREAD with the reason, so a new one cannot slip by.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import fxpipe

ROOT = Path(__file__).resolve().parents[1]
FIRST_LINE_CHARS = 80
PLACEHOLDER_CHARS = 12
_HOLE = "\x00" * PLACEHOLDER_CHARS         # stands for one `{...}`; never a newline

# A fix told in the first line: a verb of doing after the problem's punctuation
# ("...: pass ...", "...; use ..."). It belongs on the next line.
_FIX_IN_FIRST_LINE = re.compile(
    r"[:;]\s+(?:pass|use|give|set|call|install|compile|save|load|move|make|remove|drop|"
    r"lower|raise|add|check|try|run|start|build|wrap|name|reduce|increase|split|put|return|"
    r"write|read|register|close|choose|ask|plan|fix|upgrade|rename|replace)\b"
)

# Raises whose message is not readable statically: (file, function) -> why. A new raise whose
# message cannot be read must be added here, with the reason, or rewritten so it can be read.
UNREAD: dict[tuple[str, str], str] = {
    ("fxpipe/runtime/driver.py", "item_error"):
        "re-raises a stage's StageError (stage_error's message, read here) with its micro-batch "
        "renamed to the stream's item",
}


@dataclass(frozen=True)
class Site:
    path: str           # relative to the repository root
    line: int
    function: str       # the enclosing function's name ("<module>" at the top)
    error: str          # the class raised
    messages: tuple[str, ...] | None    # each static message it may raise; None: unread

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line} ({self.function})"


def _sources() -> list[Path]:
    return sorted(p for d in ("fxpipe", "passes") for p in (ROOT / d).rglob("*.py"))


def _error_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """Names of FxpipeError and every class that derives from it, by the classes' AST bases."""
    bases: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(_name(b) for b in node.bases)
    found = {"FxpipeError"}
    while True:
        more = {c for c, bs in bases.items() if c not in found and bs & found}
        if not more:
            return found
        found |= more


def _name(expr: ast.expr) -> str:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return ""


def _messages(expr: ast.expr, bound: dict[str, list[ast.expr]], depth: int = 0
              ) -> tuple[str, ...] | None:
    """Every static text `expr` may evaluate to (holes for placeholders), or None."""
    if depth > 8:
        return None
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return (expr.value,)
    if isinstance(expr, ast.JoinedStr):
        texts = ("",)
        for value in expr.values:
            if isinstance(value, ast.Constant):
                choices: tuple[str, ...] = (value.value,)
            else:
                choices = _placeholder(value, bound, depth)
            texts = tuple(t + c for t in texts for c in choices)[:64]
        return texts
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        left = _messages(expr.left, bound, depth + 1)
        right = _messages(expr.right, bound, depth + 1)
        if left is None and right is None:
            return None
        # A part that is not text (`"; ".join(...)`) counts as a placeholder, as in an f-string.
        return tuple(a + b for a in left or (_HOLE,) for b in right or (_HOLE,))
    if isinstance(expr, ast.IfExp):
        body = _messages(expr.body, bound, depth + 1)
        orelse = _messages(expr.orelse, bound, depth + 1)
        if body is None or orelse is None:
            return None
        return body + orelse
    if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute)
            and expr.func.attr == "format"):          # a template's fields are placeholders
        template = _messages(expr.func.value, bound, depth + 1)
        if template is None:
            return None
        return tuple(re.sub(r"\{[^{}]*\}", _HOLE, t) for t in template)
    if isinstance(expr, ast.Call) and f"{_name(expr.func)}()" in bound:   # a helper's returns
        return _messages(ast.Name(id=f"{_name(expr.func)}()"), bound, depth + 1)
    if isinstance(expr, ast.Name) and expr.id in bound:
        found: list[str] = []
        for value in bound[expr.id]:
            texts = _messages(value, bound, depth + 1)
            if texts is None:
                return None
            found.extend(texts)
        return tuple(found)
    return None


def _placeholder(value: ast.FormattedValue, bound: dict[str, list[ast.expr]], depth: int
                 ) -> tuple[str, ...]:
    """What a `{...}` may stand for: each text of a str literal, a choice between them
    (`{'s' if n == 1 else ''}`) or a name bound to them; anything else PLACEHOLDER_CHARS
    characters."""
    if value.conversion == -1 and not value.format_spec and not isinstance(
            value.value, ast.JoinedStr):
        texts = _messages(value.value, bound, depth + 1)
        if texts is not None and _HOLE not in "".join(texts):
            return texts
    return (_HOLE,)


def _bindings(function: ast.AST) -> dict[str, list[ast.expr]]:
    """Each local name's assigned values (`x = ...`, `x += ...` as x + value) in a function."""
    bound: dict[str, list[ast.expr]] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            bound.setdefault(node.target.id, []).append(node.value)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            bound.setdefault(node.target.id, []).append(ast.BinOp(
                left=ast.Name(id=node.target.id), op=node.op, right=node.value))
    return bound


def _returned(function: ast.AST, module_names: dict[str, list[ast.expr]]
              ) -> tuple[str, ...] | None:
    """Every text a function returns (returns of None left out), or None where one cannot be
    read, or it returns none."""
    returns = [n.value for n in ast.walk(function) if isinstance(n, ast.Return)
               and n.value is not None and not (isinstance(n.value, ast.Constant)
                                                and n.value.value is None)]
    bound = {**module_names, **_bindings(function)}
    found: list[str] = []
    for value in returns:
        texts = _messages(value, bound)
        if texts is None:
            return None
        found.extend(texts)
    return tuple(found) or None


def raise_sites() -> list[Site]:
    """Every `E(message, ...)` of an FxpipeError subclass E in fxpipe/ and passes/: the raises,
    and the errors that helper functions build for a caller to raise."""
    trees = {p: ast.parse(p.read_text(), str(p)) for p in _sources()}
    classes = _error_classes(trees)
    sites = []
    for path, tree in trees.items():
        functions: list[tuple[str, ast.AST]] = [("<module>", tree)]
        functions += [(n.name, n) for n in ast.walk(tree)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        module_names = _bindings(ast.Module(body=[n for n in tree.body if isinstance(
            n, (ast.Assign, ast.AnnAssign))], type_ignores=[]))     # the module's constants
        for name, function in functions[1:]:     # helpers returning a message they build
            texts = _returned(function, module_names)
            if texts is not None:
                module_names[f"{name}()"] = [ast.Constant(value=t) for t in texts]
        owner: dict[int, tuple[str, ast.AST]] = {}
        for name, function in functions:         # innermost function last, so it wins
            for node in ast.walk(function):
                if isinstance(node, ast.Call):
                    owner[id(node)] = (name, function)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and _name(node.func) in classes):
                continue
            error = _name(node.func)
            name, function = owner[id(node)]
            if node.args:
                texts = _messages(node.args[0], {**module_names, **_bindings(function)})
            else:
                texts = None
            sites.append(Site(str(path.relative_to(ROOT)), node.lineno, name, error, texts))
    return sites


def first_line_chars(message: str) -> int:
    return len(message.split("\n", 1)[0].strip())


SITES = raise_sites()


def test_the_walk_finds_the_raises():
    assert len(SITES) > 150, "the AST walk lost the raise sites"


@pytest.mark.parametrize("site", [s for s in SITES if s.messages is not None],
                         ids=lambda s: f"{s.path}:{s.line}")
def test_first_line_names_the_problem_in_80_characters(site):
    for message in site.messages:
        first = message.split("\n", 1)[0]
        shown = first.replace(_HOLE, "{...}")
        assert first_line_chars(message) <= FIRST_LINE_CHARS, (
            f"{site.where}: first line {first_line_chars(message)} characters: {shown!r}")
        assert not _FIX_IN_FIRST_LINE.search(first), (
            f"{site.where}: the fix belongs on its own line: {shown!r}")


def test_every_unread_message_is_listed_with_its_reason():
    unread = {(s.path, s.function) for s in SITES if s.messages is None}
    assert unread <= set(UNREAD), f"messages the test cannot read: {sorted(unread - set(UNREAD))}"
    assert set(UNREAD) <= unread, f"listed but read now: {sorted(set(UNREAD) - unread)}"


def _tiny():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()


@pytest.mark.parametrize("call", [
    lambda: fxpipe.compile(_tiny(), ["gpu7", "cpu"], (torch.randn(4, 8),)),
    lambda: fxpipe.compile(_tiny(), [], (torch.randn(4, 8),)),
    lambda: fxpipe.compile(_tiny(), ["cpu", "cpu"], (torch.randn(4, 8),), chunks=0),
    lambda: fxpipe.compile(_tiny(), ["cpu", "cpu"], (torch.randn(4, 8),), schedule="zigzag"),
    lambda: fxpipe.compile(_tiny(), ["cpu", "cpu"], (torch.randn(2, 8),), chunks=4),
    lambda: fxpipe.compile(_tiny(), ["cpu", "cpu"], [torch.randn(4, 8)]),
    lambda: fxpipe.load_plan("/nonexistent/plan"),
], ids=["device", "no devices", "chunks", "schedule", "rows", "list inputs", "no plan"])
def test_real_errors_name_the_problem_in_one_line_and_the_fix_below(call):
    with pytest.raises(fxpipe.FxpipeError) as raised:
        call()
    first, *fix = str(raised.value).splitlines()
    assert len(first) <= FIRST_LINE_CHARS, first
    assert fix and fix[0].strip(), f"no fix below {first!r}"
