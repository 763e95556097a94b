"""Pipeline schedules as pure timetables, and a simulator that predicts them.

A schedule says, for every stage, in which order it runs which micro-batch's forward (`F`) or
backward (`B`). It is plain data: the runtime executes it, `simulate` predicts its timing from the
cost model, `validate` proves it cannot deadlock, and tests read it literally. `message_orders`
lists, for each pair of ranks of `fxpipe.distributed`, the messages in the order one sends them
and in the order the other asks for them; `validate_messages` proves the two agree.
`str(Action(1, 3, Phase.FORWARD))` is `1F3`: stage 1, forward, micro-batch 3.

GPipe, 3 stages, 4 micro-batches, training (all forwards, then all backwards):

    stage 0: 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
    stage 1: 1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3
    stage 2: 2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3

1F1B, same sizes: stage s first runs `num_stages - 1 - s` forwards, then alternates one forward
and one backward, so it never holds more than `num_stages - s` micro-batches of activations:

    stage 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
    stage 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
    stage 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3

Dependencies are those of a DAG of stages: `F` of micro-batch m on stage s needs `F` of m on every
stage s reads from; `B` of m on s needs its own `F` of m and `B` of m on every stage reading from s.

The simulator is the predictor, fed by the cost model: CPU stages asking for more threads than
there are cores share them (processor sharing: actions that overlap run at their share of the
cores, not each at full speed), and so do stages standing on one GPU, as pools; the stages'
threads of one process hold its interpreter lock one at a time (`lock`). The runtime
executes a timetable, it does not decide one: the same actions feed the runtime,
`fxpipe.distributed` (`message_orders`: per pair of ranks, the order of sends against the order of
receives, equal unless a later stage reads both graph inputs and stage 0's values, which the
transport keeps aside) and the simulator. A new schedule is a pure timetable here
(`timetable_for`), validated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Literal, Mapping, NamedTuple, Sequence

from fxpipe.passes.errors import ScheduleError


class Phase(Enum):
    FORWARD = "F"
    BACKWARD = "B"


class Action(NamedTuple):
    stage: int
    microbatch: int
    phase: Phase

    def __str__(self) -> str:
        return f"{self.stage}{self.phase.value}{self.microbatch}"


Timetable = list[list[Action]]   # timetable[stage] is that stage's actions, in order
ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")


def gpipe(num_stages: int, chunks: int, *, backward: bool = False) -> Timetable:
    """Every stage runs all forwards in micro-batch order, then (if `backward`) all backwards."""
    return [[Action(s, m, Phase.FORWARD) for m in range(chunks)] +
            ([Action(s, m, Phase.BACKWARD) for m in range(chunks)] if backward else [])
            for s in range(num_stages)]


def one_f_one_b(num_stages: int, chunks: int) -> Timetable:
    """1F1B (PipeDream-Flush): warm-up forwards, then one forward one backward, then cool-down."""
    timetable = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, chunks)
        actions = [Action(s, m, Phase.FORWARD) for m in range(warmup)]
        for m in range(chunks - warmup):
            actions += [Action(s, warmup + m, Phase.FORWARD), Action(s, m, Phase.BACKWARD)]
        actions += [Action(s, m, Phase.BACKWARD) for m in range(chunks - warmup, chunks)]
        timetable.append(actions)
    return timetable


def async_warmup(stage: int, num_stages: int, max_staleness: int, window: int) -> int:
    """The forwards stage `stage` runs before its first backward in an asynchronous stream
    (`stream_train(mode="async")`), and so the items it holds at once: 1F1B's (the stages
    after it, plus one), but never more than `max_staleness * window + 1`, or a stage would wait
    for a forward the staleness bound holds back until the backward it has not run yet."""
    return max(1, min(num_stages - stage, max_staleness * window + 1))


def timetable_for(schedule: ScheduleName, num_stages: int, chunks: int, *,
                  backward: bool) -> Timetable:
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {schedule!r}\nuse one of {', '.join(SCHEDULES)}")
    if schedule == "1f1b" and backward:
        return one_f_one_b(num_stages, chunks)
    return gpipe(num_stages, chunks, backward=backward)


def format_timetable(timetable: Timetable, mark: Action | None = None) -> str:
    """One row per stage; `mark` is bracketed (e.g. the step a deadlock stops at)."""
    return "\n".join(f"stage {s}: " + " ".join(f"[{a}]" if a == mark else str(a) for a in actions)
                     for s, actions in enumerate(timetable))


# --- simulation -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """When one action runs in a simulated (or measured) run, in seconds from the start."""

    action: Action
    start_s: float
    end_s: float


def dependencies(action: Action, reads_from: Mapping[int, Sequence[int]],
                 read_by: Mapping[int, Sequence[int]]) -> list[Action]:
    """The actions `action` must wait for, given which stages each stage reads from."""
    s, m, phase = action
    if phase is Phase.FORWARD:
        return [Action(p, m, Phase.FORWARD) for p in reads_from.get(s, ())]
    return [Action(s, m, Phase.FORWARD)] + [Action(c, m, Phase.BACKWARD) for c in read_by.get(s, ())]


def simulate(timetable: Timetable, duration_s: Callable[[Action], float],
             reads_from: Mapping[int, Sequence[int]], *,
             message_s: Callable[[Action, Action], float] = lambda a, b: 0.0,
             cores: float | None = None, demand: Sequence[float] = (),
             pools: Sequence[tuple[float, Sequence[float]]] = (),
             lock: Callable[[Action], float] | None = None) -> list[Slot]:
    """Run the timetable on an ideal machine: each stage does its actions in order, each action
    starts when its stage is free and its dependencies have finished (plus `message_s` for a
    dependency on another stage). Raises if the timetable deadlocks, showing where.

    `duration_s` is an action's time with the cores it asks for. With `cores`, stage `s` asks
    for `demand[s]` of them (its intra-op threads; a GPU stage's launching thread): while the
    running actions ask for more than there are, they share them, each progressing at
    `cores / asked` of its speed (processor sharing, as the OS time-slices threads). `pools`
    are more resources shared alike, each a capacity and every stage's demand on it (a GPU that
    several stages run on: capacity 1, demand 1 each); an action progresses at the smallest of
    its pools' shares.

    `lock(action)` is the share of an action's time spent holding a lock that one action holds
    at a time (the interpreter lock of the process the stages' threads share: `HostCosts`). An
    action holding a share `f` of its time, beside others holding shares adding up to `g`,
    progresses at 1 / `lock_slowdown(f, g)` of its speed: each time it takes the lock it waits
    for another's hold a share `g` of the time, and the lock is never held twice (where the
    cores are the tighter share, that one).
    """
    read_by: dict[int, list[int]] = {}
    for s, sources in reads_from.items():
        for p in sources:
            read_by.setdefault(p, []).append(s)
    pools = [*([(cores, demand)] if cores is not None else []), *pools]
    if any(sum(asks) > capacity for capacity, asks in pools) or (
            lock is not None and len(timetable) > 1):
        return _shared(timetable, duration_s, reads_from, read_by, message_s, pools,
                       lock or (lambda action: 0.0))
    done: dict[Action, float] = {}
    position = [0] * len(timetable)
    free_at = [0.0] * len(timetable)
    slots: list[Slot] = []
    remaining = sum(map(len, timetable))
    while remaining:
        progressed = False
        for s, actions in enumerate(timetable):
            while position[s] < len(actions):
                action = actions[position[s]]
                deps = dependencies(action, reads_from, read_by)
                if any(d not in done for d in deps):
                    break
                ready = max([free_at[s]] + [done[d] + (message_s(d, action) if d.stage != s else 0.0)
                                           for d in deps])
                end = ready + duration_s(action)
                slots.append(Slot(action, ready, end))
                done[action] = free_at[s] = end
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = next(a[position[s]] for s, a in enumerate(timetable) if position[s] < len(a))
            raise ScheduleError(f"the timetable deadlocks (first blocked: {stuck})\n"
                                f"no stage can run its next action\n"
                                f"{format_timetable(timetable, stuck)}")
    return sorted(slots, key=lambda slot: (slot.start_s, slot.action.stage))


def _shared(timetable: Timetable, duration_s: Callable[[Action], float],
            reads_from: Mapping[int, Sequence[int]], read_by: Mapping[int, Sequence[int]],
            message_s: Callable[[Action, Action], float],
            pools: Sequence[tuple[float, Sequence[float]]],
            lock: Callable[[Action], float]) -> list[Slot]:
    """`simulate` on resources the stages share: events are an action's start and its end, and
    between two events every running action progresses at its smallest share of the pools it
    asks of and of the lock."""
    done: dict[Action, float] = {}
    position = [0] * len(timetable)
    running: dict[int, list] = {}   # stage -> [action, start_s, work left in s, lock share]
    slots: list[Slot] = []
    now = 0.0
    while True:
        waits = []          # when the next action of an idle stage may start
        for s, actions in enumerate(timetable):
            if s in running or position[s] == len(actions):
                continue
            action = actions[position[s]]
            deps = dependencies(action, reads_from, read_by)
            if any(d not in done for d in deps):
                continue
            ready = max([now] + [done[d] + (message_s(d, action) if d.stage != s else 0.0)
                                 for d in deps])
            if ready <= now:
                running[s] = [action, now, duration_s(action), lock(action)]
                position[s] += 1
            else:
                waits.append(ready)
        if not running:
            if waits:
                now = min(waits)
                continue
            if any(p < len(a) for p, a in zip(position, timetable)):
                stuck = next(a[position[s]] for s, a in enumerate(timetable)
                             if position[s] < len(a))
                raise ScheduleError(f"the timetable deadlocks (first blocked: {stuck})\n"
                                    f"no stage can run its next action\n"
                                    f"{format_timetable(timetable, stuck)}")
            return sorted(slots, key=lambda slot: (slot.start_s, slot.action.stage))
        shares = [min(1.0, capacity / max(sum(asks[s] for s in running), 1e-30))
                  for capacity, asks in pools]
        held = sum(r[3] for r in running.values())
        rate = {s: min([share for share, (_, asks) in zip(shares, pools) if asks[s] > 0] +
                       [1.0 / lock_slowdown(running[s][3], held - running[s][3])],
                       default=1.0) for s in running}
        step = min([r[2] / rate[s] for s, r in running.items()] + [w - now for w in waits])
        now += step
        for s in list(running):
            action, start, left, _ = running[s]
            left -= step * rate[s]
            if left <= 1e-12 * max(1.0, now):
                slots.append(Slot(action, start, now))
                done[action] = now
                del running[s]
            else:
                running[s][2] = left


def lock_slowdown(share: float, others: float) -> float:
    """How many times as long an action holding a lock a `share` of its time takes beside
    actions holding it shares adding up to `others` (`simulate`): each of its holds waits for
    theirs a share `others` of the time (1 + `share` x `others`), and where all the shares add
    up to more than 1, the lock runs them one at a time (their sum). 1 for an action holding
    none. Two actions holding it throughout take twice as long, as one lock held in turn
    does."""
    if share <= 0:
        return 1.0
    return max(1.0, 1.0 + share * others, share + others)


def validate(timetable: Timetable, chunks: int, reads_from: Mapping[int, Sequence[int]], *,
             backward: bool) -> None:
    """Raise unless every stage runs each micro-batch's forward (and backward) exactly once,
    each stage's own forward before its backward, and the whole timetable can run to the end."""
    phases = [Phase.FORWARD, Phase.BACKWARD] if backward else [Phase.FORWARD]
    for s, actions in enumerate(timetable):
        expected = sorted((m, p.value) for m in range(chunks) for p in phases)
        got = sorted((a.microbatch, a.phase.value) for a in actions)
        if got != expected or any(a.stage != s for a in actions):
            raise ScheduleError(f"stage {s} must run each of {chunks} micro-batches once, on "
                                f"itself\n({'forward and backward' if backward else 'forward'})"
                                f":\n{format_timetable(timetable)}")
    simulate(timetable, lambda a: 1.0, reads_from)


# --- messages between ranks ------------------------------------------------------------------------

INPUTS = -1     # the sender of graph inputs in `message_orders`' reads (the runtime's DRIVER)

Message = tuple[Phase, int, int, int]    # (phase, sender, receiver, micro-batch)


def message_orders(timetable: Timetable, reads_from: Mapping[int, Sequence[int]], *,
                   backward: bool, input_grads: bool = True
                   ) -> dict[tuple[int, int], tuple[list[Message], list[Message]]]:
    """For each pair of ranks (sender, receiver), the messages the sender sends the receiver in
    the order it sends them, and in the order the receiver asks for them, when every stage `s`
    runs on rank `s` and walks its row as `fxpipe.distributed` does.

    `reads_from[s]`: the participants stage `s` reads from, in the order it receives them
    (`INPUTS` for the graph inputs, sent by stage 0's rank). Stage 0's rank first sends every
    micro-batch's inputs; then a forward of m asks each sender for its values and sends each
    reader its own; a backward asks each reader for its gradients and sends each stage it read
    from theirs. With `backward` and `input_grads`, a stage reading graph inputs on another
    rank sends their gradients back to stage 0's rank after its row, which asks for them after
    its own. Messages within a rank are left out: they never travel. (Replicas are copies of
    these ranks at an offset, each with the same pairs.)
    """
    read_by: dict[int, list[int]] = {}
    for s, sources in reads_from.items():
        for p in sources:
            read_by.setdefault(p, []).append(s)
    sent: dict[int, list[Message]] = {}       # by rank, in order
    asked: dict[int, list[Message]] = {}

    def rank(participant: int) -> int:
        return 0 if participant == INPUTS else participant

    def send(message: Message) -> None:
        sent.setdefault(rank(message[1]), []).append(message)

    def ask(message: Message) -> None:
        asked.setdefault(rank(message[2]), []).append(message)

    chunks = max((a.microbatch + 1 for actions in timetable for a in actions), default=0)
    for m in range(chunks):
        for reader in read_by.get(INPUTS, []):
            send((Phase.FORWARD, INPUTS, reader, m))
    for s, actions in enumerate(timetable):
        for _, m, phase in actions:
            if phase is Phase.FORWARD:
                for p in reads_from.get(s, []):
                    ask((Phase.FORWARD, p, s, m))
                for reader in read_by.get(s, []):
                    send((Phase.FORWARD, s, reader, m))
            else:
                for reader in read_by.get(s, []):
                    ask((Phase.BACKWARD, reader, s, m))
                for p in reads_from.get(s, []):
                    if p != INPUTS:
                        send((Phase.BACKWARD, s, p, m))
        if backward and input_grads and s != 0 and INPUTS in reads_from.get(s, []):
            for m in sorted(a.microbatch for a in actions if a.phase is Phase.FORWARD):
                send((Phase.BACKWARD, s, INPUTS, m))
    if backward and input_grads:
        for reader in read_by.get(INPUTS, []):
            if reader != 0:
                for m in range(chunks):
                    ask((Phase.BACKWARD, reader, INPUTS, m))
    pairs: dict[tuple[int, int], tuple[list[Message], list[Message]]] = {}
    for messages, side in ((sent, 0), (asked, 1)):
        for messages_of_rank in messages.values():
            for message in messages_of_rank:
                pair = (rank(message[1]), rank(message[2]))
                if pair[0] != pair[1]:
                    pairs.setdefault(pair, ([], []))[side].append(message)
    return pairs


def validate_messages(timetable: Timetable, reads_from: Mapping[int, Sequence[int]], *,
                      backward: bool, input_grads: bool = True) -> None:
    """Raise unless, for every pair of ranks, the receiver asks for the sender's messages in
    the order they are sent (`message_orders`), so that it never has to keep one aside.

    The distributed transport keeps a message asked for later rather than deadlock, so this is
    a stronger property than it needs. It holds for GPipe and 1F1B on any stage graph unless a
    later stage reads both the graph inputs and stage 0's values: stage 0's rank sends every
    micro-batch's inputs first, so that stage keeps them aside until asked (with one
    micro-batch, only when it asks for stage 0's values before the inputs).
    """
    for (p, q), (sent, asked) in sorted(message_orders(
            timetable, reads_from, backward=backward, input_grads=input_grads).items()):
        if sent == asked:
            continue
        if sorted(sent, key=str) != sorted(asked, key=str):
            raise ScheduleError(f"rank {p} sends rank {q} other messages than it asks "
                                f"for:\n  sent:  {_messages(sent)}\n  asked: {_messages(asked)}")
        i = next(i for i, (a, b) in enumerate(zip(sent, asked)) if a != b)
        raise ScheduleError(
            f"rank {q} asks rank {p} for {_message(asked[i])} out of order\n"
            f"rank {p} sends {_message(sent[i])} there (message {i}), which rank {q} must keep "
            f"aside:\n"
            f"  sent:  {_messages(sent, i)}\n  asked: {_messages(asked, i)}\n"
            f"{format_timetable(timetable)}")


def _message(message: Message) -> str:
    phase, sender, receiver, m = message
    name = {INPUTS: "in"}
    return f"{name.get(sender, sender)}{phase.value}{m}>{name.get(receiver, receiver)}"


def _messages(messages: list[Message], mark: int | None = None) -> str:
    return " ".join(f"[{_message(x)}]" if i == mark else _message(x)
                    for i, x in enumerate(messages))
