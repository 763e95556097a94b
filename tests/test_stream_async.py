"""pipe.stream_train(mode="async"): each item's gradient is the model's at the weights its
forward used (stashed), applied at most max_staleness steps later, the whole run the delayed SGD
it says it is; stopping and failures leave no thread and write nothing afterwards; the rows
cannot deadlock under the staleness bound."""

import copy
import dataclasses
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.nn import functional as F

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.passes.randomness import microbatch_seeds
from fxpipe.runtime.asynchronous import row
from fxpipe.runtime.schedules import Phase, async_warmup

from test_stream_train import (PressesCtrlC, assert_nothing_written_after, compiled, ctrl_c,  # noqa: F401
                               grads_and_optimizer_state, ours, stream_of)


def delayed_sgd(model, optimizer, items, window, versions, reduction="mean", seed=0):
    """The reference: the model trained window after window, each item's gradient taken at the
    weights `versions[m]` steps into the run (its stash) with the buffers as the items before
    it left them, each item from its own seed; per window: its loss, each item's gradient (of
    its own loss) and the parameters after its step; and the buffers at the end."""
    torch.manual_seed(seed)
    seeds = [microbatch_seeds(1)[0] for _ in items]
    history = [{k: v.detach().clone() for k, v in model.named_parameters()}]
    scratch = copy.deepcopy(model)
    out = []
    for start in range(0, len(items), window):
        chunk = range(start, min(start + window, len(items)))
        rows = sum(len(items[m][0]) for m in chunk)
        optimizer.zero_grad()
        item_grads, total = [], 0
        for m in chunk:
            x, target = items[m]
            with torch.no_grad():
                for name, p in scratch.named_parameters():
                    p.copy_(history[versions[m]][name])
            scratch.zero_grad()
            with torch.random.fork_rng():
                torch.manual_seed(seeds[m])
                loss = F.mse_loss(scratch(x), target, reduction=reduction)
            loss.backward()
            weight = len(x) / rows if reduction == "mean" else 1.0
            total = total + loss.detach() * weight
            item_grads.append({k: p.grad.clone() for k, p in scratch.named_parameters()})
            for p, q in zip(model.parameters(), scratch.parameters()):
                p.grad = q.grad * weight if p.grad is None else p.grad + q.grad * weight
        optimizer.step()
        history.append({k: v.detach().clone() for k, v in model.named_parameters()})
        out.append((total, item_grads, params_of(model)))
    return out, {k: v.clone() for k, v in scratch.named_buffers()}


def params_of(module):
    return {k: v.detach().clone() for k, v in module.named_parameters()}


@pytest.mark.parametrize("stages, max_staleness, window", [
    (1, 0, 1), (2, 1, 1), (2, 0, 2), (3, 2, 1), (3, 1, 2), (3, None, 3)])
def test_each_update_is_the_models_gradient_at_the_weights_the_item_used(
        stages, max_staleness, window):
    pipe, reference, opt, ref_opt = compiled(stages)
    items = stream_of(9)
    seen = []     # per step: each parameter's .grad as the optimizer steps
    opt.register_step_pre_hook(lambda o, a, k: seen.append(
        {name: p.grad.clone() for name, p in pipe.named_parameters()}))
    torch.manual_seed(0)
    steps = [(loss, params_of(pipe)) for loss in pipe.stream_train(
        items, F.mse_loss, opt, mode="async", max_staleness=max_staleness, window=window)]
    k = stages - 1 if max_staleness is None else max_staleness
    versions = pipe.last_run.versions
    # A source that is never late: item m enters as soon as the bound lets it.
    assert versions == [max(0, m // window - k) for m in range(9)]
    assert pipe.last_run.staleness == [m // window - v for m, v in enumerate(versions)]
    assert max(pipe.last_run.staleness) == min(k, 8 // window)
    expected, buffers = delayed_sgd(reference, ref_opt, items, window, versions)
    assert len(steps) == len(expected) == -(-9 // window)
    for (loss, params), grads, (ref_loss, item_grads, ref_params) in zip(steps, seen, expected):
        assert_same_up_to_rounding(loss, ref_loss.to(loss.dtype))
        assert_same_up_to_rounding(params, ref_params)
        if window == 1:      # the step's gradient is its one item's
            assert_same_up_to_rounding(grads, item_grads[0])
    # Each stage ran its items' forwards in order: the running statistics are the reference's.
    assert_same_up_to_rounding(dict(pipe.named_buffers()), buffers)
    assert not ours()


def test_a_late_source_lets_items_use_newer_weights_never_older_than_the_bound():
    """Two stages hold two items at once; a bound of 3 lets two more wait ahead. An item that
    comes late enters with the weights of the items that finished meanwhile."""
    pipe, reference, opt, ref_opt = compiled(2)
    items = stream_of(8)

    def late():
        for m, item in enumerate(items):
            if m % 3 == 2:
                time.sleep(0.2)        # the stages finish what they hold meanwhile
            yield item

    torch.manual_seed(0)
    steps = [params_of(pipe) for _ in pipe.stream_train(late(), F.mse_loss, opt, mode="async",
                                                         max_staleness=3)]
    versions, staleness = pipe.last_run.versions, pipe.last_run.staleness
    assert all(0 <= s <= 3 for s in staleness)
    assert staleness[2] < 2 and staleness[5] < 3     # newer weights than a prompt item's
    expected, _ = delayed_sgd(reference, ref_opt, items, 1, versions)
    for params, (_, _, ref_params) in zip(steps, expected):
        assert_same_up_to_rounding(params, ref_params)


def test_a_sum_reduction_and_a_partial_window():
    pipe, reference, opt, ref_opt = compiled(2)
    items = stream_of(5)
    torch.manual_seed(0)
    losses = list(pipe.stream_train(items, lambda o, t: F.mse_loss(o, t, reduction="sum"), opt,
                                    mode="async", window=2, reduction="sum"))
    expected, _ = delayed_sgd(reference, ref_opt, items, 2, pipe.last_run.versions,
                              reduction="sum")
    assert len(losses) == 3
    assert_same_up_to_rounding(losses, [loss.to(losses[0].dtype) for loss, _, _ in expected])
    assert_same_up_to_rounding(dict(pipe.named_parameters()),
                               dict(reference.named_parameters()))
    opt2 = torch.optim.SGD(pipe.parameters(), lr=0.1)
    assert len(list(pipe.stream_train(items, F.mse_loss, opt2, mode="async", window=2,
                                      partial="drop"))) == 2


def test_a_loss_sum_and_count_weighs_items_by_their_counts():
    """Items of equal counts: (loss_sum, count) gives the window's mean, as "mean" does."""
    items = stream_of(6)
    runs = []
    for loss_fn in (F.mse_loss, lambda o, t: (F.mse_loss(o, t, reduction="sum"), t.numel())):
        pipe, _, opt, _ = compiled(2)
        torch.manual_seed(0)
        losses = list(pipe.stream_train(items, loss_fn, opt, mode="async", window=3))
        runs.append((losses, params_of(pipe)))
    torch.testing.assert_close(runs[0], runs[1])


def test_stashed_versions_are_counted_in_the_memory_and_refused_where_they_do_not_fit():
    pipe, *_ = compiled(2)
    params = [sum(p.numel() * p.element_size() for p in s.parameters()) for s in pipe.stages]
    one, two = pipe.plan.stream_train_memory(1), pipe.plan.stream_train_memory(2)
    assert [b - a for a, b in zip(one, two)] == params   # one more copy per step of staleness
    part = pipe.plan.partition
    devices = tuple(dataclasses.replace(d, memory_bytes=need + 64)
                    for d, need in zip(part.devices, one))
    small = fxpipe.Pipeline(dataclasses.replace(
        pipe.plan, partition=dataclasses.replace(part, devices=devices)))
    opt = torch.optim.SGD(small.parameters(), lr=0.1)
    with pytest.raises(fxpipe.DeviceError, match=r"stage 0 would hold [\s\S]*\nlower max_staleness"):
        small.stream_train([], F.mse_loss, opt, mode="async", max_staleness=2)
    assert list(small.stream_train([], F.mse_loss, opt, mode="async", max_staleness=1)) == []


def test_leaving_the_loop_joins_every_worker_and_writes_nothing_afterwards():
    pipe, _, opt, _ = compiled(3)
    endless = (item for _ in iter(int, 1) for item in stream_of(3))
    for i, _ in enumerate(pipe.stream_train(endless, F.mse_loss, opt, mode="async")):
        if i == 3:
            break
    caught = grads_and_optimizer_state(pipe, opt)
    assert not ours() and all(g is None for g in caught[0])
    assert_nothing_written_after(pipe, opt, caught)


def test_a_source_that_raises_or_a_consumer_that_raises_stops_the_stream():
    pipe, _, opt, _ = compiled(2)

    def source():
        yield from stream_of(4)
        raise OSError("sensor unplugged")

    with pytest.raises(OSError, match="sensor unplugged"):
        list(pipe.stream_train(source(), F.mse_loss, opt, mode="async"))
    assert not ours() and all(p.grad is None for p in pipe.parameters())
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(pipe.stream_train(stream_of(50), F.mse_loss, opt, mode="async")):
            if i == 2:
                caught = grads_and_optimizer_state(pipe, opt)
                raise KeyboardInterrupt
    assert not ours()
    assert_nothing_written_after(pipe, opt, caught)


def test_a_failing_item_names_its_stage_and_index():
    pipe, _, opt, _ = compiled(2)
    items = stream_of(6)
    items[4] = (torch.randn(2, 3), items[4][1])
    losses = []
    with pytest.raises(fxpipe.StageError, match=r"stage 0 .*on item 4 \(forward\)") as info:
        for loss in pipe.stream_train(items, F.mse_loss, opt, mode="async", max_staleness=1):
            losses.append(loss)
    assert info.value.microbatch == 4 and not ours() and len(losses) <= 3
    assert all(p.grad is None for p in pipe.parameters())


def test_ctrl_c_joins_every_worker(ctrl_c):
    pipe, _, opt, _ = compiled(2)
    pipe.module.mid.register_forward_hook(PressesCtrlC(on=5))
    try:
        for _ in pipe.stream_train(stream_of(20), F.mse_loss, opt, mode="async"):
            pass
    except KeyboardInterrupt:
        alive, caught = ours(), grads_and_optimizer_state(pipe, opt)
    else:
        pytest.fail("Ctrl-C did not reach the caller")
    assert alive == [] and all(g is None for g in caught[0])
    assert_nothing_written_after(pipe, opt, caught)


def test_bad_arguments_are_refused_when_called():
    pipe, _, opt, _ = compiled(2)
    with pytest.raises(fxpipe.BatchError, match="max_staleness=1 bounds mode='async'"):
        pipe.stream_train([], F.mse_loss, opt, max_staleness=1)
    with pytest.raises(fxpipe.BatchError, match="mode='fast'"):
        pipe.stream_train([], F.mse_loss, opt, mode="fast")
    with pytest.raises(fxpipe.BatchError, match="max_staleness=-1"):
        pipe.stream_train([], F.mse_loss, opt, mode="async", max_staleness=-1)


# --- the rows under the bound, on an ideal machine -----------------------------------------------

@st.composite
def stage_graphs(draw):
    """Stages in order, each reading the driver (stage 0) or some earlier stages; the last
    computes the loss."""
    n = draw(st.integers(1, 5))
    reads = {0: []}
    for s in range(1, n):
        reads[s] = draw(st.lists(st.integers(0, s - 1), min_size=1, unique=True))
    return n, reads


@settings(max_examples=300, deadline=None)
@given(graph=stage_graphs(), k=st.integers(0, 4), window=st.integers(1, 4),
       count=st.integers(0, 20))
def test_the_rows_never_deadlock_and_keep_the_bound(graph, k, window, count):
    """Stages walk their rows, an action running once what it needs ran; the driver feeds
    item m while m // window - version <= k and applies items in order. Every item is applied."""
    n, reads = graph
    read_by = {s: [r for r in range(n) if s in reads[r]] for s in range(n)}
    rows = [row(s, async_warmup(s, n, k, window)) for s in range(n)]
    heads = [next(r) for r in rows]
    done, fed, applied, entered = set(), 0, 0, {}
    while applied < count:
        while fed < count and fed // window - applied // window <= k:
            entered[fed] = applied // window
            fed += 1
        progressed = False
        for s in range(n):
            action = heads[s]
            if action is None:
                continue
            m = action.microbatch
            if m >= count:           # past the stream's end: forwards skipped, backward stops
                if action.phase is Phase.BACKWARD:
                    heads[s] = None
                else:
                    heads[s] = next(rows[s])
                progressed = True
                continue
            if action.phase is Phase.FORWARD:
                ready = m < fed and all((p, m, "F") in done for p in reads[s])
            else:
                ready = (s, m, "F") in done and all((r, m, "B") in done for r in read_by[s])
            if ready:
                done.add((s, m, action.phase.value))
                heads[s] = next(rows[s])
                progressed = True
        while applied < count and all((s, applied, "B") in done for s in range(n)):
            assert applied // window - entered[applied] <= k
            applied += 1
            progressed = True
        assert progressed, f"deadlock at {heads} with {fed} fed, {applied} applied"
