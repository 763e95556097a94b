"""What a user reads: a plan as `print(plan)` shows it, tables (tabulate) and warnings.

`print(plan)` shows what a Pipeline runs (stages, wiring, calling convention, batch dims, schedule,
threads, the mode) and what the plan found: each stage's module paths, the predicted time per call
against the model run whole (measured at compile), and a warning when the pipeline is predicted to
lose. No speed-up is claimed (`unclaimed`) where CPU stages oversubscribe the cores or the
measurement was unsteady. The speed-up measured in use (`Plan.observed`, which a Pipeline fills
after its first calls of the example's rows, and `last_run`) is shown beside the predicted one,
with a warning past 25%. `LINK_DESCRIPTIONS` words each `link=` choice. docs/reading-the-plan.md
explains every kind of line (tests/test_reading_the_plan.py holds it).
"""

from __future__ import annotations

import os
from collections import Counter

from fxpipe.passes.annotate_costs import UNSTEADY
from fxpipe.passes.cost_model import CUDA_CONTEXT_BYTES, format_bytes
from fxpipe.passes.device import is_cpu, is_gpu
from fxpipe.passes.materialize import blockless

from .prediction import in_flight, notes

# `Plan` in annotations is `plan_data.Plan`: plan_data renders its plans here, so this module
# names the type and never imports it (the import runs one way, `tests/test_layers.py`).


def tabulate(*args, **kwargs) -> str:
    """`tabulate.tabulate`, imported where a plan is printed, not with fxpipe."""
    from tabulate import tabulate as table
    return table(*args, **kwargs)


# What `Plan.link` says transfers were priced as.
LINK_DESCRIPTIONS = {"default": "hand-offs between threads of one process (link='default')",
                     "measure": "copies measured on this machine (link='measure')",
                     "gloo": "messages between processes over gloo (link='gloo')",
                     "yours": "your link function"}


def table(plan: Plan) -> str:
    """Each stage: its device, nodes, what it runs, predicted time, parameters, bytes sent."""
    rows = []
    for s, cost in enumerate(plan.partition.stages):
        first, last = plan.record.stage_spans[s]
        modules = plan.record.stage_modules[s] if plan.record.stage_modules else ()
        runs = ", ".join(modules) if modules else f"{first} .. {last}"
        rows.append((s, plan.partition.devices[s].name, cost.num_nodes, runs,
                     cost.time_s * 1e3, plan.stage_param_bytes[s] / 1e6,
                     format_bytes(cost.sent_bytes)))
    return tabulate(rows, headers=["stage", "device", "nodes", "runs", "predicted ms",
                                   "params MB", "sent"], floatfmt=".3f",
                    maxcolwidths=[None, None, None, 64, None, None, None])


def describe(plan: Plan) -> str:
    """The plan as `print(plan)` shows it."""
    p = plan.partition
    proof = "proven optimal" if p.optimal else f"within {p.gap:.2f}x of the lower bound"
    return "\n".join([
        f"fxpipe plan: {_count(p.num_stages, 'stage')}, {_count(plan.chunks, 'micro-batch')}, "
        f"captured by {plan.capture}",
        *_sizes(plan),
        table(plan),
        f"bottleneck {p.bottleneck_s * 1e3:.3f} ms per micro-batch, lower bound "
        f"{p.lower_bound_s * 1e3:.3f} ms ({proof}); values priced as "
        f"{LINK_DESCRIPTIONS[plan.link]}",
        *notes(plan.record.chosen),
        *_measurement(plan),
        *_sources(plan),
        *_activations(plan),
        *measured_memory(plan),
        *_cuda_context(plan),
        *_comparison(plan),
        *_observed(plan),
        *_overlap(plan),
        *_stand_ins(plan),
        *_choice(plan),
        f"outputs checked against the model: {plan.record.verified}{_tolerance(plan)}",
    ])


def _tolerance(plan: Plan) -> str:
    """What the outputs were checked within, and where that came from, after "yes"."""
    if not plan.record.verified.startswith("yes") or not plan.record.verify_tolerance_source:
        return ""
    if plan.record.verify_tolerance is None:
        return (f", within 16 epsilons of each output's dtype, relative to its largest "
                f"magnitude ({plan.record.verify_tolerance_source})")
    return (f", within {plan.record.verify_tolerance:.2g} of each output's largest magnitude "
            f"({plan.record.verify_tolerance_source})")


def _sizes(plan: Plan) -> list[str]:
    """The input sizes the plan serves, and that it was balanced for the example's."""
    if plan.signature is None:
        return []
    return [f"serves {plan.signature.sizes_served()}; balanced for the example's sizes"]


def _measurement(plan: Plan) -> list[str]:
    """How the costs were measured: their spread, and the calibration to the graph's own
    time; a warning when the measurement was unsteady."""
    if plan.record.calibration is None:
        return []
    forward, backward = plan.record.calibration
    scaled = f"x{forward:.2f} forward" + (f", x{backward:.2f} backward"
                                         if backward != 1.0 else "")
    weighed = plan.record
    steady = weighed.spread is None or weighed.spread <= UNSTEADY
    # The model as is, its nodes measured for a pipeline's stage at its rows (`Costs.as_is`).
    kind = plan.partition.devices[0].kind
    borrowed = plan.runs_as_is and not any(key[1] == kind and not key[2]
                                           for key in weighed.measurements)
    lines = [f"node costs: measured one by one{' for a pipeline stage' * borrowed} (spread "
             f"{weighed.spread or 0:.0%}, {'steady' if steady else 'unsteady'}), " + (
                 "not scaled to the whole graph's time (a model on meta never runs whole)"
                 if weighed.weights is not None else
                 f"scaled ({scaled}) to the model's own time measured as is" if borrowed else
                 f"scaled ({scaled}) to the time of the whole graph measured as a stage runs it")]
    if not steady:
        lines.append("warning: the costs were unsteady: another process may be using the "
                     "cores; compile again when the machine is quiet")
    return lines


def cost_sources(plan: Plan) -> dict[str, int]:
    """How many of the plan's computing nodes had their costs measured, reused from the block
    they repeat, and estimated (`NodeCost.source`): as the stages' nodes say, or on a loaded
    plan (whose nodes keep no costs) as its measurement on the first stage's kind of device."""
    kind = plan.partition.devices[0].kind
    saved = next((m.costs for key, m in plan.record.measurements.items() if key[1] == kind), {})
    counted = dict.fromkeys(("measured", "reused", "estimated"), 0)
    for stage in plan.stages:
        for n in stage.module.graph.nodes:
            cost = n.meta.get("cost") or saved.get(n.name)
            if n.op.startswith("call") and cost is not None:
                counted[cost.source] += 1
    return counted


def _sources(plan: Plan) -> list[str]:
    """How many nodes were measured, reused and estimated."""
    counted = cost_sources(plan)
    if not any(counted.values()):
        return []
    return [f"node costs: {counted['measured']} measured, {counted['reused']} reused from the "
            f"first of the blocks they repeat, {counted['estimated']} estimated from their "
            f"FLOPs and bytes (where a node could not run)"]


def _activations(plan: Plan) -> list[str]:
    """In training: each stage's memory at the schedule's peak of micro-batches in flight,
    keeping its activations and recomputing them, and what it does."""
    if not plan.training or not any(plan.stage_saved_bytes):
        return []
    part = plan.partition
    peaks = in_flight(True, plan.schedule, plan.chunks, part.num_stages)
    some = plan.record.stage_recomputed or ((),) * part.num_stages
    rows = [(s, n, format_bytes(c.memory_kept_bytes), format_bytes(c.memory_recomputing_bytes),
             format_bytes(d.memory_bytes), format_bytes(c.memory_bytes),
             f"recomputes its forward (+{c.recompute_s * 1e3:.3f} ms per micro-batch)"
             if recompute else
             f"recomputes {_count(len(nodes), 'node')}: {', '.join(nodes[:4])}"
             f"{', ...' if len(nodes) > 4 else ''} (+{c.recompute_s * 1e3:.3f} ms per "
             f"micro-batch)" if nodes else "keeps its activations")
            for s, (n, c, d, recompute, nodes) in enumerate(
                zip(peaks, part.stages, part.devices, plan.stage_recompute, some))]
    return [f"memory in training (parameters, gradients, optimizer state, and what autograd "
            f"keeps per micro-batch in flight; recompute='{plan.recompute}'):",
            tabulate(rows, headers=["stage", "in flight", "keeping", "recomputing",
                                    "device has", "planned", "chosen"])]


def measured_memory(plan: Plan) -> list[str]:
    """Each stage's memory measured in the latest run that tracked it, beside the prediction
    (where the run was one the plan priced: its mode and its micro-batches)."""
    seen = plan.observed
    if "peak_bytes" not in seen:
        return []
    priced = (seen["training"] == bool(plan.training) and seen["microbatches"] == plan.chunks)
    # The optimizer's state is the caller's, made by its first step, outside the run.
    state = plan.partition.memory.optimizer_state if plan.training else 0.0
    rows = []
    for s, cost in enumerate(plan.partition.stages):
        measured = seen["peak_bytes"].get(s, 0)
        predicted = cost.memory_bytes - state * plan.stage_param_bytes[s]
        rows.append((s, format_bytes(predicted) if priced else "-", format_bytes(measured),
                     f"{predicted / measured:.2f}" if priced and measured else "-"))
    run = (f"{'a train step' if seen['training'] else 'a call'} of "
           f"{_count(seen['microbatches'], 'micro-batch')}")
    note = "" if priced else (f"; the plan priced {'train steps' if plan.training else 'calls'} "
                              f"of {_count(plan.chunks, 'micro-batch')}")
    without = " (the optimizer's state, the caller's, left out)" if state else ""
    return [f"memory measured in the latest run ({run}{note}): each stage's peak, with its "
            f"parameters and buffers{without}",
            tabulate(rows, headers=["stage", "predicted", "measured", "predicted/measured"])]


def _cuda_context(plan: Plan) -> list[str]:
    """The CUDA context each GPU holds besides the stages' memory."""
    gpus = sorted({d.name for d in plan.partition.devices if is_gpu(d.name)})
    if not gpus:
        return []
    return [f"each GPU used ({', '.join(gpus)}) also holds the process's CUDA context, about "
            f"{format_bytes(CUDA_CONTEXT_BYTES)}: outside the stages' memory above, and not "
            f"charged against a device's memory_bytes"]


def _comparison(plan: Plan) -> list[str]:
    """The pipeline's predicted time per batch against the model's own, and a warning
    when the pipeline is predicted to lose."""
    if plan.record.weights is not None:
        return [f"planned from the meta device, never holding the model whole: measured and "
                f"checked on values from {plan.record.weights}; the model unpipelined was not "
                f"measured (no device holds it). Planning peaked at "
                f"{format_bytes(plan.record.planning_peak_rss_bytes or 0)} resident"]
    if plan.speedup is None:
        return []
    spread = ("" if plan.record.unpipelined_spread is None else
              f", median of warm runs between the stages' measurements, spread "
              f"{plan.record.unpipelined_spread:.0%}")
    model = (f"{plan.record.unpipelined_s * 1e3:.3f} ms measured (whole batch, "
             f"{_count(plan.record.unpipelined_threads, 'thread')}{spread})")
    if plan.runs_as_is:
        return [f"per batch: the model as is, {model}: {plan.runs.value}, so the one stage runs "
                f"the whole batch on the caller's thread"]
    why = unclaimed(plan)
    if why:
        return [f"per batch: pipeline {plan.record.predicted_step_s * 1e3:.3f} ms predicted, "
                f"model unpipelined {model}; no speed-up claimed: {why}", *_host(plan)]
    lines = [f"per batch: pipeline {plan.record.predicted_step_s * 1e3:.3f} ms predicted, model "
             f"unpipelined {model}: {plan.speedup:.2f}x", *_host(plan)]
    if plan.speedup < 1:
        lines.append("warning: the pipeline is predicted slower than the model run whole: "
                     "let the plan choose (num_stages='auto', chunks='auto'), or run the "
                     "model without fxpipe")
    return lines


def _host(plan: Plan) -> list[str]:
    """What the prediction holds besides the stages' work (`HostCosts`): the call's own work,
    and the share of each stage's forward (and in training backward) holding the interpreter
    lock."""
    host = plan.record.host
    if host.call_s(1, 1, 1) <= 0 and not host.holds_lock:
        return []
    shares = lambda forward: ", ".join(      # noqa: E731
        f"{host.lock_share(stage, forward):.0%}" for stage in plan.partition.stages)
    call_s = host.call_s(plan.chunks, *plan.leaves)
    backwards = f", their backwards {shares(False)}" if plan.training else ""
    actions = (f", and each action's own {host.train_action_s * 1e3:.3f} ms (what the backward "
               f"keeps, the loss, the backward's start)" if plan.training else "")
    return [f"besides the stages: the call's own work {call_s * 1e3:.3f} ms (split, merge, the "
            f"runtime's start and end){actions}; the stages' forwards hold the interpreter lock "
            f"{shares(True)} of their time{backwards}, each waiting for the others' holds"]


def unclaimed(plan: Plan) -> str:
    """Why the plan's predicted speed-up cannot be relied on here, in words ("" where it can):
    CPU stages asking for more threads than the machine has cores (they take turns, which the
    prediction prices only roughly), costs or the model's own runs measured unsteadily
    (another process using the cores), or training stages whose work is mostly Python
    (`PYTHON_BOUND`)."""
    if plan.runs_as_is or plan.record.weights is not None:
        return ""
    devices = plan.partition.devices
    asked, cores = sum(d.threads or 1 for d in devices if is_cpu(d.name)), os.cpu_count() or 1
    if asked > cores:
        return (f"the CPU stages ask for {asked} threads on {_count(cores, 'core')}, so they "
                f"take turns (plan as many CPU stages as cores, or fewer, for a prediction)")
    unsteady = [f"{what} (spread {spread:.0%})" for what, spread in
                [("the node costs", plan.record.spread),
                 ("the model's own runs", plan.record.unpipelined_spread)]
                if spread is not None and spread > UNSTEADY]
    if unsteady:
        return (f"the figures are unsteady: {' and '.join(unsteady)} varied over "
                f"{UNSTEADY:.0%}, as when another process uses the cores; compile again when "
                f"the machine is quiet")
    host = plan.record.host
    held = max(((host.lock_share(s, True), host.lock_share(s, False))
                for s in plan.partition.stages), key=min, default=(0.0, 0.0))
    if plan.training and min(held) > PYTHON_BOUND:
        return (f"a stage's forward holds the interpreter lock {held[0]:.0%} of its time and "
                f"its backward {held[1]:.0%}, so its work is mostly Python, and a train step's "
                f"own Python (each micro-batch's loss, the gradients' scaling, the backward "
                f"calls) is not in the prediction")
    work_s = sum(s.compute_s for s in plan.partition.stages) * plan.chunks
    model_s = plan.record.unpipelined_s
    if model_s and work_s and all(is_cpu(d.name) for d in devices) and \
            model_s > DISAGREE * work_s:
        return (f"the figures disagree: the model run whole took {model_s * 1e3:.3f} ms, "
                f"{model_s / work_s:.0f}x its stages' whole work on one thread each "
                f"({work_s * 1e3:.3f} ms), as when another process held the cores while the "
                f"model ran; compile again when the machine is quiet")
    return ""


# The model run whole on the caller's threads never takes longer than its stages' work on the
# whole batch, one thread each (fewer threads, smaller micro-batches), by more than the
# call's own overhead: over this factor, the model's runs were slowed by other processes (each
# run alike, so their spread looks steady), and a speed-up claimed on them would be that
# factor too high.
DISAGREE = 3.0


# A training plan with a stage whose forward and backward both hold the interpreter lock over
# this share of their time claims no speed-up: its train step's own Python, not priced, is then
# a large part of the step. Measured on the graph (`host.lock_held`): the README net's stages
# hold it 96-100% of their forwards and 65-70% of their backwards, and its step ran 1.8-2.1x
# the prediction; ResNet-50 and DenseNet at 2-4 rows a micro-batch 41-87% and 0-32%, their
# steps within 1.1x.
PYTHON_BOUND = 0.5


# Measured and predicted speed-ups further apart than this (the larger over the smaller) warn;
# up to `WARMING_RUNS` calls, the warning says the pipeline may still be warming up.
OBSERVED_SLACK = 1.25
WARMING_RUNS = 16


def _observed(plan: Plan) -> list[str]:
    """The speed-up measured over the pipeline's calls so far (`Plan.observed`, the model's
    time at compile over the median call) beside the predicted one; a warning when they
    differ by more than `OBSERVED_SLACK`."""
    seen = plan.observed
    if "speedup" not in seen:
        return []
    runs = "train steps" if plan.training else "calls"
    predicted = plan.claimed_speedup
    lines = [f"measured in use: {seen['step_s'] * 1e3:.3f} ms per {runs[:-1]} (median of the "
             f"latest {len(seen['times_s'])} of {seen['runs']} {runs}, the first left out): "
             f"{seen['speedup']:.2f}x the model's {plan.record.unpipelined_s * 1e3:.3f} ms at "
             f"compile, "
             + (f"{predicted:.2f}x predicted" if predicted is not None else
                "no speed-up was claimed")]
    if seen["speedup"] < 1:
        lines.append(f"warning: the pipeline measured slower than the model run whole "
                     f"({seen['speedup']:.2f}x): let the plan choose (num_stages='auto', "
                     f"chunks='auto'), which keeps the model as is where no pipeline wins here")
    if predicted is not None:
        off = max(predicted, seen["speedup"]) / min(predicted, seen["speedup"])
        if off > OBSERVED_SLACK:
            lines.append(f"warning: the measured speed-up is {off:.2f}x off the predicted one: "
                         f"the machine may be busier (or quieter) than at compile, or the calls "
                         f"differ from the example; compile again where the pipeline runs to "
                         f"plan on its conditions"
                         + (f" (after {seen['runs']} {runs}: a fresh pipeline's first 2-16 "
                            f"calls ran 2-5x slower on a 2-core machine)"
                            if seen["runs"] <= WARMING_RUNS else ""))
    return lines


def _overlap(plan: Plan) -> list[str]:
    """Warnings where the stages cannot all work at once: one micro-batch (each stage waits
    for the one before), or more CPU stages than this machine has cores."""
    stages = plan.partition.num_stages
    lines = []
    if stages > 1 and plan.chunks == 1:
        lines.append(f"warning: one micro-batch per call: the {stages} stages run one after "
                     f"another, never at once (more micro-batches, chunks=, by default 2 per "
                     f"stage, let them overlap where the model allows)")
    cpu_stages, cores = sum(is_cpu(d.name) for d in plan.partition.devices), os.cpu_count() or 1
    if cpu_stages > cores:
        lines.append(f"warning: {cpu_stages} CPU stages on {_count(cores, 'core')}: they take "
                     f"turns on the cores, so at most {cores} run at once")
    return lines


def _stand_ins(plan: Plan) -> list[str]:
    """One line naming the tensors timed (and checked) on stand-in values, by role: each
    name with its block numbers starred, and how many tensors it covers."""
    if not plan.record.stand_ins:
        return []
    roles = Counter(blockless(name) for name in plan.record.stand_ins)
    shown = [f"{role} ({_count(n, 'tensor')})" if n > 1 else role
             for role, n in list(roles.items())[:STAND_INS_SHOWN]]
    more = len(roles) - len(shown)
    checked = "timed and checked" if plan.record.verified.startswith("yes") else "timed"
    return [f"{checked} on stand-in values (no rule of the model's initialisation writes them; "
            f"a pipeline needs them from a checkpoint): {', '.join(shown)}"
            f"{f' and {more} more' if more else ''}"]


STAND_INS_SHOWN = 6


def _choice(plan: Plan) -> list[str]:
    """The configurations weighed (when more than one) and why this one was chosen."""
    if len(plan.record.considered) < 2:
        return []
    measured = {config: s for config, _, s in plan.record.raced}
    rows = []
    for c in plan.record.considered:
        as_is = c is plan.record.considered[-1] and plan.runs_as_is
        row = ["*" if c is plan.record.chosen else "", c.config.num_stages, c.config.chunks,
               c.config.schedule, c.config.threads,
               "-" if c.predicted_s is None else f"{c.predicted_s * 1e3:.3f}",
               c.memory_bytes / 1e6, "the model as is, measured" if as_is else c.problem]
        if measured:
            row.insert(6, f"{measured[c.config] * 1e3:.3f}" if c.config in measured else "")
        rows.append(row)
    headers = ["", "stages", "chunks", "schedule", "threads", "predicted ms", "memory MB", ""]
    if measured:
        headers.insert(6, "raced ms")
    title = "configurations considered (predicted time per batch" + (
        "; the shortlist and the model raced on the example, the least of interleaved runs"
        if measured else "") + "):"
    return [title, tabulate(rows, headers=headers, floatfmt=".3f",
                            maxcolwidths=[None] * (len(headers) - 1) + [60]),
            f"chosen: {plan.record.reason}"]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('h') else 's'}"


# --- generation (fxpipe.generate): `print(generation)` ------------------------------------------

def describe_generation(generation) -> str:
    """A generation plan as `print(plan_generation(...))` shows it: the sizes it serves, the
    lanes, each stage's key/value cache, the decode and prefill predictions."""
    g, decode = generation, generation.decode
    rows = [(s, decode.partition.devices[s].name, _layers(g.kv_layers[s]),
             format_bytes(g.kv_predicted[s]), decode.stage_param_bytes[s] / 1e6)
            for s in range(len(decode.stages))]
    lines = [f"fxpipe generation plan: {_count(g.rows, 'sequence')} of up to "
             f"{_count(g.length, 'token')} (prompt and new), {_count(g.lanes, 'lane')}, "
             f"prompts prefilled {_count(g.prompt, 'token')} at a time",
             tabulate(rows, headers=["stage", "device", "cache of layers", "KV bytes",
                                     "params MB"], floatfmt=".3f"),
             f"key/value cache: {format_bytes(sum(g.kv_predicted))} in all, each stage's within "
             f"its planned memory, allocated at each generate and freed after it"]
    tokens = g.tokens_per_s()
    if tokens is not None:
        lines.append(f"decode: {g.rows / tokens * 1e3:.3f} ms per step predicted "
                     f"for {_count(g.rows, 'sequence')}: {per_s(tokens)} tokens/s")
    if getattr(g, "as_is", ""):
        lines.append(f"as is: {g.as_is}")
    if getattr(g, "lane_choice", None) is not None:
        lines.extend(g.lane_choice.lines())
    if g.prefill.record.predicted_step_s:
        lines.append(f"prefill: {g.prefill.record.predicted_step_s * 1e3:.3f} ms per chunk of "
                     f"{_count(g.prompt, 'token')} predicted")
    lines.append("the two plans: print(generation.decode), print(generation.prefill)")
    return "\n".join(lines)


def per_s(rate: float) -> str:
    """A rate for people: whole numbers from 10 up, two significant digits below (a 70B
    model's few tokens a second are not 0)."""
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"


def _layers(layers: list[int]) -> str:
    if not layers:
        return "-"
    return f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) \
        else ", ".join(map(str, layers))
