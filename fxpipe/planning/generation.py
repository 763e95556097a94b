"""Generation's planning: how many lanes a decode step runs, chosen on measured decode costs.

A decode step runs one new token of each of `rows` sequences. Split into L lanes (micro-batches
of rows/L sequences), the lanes follow each other through the stages, so that stage 1 decodes
lane 0 while stage 0 decodes lane 1. Whether that pays depends on T(N)/T(N/L), the time of a
stage's step on N sequences over that on N/L: while a step only reads its weights (small N), a
lane of N/L rows costs nearly what the whole batch costs, the L lanes take L times as long
through the bottleneck stage, and one lane is the fastest. So the lanes are chosen, not assumed:

- The decode plan is made with `chunks="auto"`: planning measures each stage's costs on the
  fewest and the most lanes' rows, fits the sizes between, and partitions every lane count
  (`fxpipe.planning.search`); a lane count whose activations in flight do not fit a stage's
  memory is a candidate that does not fit (the key/value cache is the same for any lane count).
- `decode_step_s` predicts a step of L lanes from the stages' times on one lane's rows and
  the generation loop's own time per token on them (`LaneOption.loop_s`: Hugging Face's Python
  and the choice of the next token, measured with a forward that does nothing), and
  `choose_lanes` takes the lane count of the most tokens per second, the fewest among those
  within `TIE` of it; the decode plan is made again for that count where planning chose another
  (on the costs it measured: `costs=`), so the lanes run are the lanes predicted.
- Where no pipeline is predicted faster than the model run whole (`num_stages="auto"`), the plan
  runs the model as is, and generation is `model.generate` itself (`Generation.as_is` says why):
  the decode plan's own choice, or the lanes' step predicted slower than the model's step and
  its one loop (`slower_than_the_model`).

`decode_step_s` is the one place the runtime's way of stepping lanes enters the prediction:
each lane advances on its own (`fxpipe.runtime.lanes`), one loop per lane.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from fxpipe.passes.errors import FxpipeError

from ..plans.report import per_s
from ..weights import Weights, open_weights
from .search import TIE

if TYPE_CHECKING:
    from ..plans.plan_data import Plan


class GenerationError(FxpipeError):
    """A generation the pipeline cannot run as asked (`fxpipe.generate.GenerationError`)."""


class LanesError(GenerationError):
    """No number of lanes fits the stages' memory."""


@dataclass(frozen=True)
class LaneOption:
    """A lane count weighed: each stage's time on one lane's rows (rows / lanes), measured or
    fitted between measured sizes; `problem` says why it does not fit, when it does not."""

    lanes: int
    stage_s: tuple[float, ...]
    problem: str = ""
    loop_s: float = 0.0         # the loop's own time per token on one lane's rows

    @property
    def fits(self) -> bool:
        return not self.problem


def decode_step_s(stage_s: Sequence[float], lanes: int, loop_s: float = 0.0) -> float:
    """One decode step's predicted time with `lanes` lanes (every sequence one token further),
    from each stage's time on one lane's rows and the lane's loop's own time per token
    (`loop_s`). Lanes advance on their own (`fxpipe.runtime.lanes`): a lane's token crosses
    every stage and then its loop chooses the next, and the next lane's follows it into each
    stage as soon as the stage is free, so a step takes the longest of one lane's round (its
    trip through the stages and its loop), the slowest stage's work on every lane, and every
    lane's loop (Python, one at a time). (Lanes in lockstep, as a streamer or
    `return_dict_in_generate` runs them, take one trip and then the slowest stage once per
    further lane: this is their best case.)"""
    return max(sum(stage_s) + loop_s, lanes * max(max(stage_s, default=0.0), loop_s))


@dataclass(frozen=True)
class LaneChoice:
    """The lanes a generation plan runs, what each lane count weighed was predicted to decode,
    and why this one."""

    rows: int
    lanes: int
    options: tuple[LaneOption, ...]
    reason: str

    def step_s(self, lanes: int) -> float | None:
        option = next((o for o in self.options if o.lanes == lanes and o.fits), None)
        return None if option is None else decode_step_s(option.stage_s, lanes, option.loop_s)

    def tokens_per_s(self, lanes: int | None = None) -> float | None:
        """Decode tokens per second predicted with `lanes` (default: the chosen)."""
        step = self.step_s(self.lanes if lanes is None else lanes)
        return self.rows / step if step else None

    def bound(self, lanes: int) -> float | None:
        """T(N)/T(N/L): a step's time on all rows over that on one lane's rows, summed over the
        stages (what lanes can gain at most)."""
        one = next((o for o in self.options if o.lanes == 1 and o.stage_s), None)
        this = next((o for o in self.options if o.lanes == lanes and o.stage_s), None)
        if one is None or this is None or not sum(this.stage_s):
            return None
        return sum(one.stage_s) / sum(this.stage_s)

    def lines(self) -> list[str]:
        """What `print(generation)` shows of the choice: one line per lane count weighed."""
        out = [f"lanes: {self.lanes} ({self.reason})"]
        for o in sorted(self.options, key=lambda o: o.lanes):
            bound = self.bound(o.lanes)
            ratio = "" if bound is None or o.lanes == 1 else (
                f", T({self.rows})/T({self.rows // o.lanes}) = {bound:.2f}")
            what = (f"{per_s(self.tokens_per_s(o.lanes))} tokens/s predicted{ratio}" if o.fits
                    else f"does not fit: {o.problem}")
            out.append(f"  {o.lanes} lane{'s' * (o.lanes > 1)}: {what}")
        return out


def choose_lanes(rows: int, options: Sequence[LaneOption], asked: int | None = None) -> LaneChoice:
    """The lane count of the most decode tokens per second predicted (`decode_step_s`), the
    fewest among those within `TIE` of it; `asked` (the user's `lanes=`) is taken as given."""
    options = tuple(options)
    if asked is not None:
        return LaneChoice(rows, asked, options, f"lanes={asked} asked for")
    fitting = [o for o in options if o.fits and o.stage_s]
    if not fitting:
        raise LanesError(f"no number of lanes fits the stages' memory for {rows} sequences\n" +
                         "\n".join(f"{o.lanes} lanes: {o.problem}" for o in options) +
                         "\nFix: plan for fewer sequences or a shorter length, or more devices")
    speed = {o.lanes: rows / decode_step_s(o.stage_s, o.lanes, o.loop_s) for o in fitting}
    best = max(speed.values())
    lanes = min(n for n, s in speed.items() if s >= best * (1 - TIE))
    if len(fitting) == 1:
        why = "the only lane count that fits"
    elif lanes == 1:
        why = "more lanes are not predicted faster: a lane's step costs nearly the batch's"
    else:
        why = "the most decode tokens/s predicted"
    unfit = [o.lanes for o in options if not o.fits]
    if unfit:
        why += f"; {', '.join(map(str, unfit))} lanes do not fit"
    return LaneChoice(rows, lanes, options, why)


def lane_options(plan: "Plan") -> list[LaneOption]:
    """The lane counts the decode plan weighed on its chosen number of stages (the model as is
    aside), each stage's time on one lane's rows."""
    stages = len(plan.stages)
    found: dict[int, LaneOption] = {}
    for candidate in plan.record.considered:
        config = candidate.config
        if config.num_stages != stages or (stages == 1 and plan.runs_as_is):
            continue
        part = candidate.partition
        option = LaneOption(config.chunks,
                            tuple(s.time_s for s in part.stages) if part is not None else (),
                            "" if candidate.predicted_s is not None else
                            (candidate.problem or "does not fit"))
        if config.chunks not in found or option.fits and not found[config.chunks].fits:
            found[config.chunks] = option
    return sorted(found.values(), key=lambda o: o.lanes)


def plan_decode(planner: Callable[..., "Plan"], lm: Any, devices: Sequence[Any],
                example: dict[str, Any], *, rows: int, lanes: int | str | None,
                loop_s: Callable[[int], float] = lambda rows: 0.0,
                **options: Any) -> tuple["Plan", LaneChoice | None]:
    """The decode plan of `lm` and its lanes: `lanes` as given (an int, at most `rows`), or
    with "auto" (or None) chosen (`choose_lanes`) among those planning weighed with
    `chunks="auto"`, the plan made again for the chosen count where planning chose another.
    `loop_s(n)`: the generation loop's own time per token on n sequences. None for the choice
    where the plan runs the model as is."""
    def looped(weighed: list[LaneOption]) -> list[LaneOption]:
        return [replace(o, loop_s=loop_s(-(-rows // o.lanes))) if o.fits else o
                for o in weighed]
    if lanes not in ("auto", None):
        plan = planner(lm, devices, example, chunks=min(int(lanes), rows), **options)
        return plan, choose_lanes(rows, looped(lane_options(plan)), asked=plan.chunks)
    plan = planner(lm, devices, example, chunks="auto", **options)
    options_weighed = lane_options(plan)
    if plan.runs_as_is or not options_weighed:     # (none: the plan's record weighed nothing)
        return plan, None
    choice = choose_lanes(rows, looped(options_weighed))
    if choice.lanes != plan.chunks:
        options = dict(options, num_stages=len(plan.stages))
        options.setdefault("costs", plan)       # the costs planning measured, reused
        plan = planner(lm, devices, example, chunks=choice.lanes, **options)
    return plan, choice


def slower_than_the_model(plan: "Plan", choice: LaneChoice | None, loop_s: float) -> str:
    """Why the model as is decodes faster than `choice`'s lanes on `plan` (its step, measured
    at planning, and its one loop's `loop_s` on every row, against the lanes' step predicted),
    or "" where it does not or was not measured."""
    model_s, step_s = plan.record.unpipelined_s, choice and choice.step_s(choice.lanes)
    if plan.runs_as_is or not model_s or not step_s or step_s <= model_s + loop_s:
        return ""
    return (f"the model's step with its loop ({(model_s + loop_s) * 1e3:.3g} ms) is faster "
            f"than {choice.lanes} lane{'s' * (choice.lanes > 1)}' predicted "
            f"({step_s * 1e3:.3g} ms)")


class Prefixed(Weights):
    """The model's own weights (a checkpoint, a state_dict: `open_weights`) under the names a
    generation's stages give them, each with `prefix` (`CachedLM` holds the model as
    `model`)."""

    def __init__(self, weights: Any, prefix: str = "model."):
        self.inner, self.prefix = open_weights(weights), prefix
        self.where, self.cast = self.inner.where, self.inner.cast

    def names(self) -> set[str]:
        return {self.prefix + name for name in self.inner.names()}

    def _read(self, like, device):
        n = len(self.prefix)
        return {self.prefix + name: t for name, t in
                self.inner._read({name[n:]: t for name, t in like.items()}, device).items()}


def refuse_meta(plan: "Plan") -> None:
    """A generation planned from a model on meta holds no weights: refused before it runs,
    with the fix (`fxpipe.generate.load_generation` with `weights=`)."""
    if any(t.is_meta for stage in plan.stages for t in stage.module.parameters()):
        raise GenerationError("this generation was planned on meta: its stages hold no weights\n"
                              "Fix: save_generation(generation, path), then "
                              "load_generation(path, weights='ckpt/') (a checkpoint or a "
                              "state_dict), or plan from the model with its weights")
