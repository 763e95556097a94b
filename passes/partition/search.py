"""Methods 3-5: the exact search on a family of ideals, settled as one typed `Outcome`.

3. **Branch and bound on exact transfers** (`_search`), when the DP's partition costs more under
   the exact model than the DP's value (a value received by several stages, or unequal links):
   chains are built from the last stage back, so each stage's sends are priced exactly, and what
   precedes it is bounded by the DP's values. Finishing proves the optimum.
4. **Band probes** (`_probe`) when the full DP is over its work limit: a DP limited to stages of
   at most L needs only the ideals in narrow bands and either finds the relaxed optimum or proves
   every partition slower than L; L rises from the compute bound until the work limit, raising
   the certified bound.
5. **Exact slicing**: `orders.py` runs `_exact` (methods 2-3) on the n + 1 prefixes of each order
   (`_Lattice.prefixes`) for graphs of up to `Limits.prefix_nodes` nodes when nothing proved
   optimality: the best contiguous split of that order, so never worse than a split of it by
   node counts, parameters or time.

Each step gets half of the `_Budget` left; the DP stops at `Limits.work` (about 1 s), after
which the slicing and a weaker bound stand.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..cost_model import Pricing
from .lattice import _chain, _dp, _Lattice, _StageCost
from .limits import _Budget, _OverBudget
from .result import _TOL, Certified, Infeasible, Outcome, OverBudget, Proved, Route


def _exact(model: Pricing, lattice: _Lattice, incumbent: Sequence[int] | None,
           incumbent_s: float, floor: float, budget: _Budget) -> Outcome:
    """What the DP over `lattice`, then branch and bound, establish within `budget`.

    `incumbent` is the best partition known (bottleneck `incumbent_s`, inf if none): stages
    that alone take longer cannot improve on it and are skipped, and it is the answer when
    nothing better exists. When that DP is too big, `_probe` raises the lower bound `floor`
    instead. Each step gets half the budget left.
    """
    costs = [_StageCost(model, s) for s in range(model.k)]
    try:
        with budget.share(0.5):
            best = _dp(model, lattice, costs, incumbent_s, budget)
    except _OverBudget:
        with budget.share(0.5):
            return _probe(model, lattice, costs, floor, incumbent, incumbent_s, budget)
    k, full = model.k, len(lattice.masks) - 1
    value = best[k - 1][full][0]
    bound = min(value, incumbent_s)
    if value == math.inf:     # nothing beats the incumbent, or nothing fits at all
        return Infeasible() if incumbent is None else Proved(tuple(incumbent), bound, Route.DP)
    stage_of = _chain(lattice, best, k)
    exact = model.bottleneck_s(stage_of)
    if exact <= bound * (1 + _TOL):
        return Proved(tuple(stage_of), bound, Route.DP)
    if exact > incumbent_s:
        stage_of, exact = incumbent, incumbent_s
    try:
        with budget.share(0.5):
            found, found_s = _search(model, lattice, costs, best, stage_of, exact, budget)
    except _OverBudget:
        if exact == math.inf:     # the DP's chain does not fit by the exact memory rule
            return OverBudget()
        return Certified(tuple(stage_of), bound, Route.BRANCH_AND_BOUND)
    if found_s == math.inf:       # no chain fits by the exact memory rule
        return Infeasible()
    return Proved(tuple(found), bound, Route.BRANCH_AND_BOUND)


def _probe(model: Pricing, lattice: _Lattice, costs: list[_StageCost], floor: float,
           incumbent: Sequence[int] | None, incumbent_s: float, budget: _Budget) -> Outcome:
    """A lower bound from DPs limited to stages of at most L, for L rising from `floor`.

    A DP limited to L finds the least relaxed bottleneck when it is at most L, and otherwise
    proves every partition slower than L; a small L keeps only the ideals in narrow bands of
    compute around the stage boundaries, so such DPs stay cheap where the full one is not. L
    gallops up (floor * (1 + 2^j / 512)) until a DP succeeds or the budget is spent. Over
    budget when no bound above `floor` was proven or there is no partition to certify.
    """
    if floor <= 0:
        return OverBudget()
    k = model.k
    proven = floor
    step = 1 / 512
    while proven * (1 + step) < incumbent_s:
        limit = proven * (1 + step)
        try:
            best = _dp(model, lattice, costs, limit, budget)
        except _OverBudget:
            break
        value = best[k - 1][-1][0]
        if value < math.inf:
            stage_of = _chain(lattice, best, k)
            exact = model.bottleneck_s(stage_of)
            if exact > incumbent_s:
                stage_of, exact = incumbent, incumbent_s
            if exact == math.inf:    # fits only by the relaxed memory rule, and nothing else
                return OverBudget()
            settled = Proved if exact <= value * (1 + _TOL) else Certified
            return settled(tuple(stage_of), value, Route.PROBES)
        proven = limit
        step *= 2
    if proven <= floor or incumbent is None:
        return OverBudget()
    return Certified(tuple(incumbent), proven, Route.PROBES)


def _search(model: Pricing, lattice: _Lattice, costs: list[_StageCost],
            best: list[list[tuple[float, int]]], incumbent: Sequence[int], incumbent_s: float,
            budget: _Budget) -> tuple[Sequence[int], float]:
    """Branch and bound over chains of ideals, from the last stage back; the optimal assignment
    and its exact bottleneck (inf: no chain fits by the exact memory rule).

    A stage chosen after the later ones knows where its values go, so its sends are priced
    exactly (one per receiving stage, over the real link); what precedes it is bounded by the
    DP's value. A branch is cut when either reaches the best exact bottleneck found so far.
    Raises _OverBudget when `budget` runs out, choosing what a complete chain's stages
    recompute included.
    """
    graph = model.graph
    stage_of = [-1] * len(graph)
    state = {"best": incumbent, "best_s": incumbent_s}

    def sends(s: int, sending: tuple[int, ...]) -> float:
        total = 0.0
        for p in sending:
            for t in dict.fromkeys(stage_of[r] for r in graph.succs[p] if stage_of[r] > s):
                total += model.transfer(s, t)[p]
        return total

    def visit(s: int, i: int, suffix: float) -> None:
        cut = state["best_s"] * (1 - _TOL)
        sources = [0] if s == 0 else lattice.subsets(i, model.column_of[s], cut, budget)
        options = []
        for j in sources:
            before = best[s - 1][j][0] if s else 0.0
            if before >= cut:
                continue
            pair = lattice.pair(j, i)
            relaxed = costs[s](pair)
            if max(suffix, relaxed, before) < cut:
                options.append((max(suffix, relaxed, before), j, relaxed, pair))
        options.sort(key=lambda o: o[:2])
        for _, j, relaxed, pair in options:
            cut = state["best_s"] * (1 - _TOL)
            if max(suffix, relaxed) >= cut:
                continue
            budget.spend(8 + len(pair.sending))
            members = lattice.members(lattice.masks[i] & ~lattice.masks[j])
            for node in members:
                stage_of[node] = s
            cost = relaxed - costs[s].relaxed_send(pair) + sends(s, pair.sending)
            if max(suffix, cost, best[s - 1][j][0] if s else 0.0) < cut:
                if s > 0:
                    visit(s - 1, j, max(suffix, cost))
                else:    # choosing what its stages recompute counts as the search's work
                    exact = model.bottleneck_s(stage_of, budget.spend)
                    if exact < state["best_s"]:
                        state["best"], state["best_s"] = list(stage_of), exact
            for node in members:
                stage_of[node] = -1

    visit(model.k - 1, len(lattice.masks) - 1, 0.0)
    return state["best"], state["best_s"]
