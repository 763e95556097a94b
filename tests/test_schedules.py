import pytest
from hypothesis import given, strategies as st

from fxpipe.runtime.schedules import (INPUTS, Action, Phase, format_timetable, gpipe, message_orders,
                              one_f_one_b, simulate, timetable_for, validate, validate_messages)
from fxpipe.passes.errors import FxpipeError


def chain(k):
    return {s: [s - 1] for s in range(1, k)}


def test_gpipe_runs_all_forwards_then_all_backwards():
    assert format_timetable(gpipe(2, 3, backward=True)) == (
        "stage 0: 0F0 0F1 0F2 0B0 0B1 0B2\n"
        "stage 1: 1F0 1F1 1F2 1B0 1B1 1B2")


def test_1f1b_warms_up_then_alternates():
    assert format_timetable(one_f_one_b(3, 4)) == (
        "stage 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
        "stage 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
        "stage 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3")


def test_1f1b_with_fewer_micro_batches_than_stages():
    assert format_timetable(one_f_one_b(3, 1)) == (
        "stage 0: 0F0 0B0\nstage 1: 1F0 1B0\nstage 2: 2F0 2B0")


def test_action_prints_short():
    assert str(Action(1, 3, Phase.BACKWARD)) == "1B3"


def in_flight(actions):
    """The most micro-batches a stage holds activations for at once."""
    held = peak = 0
    for a in actions:
        held += 1 if a.phase is Phase.FORWARD else -1
        peak = max(peak, held)
    return peak


@st.composite
def stage_dags(draw):
    """Stage graphs: each stage reads from some earlier stages (a DAG, with skips)."""
    k = draw(st.integers(1, 6))
    reads = {}
    for s in range(1, k):
        sources = draw(st.sets(st.integers(0, s - 1), max_size=s))
        reads[s] = sorted(sources | {s - 1})       # every stage reads its predecessor
    return k, reads


@given(stage_dags(), st.integers(1, 9))
def test_every_schedule_is_valid_on_any_stage_dag(dag, chunks):
    k, reads = dag
    validate(gpipe(k, chunks), chunks, reads, backward=False)
    validate(gpipe(k, chunks, backward=True), chunks, reads, backward=True)
    timetable = one_f_one_b(k, chunks)
    validate(timetable, chunks, reads, backward=True)
    assert all(in_flight(a) <= min(k - s, chunks) for s, a in enumerate(timetable))
    assert max(in_flight(a) for a in gpipe(k, chunks, backward=True)) == chunks


def test_a_deadlocking_timetable_is_shown_with_the_blocked_step():
    bad = [[Action(0, 0, Phase.BACKWARD), Action(0, 0, Phase.FORWARD)]]
    with pytest.raises(FxpipeError, match=r"deadlocks[\s\S]*\[0B0\]"):
        validate(bad, 1, {}, backward=True)


def test_a_timetable_missing_an_action_is_refused():
    with pytest.raises(FxpipeError, match="stage 1 must run"):
        validate([[Action(0, 0, Phase.FORWARD)], []], 1, chain(2), backward=False)


@given(st.integers(1, 6), st.integers(1, 12))
def test_gpipe_on_equal_stages_takes_the_textbook_time(k, m):
    slots = simulate(gpipe(k, m), lambda a: 1.0, chain(k))
    assert max(s.end_s for s in slots) == m + k - 1


def test_simulation_adds_message_time_between_stages():
    slots = simulate(gpipe(2, 1), lambda a: 1.0, chain(2), message_s=lambda a, b: 0.5)
    assert [(str(s.action), s.start_s, s.end_s) for s in slots] == [
        ("0F0", 0.0, 1.0), ("1F0", 1.5, 2.5)]


def test_stages_asking_for_more_cores_than_there_are_share_them():
    # Two independent stages of 1 s each on one core: each runs at half speed, both end at 2 s.
    slots = simulate(gpipe(2, 1), lambda a: 1.0, {0: [], 1: []}, cores=1, demand=[1, 1])
    assert [(str(s.action), s.start_s, s.end_s) for s in slots] == [
        ("0F0", 0.0, 2.0), ("1F0", 0.0, 2.0)]
    # A stage off the CPU (demand 0) takes no share.
    slots = simulate(gpipe(2, 1), lambda a: 1.0, {0: [], 1: []}, cores=1, demand=[1, 0])
    assert max(s.end_s for s in slots) == 1.0
    # A chain never runs two actions at once on one micro-batch: nothing to share.
    assert max(s.end_s for s in simulate(gpipe(2, 1), lambda a: 1.0, chain(2), cores=1,
                                         demand=[1, 1])) == 2.0


def test_stages_on_one_gpu_share_it_while_the_cores_have_room():
    # Two stages of 1 s per micro-batch on one GPU, 4 micro-batches through a chain: alone they
    # would overlap (5 s); sharing the GPU, its 8 s of work end at 8 s. On two GPUs, 5 s.
    one_gpu, two_gpus = [(1.0, [1, 1])], [(1.0, [1, 0]), (1.0, [0, 1])]
    assert max(s.end_s for s in simulate(gpipe(2, 4), lambda a: 1.0, chain(2))) == 5.0
    assert max(s.end_s for s in simulate(gpipe(2, 4), lambda a: 1.0, chain(2), cores=8,
                                         demand=[1, 1], pools=one_gpu)) == pytest.approx(8.0)
    assert max(s.end_s for s in simulate(gpipe(2, 4), lambda a: 1.0, chain(2), cores=8,
                                         demand=[1, 1], pools=two_gpus)) == 5.0


@given(st.integers(1, 5), st.integers(1, 8), st.sampled_from(["gpipe", "1f1b"]),
       st.lists(st.integers(1, 9), min_size=5, max_size=5), st.integers(1, 6))
def test_shared_cores_slow_a_timetable_at_most_to_running_it_on_one_core(k, m, schedule,
                                                                          tenths, cores):
    timetable = timetable_for(schedule, k, m, backward=True)
    duration = lambda a: tenths[a.stage] / 10 * (2 if a.phase is Phase.BACKWARD else 1)
    alone = max(s.end_s for s in simulate(timetable, duration, chain(k)))
    shared = simulate(timetable, duration, chain(k), cores=cores, demand=[1] * k)
    end = max(s.end_s for s in shared)
    assert alone * (1 - 1e-9) <= end <= sum(map(duration, sum(timetable, []))) * (1 + 1e-9)
    if cores >= k:
        assert end == pytest.approx(alone)
    validate(timetable, m, chain(k), backward=True)
    assert sorted(map(str, (s.action for s in shared))) == sorted(map(str, sum(timetable, [])))


@st.composite
def stage_dags_with_inputs(draw):
    """A stage DAG (`stage_dags`) whose stages read the graph inputs too: stage 0 and some
    others, each at a drawn place among its sources."""
    k, reads = draw(stage_dags())
    reads_from = {0: [INPUTS], **{s: list(sources) for s, sources in reads.items()}}
    for s in draw(st.sets(st.integers(1, k - 1), max_size=k - 1)) if k > 1 else ():
        reads_from[s].insert(draw(st.integers(0, len(reads_from[s]))), INPUTS)
    return k, reads_from


@given(stage_dags_with_inputs(), st.integers(1, 6), st.booleans())
def test_ranks_ask_for_messages_in_the_order_they_are_sent_unless_inputs_run_ahead(
        dag, chunks, input_grads):
    """For GPipe (a call and a step) and 1F1B, every pair of ranks agrees on the order of its
    messages, except where a later stage reads both the graph inputs and stage 0's values (the
    inputs are sent first: with one micro-batch, out of order only if asked for second)."""
    k, reads_from = dag

    def runs_ahead(reads):
        return INPUTS in reads and 0 in reads and (chunks > 1 or
                                                   reads.index(0) < reads.index(INPUTS))
    ahead = any(runs_ahead(reads_from[s]) for s in range(1, k))
    for timetable, backward in ((gpipe(k, chunks), False), (gpipe(k, chunks, backward=True), True),
                                (one_f_one_b(k, chunks), True)):
        if ahead:
            with pytest.raises(FxpipeError, match=r"asks rank 0 for .* out of order\n.* must keep aside"):
                validate_messages(timetable, reads_from, backward=backward,
                                  input_grads=input_grads)
        else:
            validate_messages(timetable, reads_from, backward=backward, input_grads=input_grads)


def test_message_orders_lists_each_pair_of_ranks_literally():
    """2 stages, 1F1B, 2 micro-batches, stage 1 reading stage 0 and the inputs: rank 0 sends
    the inputs first; stage 1's gradients go back, then the inputs' gradients."""
    orders = message_orders(one_f_one_b(2, 2), {0: [INPUTS], 1: [0, INPUTS]}, backward=True)
    F, B = Phase.FORWARD, Phase.BACKWARD
    assert orders == {
        (0, 1): ([(F, INPUTS, 1, 0), (F, INPUTS, 1, 1), (F, 0, 1, 0), (F, 0, 1, 1)],
                 [(F, 0, 1, 0), (F, INPUTS, 1, 0), (F, 0, 1, 1), (F, INPUTS, 1, 1)]),
        (1, 0): ([(B, 1, 0, 0), (B, 1, 0, 1), (B, 1, INPUTS, 0), (B, 1, INPUTS, 1)],
                 [(B, 1, 0, 0), (B, 1, 0, 1), (B, 1, INPUTS, 0), (B, 1, INPUTS, 1)])}


def test_a_stage_taking_micro_batches_out_of_order_is_shown_where_the_orders_part():
    timetable = one_f_one_b(2, 2)
    timetable[1] = [Action(1, 1, Phase.FORWARD), Action(1, 1, Phase.BACKWARD),
                    Action(1, 0, Phase.FORWARD), Action(1, 0, Phase.BACKWARD)]
    with pytest.raises(FxpipeError, match=r"rank 1 asks rank 0 for 0F1>1 out of order\nrank 0 sends "
                                          r"0F0>1 there \(message 0\)(.|\n)*asked: \[0F1>1\] 0F0>1"):
        validate_messages(timetable, {0: [INPUTS], 1: [0]}, backward=True)
