"""docs/reading-the-plan.md explains every kind of line `print(plan)` prints (issue 51, item 7):
real plans are printed (inference after calls, with memory measured; training with the plan
choosing; unsteady; stages sharing cores) and each line's kind must start as one of the page's
bold phrases, each table's columns must be named on the page. Node costs are scripted, so the
plans are quick and alike everywhere."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.passes.cost_model import HostCosts
import fxpipe.plans.plan_data
import fxpipe.plans.report

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reading-the-plan.md"


def explained(page: str) -> list[re.Pattern]:
    """The page's bold phrases as patterns a line starts with: a placeholder (N, M, s, X)
    stands for any word."""
    phrases = [" ".join(p.split()) for p in re.findall(r"\*\*([^*]+)\*\*", page)]
    return [re.compile(r"\S+".join(re.escape(part) for part in
                                   re.split(r"(?<!\w)(?:N|M|s|X)(?!\w)", phrase)))
            for phrase in phrases]


def kinds_and_columns(text: str) -> tuple[list[str], list[str]]:
    """The plan's lines that are not inside a table, and every table's column names."""
    lines, kinds, columns = text.splitlines(), [], []
    for i, line in enumerate(lines):
        if not line.strip() or set(line.strip()) <= set("- "):
            continue       # a table's rule
        if i + 1 < len(lines) and lines[i + 1].strip() and set(lines[i + 1].strip()) <= set("- "):
            columns += [c for c in re.split(r"\s{2,}", line.strip()) if c]   # a table's header
        elif not (line[0].isspace() or line[0] == "*"):     # else a table's row
            kinds.append(line)
    return kinds, columns


def unexplained(text: str, page: str) -> list[str]:
    patterns = explained(page)
    kinds, columns = kinds_and_columns(text)
    return ([line for line in kinds if not any(p.match(line) for p in patterns)] +
            [f"column {c!r}" for c in columns if c.lower() not in page.lower()])


def chain():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]), torch.randn(8, 16)


@pytest.fixture
def plans(scripted_costs, monkeypatch):
    """Printed plans covering the kinds of line a CPU plan has."""
    model, x = chain()
    printed = []
    with fxpipe.compile(model.eval(), ["cpu", "cpu"], (x,), chunks=1) as pipe:
        pipe.measure_memory = True
        for _ in range(3):
            pipe(x)
        plan = pipe.plan
        printed.append(str(plan))
        printed.append(str(plan.with_record(spread=0.5)))       # unsteady
        monkeypatch.setattr(fxpipe.plans.report.os, "cpu_count", lambda: 1)
        printed.append(str(plan))                                        # stages share a core
        monkeypatch.undo()
    trained = fxpipe.plan(model.train(), ["cpu", "cpu"], (x,), num_stages="auto",
                          chunks="auto", training=True)
    printed.append(str(trained))
    slower = dataclasses.replace(trained, runs=fxpipe.plans.plan_data.Runs.PIPELINE)
    work_s = sum(s.compute_s for s in slower.partition.stages) * slower.chunks  # agreeing figures
    printed.append(str(slower.with_record(predicted_step_s=2 * work_s, unpipelined_s=work_s,
                                          spread=0.0, unpipelined_spread=0.0,
                                          host=HostCosts())))  # predicted slower (no Python
    # bound: its lock share is measured, and would decide whether the plan claims)
    return printed


def test_every_kind_of_line_a_plan_prints_is_explained_on_the_page(plans):
    page = PAGE.read_text()
    for text in plans:
        assert unexplained(text, page) == [], text
    # The plans printed cover the kinds asked for.
    every = "\n".join(plans)
    for kind in ("measured in use", "memory measured in the latest run", "memory in training",
                 "configurations considered", "no speed-up claimed", "warning: one micro-batch",
                 "CPU stages on 1 core", "costs were unsteady", "predicted slower"):
        assert kind in every, kind


def test_a_line_of_a_kind_the_page_does_not_explain_is_found():
    page = PAGE.read_text()
    plan = ("fxpipe plan: 2 stages, 8 micro-batches, captured by fx\n"
            "warning: the measured speed-up is 2.01x off the predicted one\n"
            "bottleneck 2.000 ms per micro-batch")
    assert unexplained(plan, page) == []
    assert unexplained(plan + "\nsomething new: 3 widgets", page) == ["something new: 3 widgets"]
    table = "  stage  gizmos\n-------  --------\n      0  1"
    assert unexplained(table, page) == ["column 'gizmos'"]
