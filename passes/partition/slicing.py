"""Method 1: slicing topological orders (always; the upper bound the exact methods prune with).

Binary search on the bottleneck B; for a given B one greedy pass (`_slice`) closes each stage as
late as its time allows: received values are priced over the real link, a sender is re-charged
when a second stage receives its value, and a stage stops growing as soon as a transfer pushes
an earlier stage over B. O(n + e) per pass, O((n + e) log(1/eps)) per order; run over the
graph's order and a depth-first order that keeps each branch together (`_orders`).

Slicing grows as (n + e) log(1/eps), nearly independent of the number of stages.
"""

from __future__ import annotations

import math
from typing import Iterator

from ..cost_model import CostGraph, Held, Pricing


def _orders(graph: CostGraph) -> Iterator[tuple[str, list[int]]]:
    """The graph's own order, and a depth-first order that keeps each branch together."""
    given = graph.compute_nodes
    yield "graph", given
    waiting = [sum(not graph.is_input[p] for p in graph.preds[i]) for i in range(len(graph))]
    stack = [i for i in reversed(given) if waiting[i] == 0]
    order = []
    while stack:
        i = stack.pop()
        order.append(i)
        for j in reversed(graph.succs[i]):
            waiting[j] -= 1
            if waiting[j] == 0:
                stack.append(j)
    if order != given:
        yield "depth-first", order


def _best_slicing(model: Pricing, order: list[int], bound: float) -> list[int] | None:
    """The best contiguous slicing of `order` found by binary search on the bottleneck.

    Starts from the lower bound and gallops up (bound * (1 + 2^j / 1024)) to the first bottleneck
    the greedy pass meets, then bisects to a relative precision of 1e-4 (1e-7 on small graphs).
    A pass that fails because later stages re-charged an earlier one for sending it their values
    is retried (up to 3 times) with that stage closed earlier by the amount it went over; so is
    one whose stage fits its device by the relaxed memory rule but not by the exact one, with
    that stage's memory kept free by the amount it went over.
    """
    position = [-1] * len(model.graph)
    for at, i in enumerate(order):
        position[i] = at
    last = [max((position[j] for j in model.graph.succs[i]), default=-1)
            for i in range(len(model.graph))]

    def feasible(limit: float) -> tuple[list[int], float] | None:
        reserve = [0.0] * model.k
        room = [0.0] * model.k       # memory kept free for what only the exact view counts
        for _ in range(4):
            over: dict[int, float] = {}
            found = _slice(model, order, position, last, limit, reserve, over, room)
            if found is not None:
                excess = model.memory_over(found[0])
                if all(e <= 0 for e in excess):
                    return found
                for s, e in enumerate(excess):
                    room[s] += max(e, 0.0)
                continue
            if not over:
                return None
            for s, amount in over.items():
                reserve[s] += amount
        return None

    best = feasible(math.inf)
    for j in range(21) if best is None else ():
        # With no time limit the greedy pass fills the first stages up to their memory, where
        # what only the exact view counts (values waiting between stages) may keep one over
        # whatever room is kept; a time limit spreads the nodes, and the stages with them.
        best = feasible(bound * (1 + 2 ** j / 1024))
        if best is not None:
            break
    if best is None:
        return None
    high = best[1]
    low = bound
    step = 1 / 1024
    precision = 1e-7 if len(order) <= 2_000 else 1e-4
    for _ in range(200):
        if high - low <= precision * high:
            break
        target = (low + high) / 2
        if step and low > 0:
            target = min(target, low * (1 + step))
        found = feasible(target)
        if found is None:
            low = target
            step = step * 2 if step else 0
        else:
            best = found
            high = min(found[1], target)
            step = 0
    return best[0]


def _slice(model: Pricing, order: list[int], position: list[int], last: list[int],
           limit: float, reserve: list[float], over: dict[int, float],
           room: list[float] | None = None) -> tuple[list[int], float] | None:
    """One greedy pass: close each stage at the last node that keeps every stage within `limit`
    (stage `s`'s own time within `limit - reserve[s]`, room for later charges).

    Returns the stage of every node and the bottleneck, or None when `limit` is not met; `over`
    then says by how much later transfers pushed which earlier stages over the limit. Stage
    times are exact except that a value sent to later stages is first charged at the cheapest
    link to one of them; the receiving stage tops the charge up to the real link, and charges
    again for every further receiving stage, and that recomputing part of a stage is charged at
    its relaxed bound (`Pricing.recompute_s`, `room[s]` bytes of its device kept free).
    Compute, received values and memory only grow as a stage grows, so a stage stops growing as
    soon as they pass the limit.
    """
    graph, k = model.graph, model.k
    out_bytes, params, saved = graph.out_bytes, graph.param_bytes, graph.saved_bytes
    new_bytes, kept = graph.new_bytes, graph.output_kept
    preds, is_input, to_output = graph.preds, graph.is_input, graph.to_output
    n = len(order)
    stage_of = [-1] * len(graph)
    load = [0.0] * k
    received_once = bytearray(len(graph))   # some later stage already receives the value
    start = 0
    for s in range(k):
        times = model.times[s]
        forward = model.forward_columns[model.column_of[s]]
        returned, fed = model.transfer(s, None), model.transfer(None, s)
        send_min = model.send_min(s)
        unbounded = model.unbounded[s]    # memory costs it nothing: skip pricing it per node
        final = s == k - 1
        fixed = 0.0          # compute, received values and outputs: grows with the stage
        sending = 0.0        # values read after the stage's end, charged at the cheapest link
        param_bytes = activation_bytes = saved_bytes = received_bytes = 0
        forward_s = 0.0      # the stage's forward: what recomputing it adds
        sending_bytes = 0    # values read after the stage or returned, each once
        sending_new = returned_bytes = 0   # their new memory; the values returned
        sending_kept = 0     # values read after the stage that a node keeps (training)
        received: dict[int, None] = {}
        charges: list[tuple[int, float, int]] = []   # (earlier stage, extra time, producer)
        extra = [0.0] * k
        end = None
        for at in range(start, n - (k - 1 - s)):
            i = order[at]
            fixed += times[i]
            param_bytes += params[i]
            activation_bytes += out_bytes[i]
            saved_bytes += saved[i]
            forward_s += forward[i]
            if to_output[i]:
                fixed += returned[i]
            if last[i] > at:
                sending += send_min[i]
            if last[i] > at or to_output[i]:
                sending_bytes += out_bytes[i]
                sending_new += new_bytes[i]
            if to_output[i]:
                returned_bytes += out_bytes[i]
            if last[i] > at and kept[i]:
                sending_kept += out_bytes[i]
            overflow = False
            for p in preds[i]:
                if is_input[p]:
                    if p not in received:
                        received[p] = None
                        fixed += fed[p]
                        activation_bytes += out_bytes[p]
                        received_bytes += out_bytes[p]
                elif position[p] >= start:
                    if last[p] == at:
                        sending -= send_min[p]
                        if kept[p]:
                            sending_kept -= out_bytes[p]
                        if not to_output[p]:
                            sending_bytes -= out_bytes[p]
                            sending_new -= new_bytes[p]
                elif p not in received:
                    received[p] = None
                    sender = stage_of[p]
                    t = model.transfer(sender, s)[p]
                    fixed += t
                    activation_bytes += out_bytes[p]
                    received_bytes += out_bytes[p]
                    more = t if received_once[p] else t - model.send_min(sender)[p]
                    charges.append((sender, more, p))
                    extra[sender] += more
                    if load[sender] + extra[sender] > limit:
                        overflow = True
                        over[sender] = max(over.get(sender, 0.0),
                                           load[sender] + extra[sender] - limit)
            extra_s = 0.0 if unbounded else model.recompute_s(
                s, Held(param_bytes, activation_bytes, saved_bytes, received_bytes,
                        sending_bytes, sending_new, returned_bytes,
                        moved_bytes=sending_kept), forward_s,
                room[s] if room is not None else 0.0)
            if overflow or extra_s == math.inf or fixed + extra_s > limit:
                break
            if fixed + extra_s + sending <= limit - reserve[s] and (not final or at == n - 1):
                end = (at + 1, fixed + extra_s + sending, len(charges))
        if end is None:
            return None
        stop, load[s], num_charges = end
        for sender, more, p in charges[:num_charges]:
            load[sender] += more
            received_once[p] = 1
        for at in range(start, stop):
            stage_of[order[at]] = s
        start = stop
    return stage_of, max(load)
