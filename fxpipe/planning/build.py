"""Planning conducted: a recipe's model prepared once per mode, then weighed, realized and, where
it is asked, raced, all from that one `Prepared` (the build half of `fxpipe.plan` and
`fxpipe.compile`, which `fxpipe.api` offers).

`plan` captures the model in its current mode and prepares it (`prepare.prepare`: functionalized,
seeded, its costs measured as configurations ask), weighs the configurations the options leave
open (`weigh`, `search`), and realizes the one chosen (`realize`: split, placed, checked against
the model, `checks`): a complete `Plan`, before any Pipeline exists. With `num_stages="auto"`,
the plans raced against the model as is (`_raced`) are realized from the same prepared graph.
`Planner` is the recipe a pipeline keeps to plan the model again in the other mode.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.errors import BatchError

from ..plans.plan_data import Plan, Runs, peak_rss_bytes
from ..runtime.devices import DeviceLike
from . import search
from .measure import race
from .options import Options
from .prepare import Prepared, prepare, realize, weigh, weighed_as_is
from .recipe import Recipe


def plan_of(recipe: Recipe) -> Plan:
    """The plan of the recipe's model in its current mode (see `fxpipe.plan`), with the planning
    process's peak resident memory."""
    model = recipe.model
    try:
        plan = plan_mode(recipe, model, recipe.trace(model))
    finally:
        recipe.progress.finish()
    return plan.with_record(planning_peak_rss_bytes=peak_rss_bytes())


def plan_mode(recipe: Recipe, model: nn.Module, gm: fx.GraphModule,
              held: nn.Module | None = None) -> Plan:
    """The plan of `gm`, captured from `model` in its current mode: prepared once, then
    weighed, realized and, where it is asked, raced, all from that one `Prepared`. With `held`
    (the other mode's pipeline's tensors), the stages compute with its values (`prepare`)."""
    prepared = prepare(recipe, model, gm, held)
    try:
        try:
            return _weighed(prepared, recipe)
        except BatchError:
            if recipe.options.chunks not in ("auto", None):
                raise
            # The model mixes or reduces the batch: micro-batches cannot compute what it
            # computes, and neither "auto" nor the default changes the result, so the plan
            # keeps the batch whole (and says its stages then run one at a time).
            return _weighed(prepared, recipe, whole_batch=True)
    finally:
        prepared.kept.drop()     # the model's outputs (and copies) the plans were checked on


def _weighed(prepared: Prepared, recipe: Recipe, whole_batch: bool = False) -> Plan:
    """The plan of the configuration `weigh` chooses, raced against the model as is where that
    was weighed too (`_raced`)."""
    chosen, reason, considered = weigh(prepared, recipe, whole_batch=whole_batch)
    as_is_weighed = weighed_as_is(recipe, considered)
    runs = Runs.AS_IS_PREDICTED if as_is_weighed and chosen is considered[-1] else Runs.PIPELINE
    plan = realize(prepared, recipe, chosen, considered=considered, reason=reason, runs=runs)
    # Raced in this process: not a plan priced for another runtime (gloo ranks, your links).
    in_process = recipe.options.link_name in ("default", "measure")
    if as_is_weighed and in_process and not plan.runs_as_is:
        return _raced(plan, prepared, recipe)
    return plan


class Planner(Recipe):
    """A `Recipe` with the way back to planning: what `fxpipe.compile` gives its pipeline, which
    plans the model again in the other mode (`build_for_mode`) and plans generation's steps
    (`plan_other`) without importing planning itself."""

    @staticmethod
    def plan_other(model: nn.Module, devices: Sequence[DeviceLike], example_kwargs: dict[str, Any],
                   **options: Any) -> Plan:
        """`fxpipe.plan(...)`, for the pipeline's own plans of another module
        (`fxpipe.generate`'s steps), which reaches planning through its planner, as the mode
        switch does."""
        return plan_of(Planner.of(model, (), example_kwargs, Options(devices, **options)))

    def build_for_mode(self, mode: bool, held: nn.Module) -> Plan | None:
        """The plan of the model in `mode` (`model.train(mode)`), or None when the graph
        captured in that mode is the one already built (a graph that does not read the mode).

        `held`: the tensors the other mode's pipeline holds, by the model's names, which
        training may have changed since compile: the new stages share its copies, or are given
        their values, and are checked against the model computing with those values."""
        model = self.model
        flags = {m: m.training for m in model.modules()}
        try:
            model.train(mode)
            gm = self.trace(model)
            if self.traced_code.get(not mode) == gm.code:
                return None
            return plan_mode(self, model, gm, held)
        finally:
            for m, flag in flags.items():
                m.training = flag


# Below this share of its threads' time, the model's run says other processes hold the cores.
BUSY_SHARE = 0.85


# The pipelines raced at most: the one predicted fastest, and the next ones predicted within
# `SHORTLIST_SLACK` of it (a prediction off by more is off by more than the race can mend).
SHORTLIST = 3

SHORTLIST_SLACK = 1.25


def _raced(plan: Plan, prepared: Prepared, recipe: Recipe) -> Plan:
    """A pipeline chosen over the model as is on its prediction is kept only where it is
    measured faster. The shortlist (the chosen pipeline and the next best predicted, realized
    from the same prepared graph and costs: `_runners_up`) and the model run on the example in
    interleaved rounds (`measure.race`: calls in inference, train steps in training), and each
    one's least time counts, the least disturbed by other work on the machine (the model's
    all-core run is the first a busy core slows). The pipeline measured fastest is kept where
    it beats the model by over `search.TIE`; otherwise the model as is is realized, weighed
    alone on the costs measured; so it is where the model's run on CPUs got under
    `BUSY_SHARE` of its threads' time: the machine is too busy to tell, and the model as is is
    the choice that cannot lose much. The plan records each one's predicted and measured time
    (`PlanRecord.raced`)."""
    shortlist = [plan, *_runners_up(plan, prepared, recipe)]
    raced = race(shortlist, prepared.checked, recipe)
    rows = tuple((p.record.chosen.config, p.record.predicted_step_s, t)
                 for p, t in zip(shortlist, raced.pipelines_s)) + (
        (plan.record.considered[-1].config, plan.record.unpipelined_s, raced.model_s),)
    fastest = min(range(len(shortlist)), key=lambda i: raced.pipelines_s[i])
    best = shortlist[fastest]
    also = f", fastest of {len(shortlist)} pipelines raced" if len(shortlist) > 1 else ""
    measured = (f"{best.record.chosen} measured {raced.pipelines_s[fastest] * 1e3:.3f} ms, the "
                f"model {raced.model_s * 1e3:.3f} ms (the least of {raced.rounds} interleaved runs "
                f"each{also}; predicted {best.record.predicted_step_s * 1e3:.3f} ms)")
    if raced.cpu_share is not None and raced.cpu_share < BUSY_SHARE:
        runs = Runs.AS_IS_BUSY
        reason = (f"no pipeline is weighed on a busy machine: the model's fastest run had "
                  f"{raced.cpu_share:.0%} of the time of its {torch.get_num_threads()} "
                  f"thread(s), other processes holding cores, so neither time would hold on a "
                  f"quiet machine; compile where the cores are free to weigh pipelines "
                  f"({measured})")
    elif raced.pipelines_s[fastest] < raced.model_s * (1 - search.TIE):
        why = plan.record.reason if best is plan else (
            f"measured fastest, though {plan.record.chosen} was predicted fastest")
        return best.with_record(raced=rows, reason=f"{why}; {measured}")
    else:
        runs = Runs.AS_IS_MEASURED
        reason = f"no pipeline is measured faster than the model run whole: {measured}"
    considered = plan.record.considered
    return realize(prepared, recipe, considered[-1], considered=considered, reason=reason,
                   runs=runs)


def _runners_up(plan: Plan, prepared: Prepared, recipe: Recipe) -> list[Plan]:
    """The plans of the configurations predicted next best after the chosen one (at most
    `SHORTLIST - 1`, within `SHORTLIST_SLACK` of it and faster than the model), each realized
    from the prepared graph as the chosen one was. Only configurations whose costs were
    measured: one weighed on costs fitted between measured sizes (`Costs.fitted`) is not worth
    measuring for a race it would enter as a runner-up."""
    weighed, costs = plan.record, prepared.costs
    best = weighed.chosen.predicted_s
    others = sorted((c for c in weighed.considered[:-1] if c.predicted_s is not None and
                     c.config != weighed.chosen.config and c.predicted_s <= best * SHORTLIST_SLACK
                     and c.predicted_s < (weighed.unpipelined_s or math.inf)
                     and costs.is_measured(c.config, c.partition.devices)),
                    key=lambda c: c.predicted_s)
    return [realize(prepared, recipe, c, considered=weighed.considered, reason=weighed.reason,
                    runs=Runs.PIPELINE) for c in others[:SHORTLIST - 1]]
