"""The memory plan of a captured forward (erase_fx.emit.memory_plan), on hand-made programs.

The program is test_release's chain: main step 0 makes slot 2 (a block's
activations), side step 1 reads it (the block's early backward) and makes a
loss (slot 3); main step 2 reads slot 2 and makes slot 4, read by side step 3
and main step 4; main step 5 sums the losses after waiting for both blocks.
"""
import itertools
import random

import pytest
import torch

from erase_fx.emit.memory_plan import (
    SlotMemory, happens_before, plan_memory, slot_memory,
)
from erase_fx.emit.release import CapturePlan, StepIO, plan_captured_releases

MAIN, SIDE1, SIDE2 = 0, 1, 2
SIZES = {2: 100, 3: 1, 4: 200, 5: 50, 6: 1, 7: 1}


def chain_steps():
    return [
        StepIO(MAIN, (0,), (2,)),
        StepIO(SIDE1, (2, 1), (3,), waits=(0,)),
        StepIO(MAIN, (2,), (4,)),
        StepIO(SIDE2, (4, 1), (7,), waits=(2,)),
        StepIO(MAIN, (4,), (5,)),
        StepIO(MAIN, (5, 3, 7), (6,), waits=(1, 3)),
    ]


def sized(sizes, num_slots, external=(0, 1), shared=()):
    """A SlotMemory: each slot its own storage, but the groups in ``shared``."""
    storage = list(range(num_slots))
    for group in shared:
        for slot in group:
            storage[slot] = group[0]
    return SlotMemory(tuple(sizes.get(s, 0) for s in range(num_slots)), tuple(storage),
                      frozenset(storage[s] for s in external))


def chain_plan(lag=None, width=None, capture=None):
    steps = chain_steps()
    capture = capture or plan_captured_releases(steps, 2, {6}, lag)
    return plan_memory(steps, sized(SIZES, 8), {6}, capture, width)


def test_the_order_is_stream_order_and_event_waits_closed_transitively():
    order = happens_before([s.stream for s in chain_steps()], [s.waits for s in chain_steps()])
    assert order.precedes(0, 2) and order.precedes(2, 4)  # the main stream's own order
    assert order.precedes(0, 1) and not order.precedes(1, 2)  # side 1 waits for main 0 only
    assert order.precedes(0, 3)  # through main step 2, which side 2 waits for
    assert not order.precedes(1, 4) and not order.precedes(3, 4)
    assert all(order.precedes(k, 5) for k in range(5))  # the sum waits for both blocks
    assert order.first_on(MAIN, 3) == 4 and order.first_on(SIDE1, 2) is None


def test_a_wait_for_a_step_not_launched_before_is_refused():
    with pytest.raises(ValueError, match="step 0 waits for step 1"):
        happens_before([MAIN, SIDE1], [(1,), ()])


def test_each_buffer_knows_its_producer_and_its_uses():
    plan = chain_plan()
    by_slot = {b.slots: b for b in plan.buffers}
    assert set(by_slot) == {(2,), (3,), (4,), (5,), (6,), (7,)}  # inputs are the caller's
    activations = by_slot[(2,)]
    assert (activations.producer, activations.stream, activations.uses) == (0, MAIN, (1, 2))
    assert (by_slot[(4,)].producer, by_slot[(4,)].uses) == (2, (3, 4))
    assert by_slot[(6,)].kept and not activations.kept


def test_today_without_a_lag_holds_what_crosses_streams_to_the_join():
    plan = chain_plan()
    n = 6
    released = dict(zip((b.slots[0] for b in plan.buffers), plan.released_today))
    assert released == {2: n, 3: n, 4: n, 5: n, 6: n, 7: n}  # 5's reader is the last step
    assert plan.today.by_stream == {MAIN: 351, SIDE1: 1, SIDE2: 1}  # 2, 4, 5, 6 at step 5
    assert plan.today.total == 353
    assert plan.races == ()


def test_a_release_lag_frees_the_activations_before_the_main_step_that_waits():
    plan = chain_plan(lag=2)
    released = dict(zip((b.slots[0] for b in plan.buffers), plan.released_today))
    assert released[2] == 4 and released[4] == 5
    assert plan.captured.precedes(1, 4) and not plan.order.precedes(1, 4)  # the lag's wait
    assert plan.today.by_stream[MAIN] == 300  # 2 and 4 at step 2
    assert plan.races == ()


def test_with_record_stream_a_value_is_reused_where_its_readers_are_ordered_before():
    plan = chain_plan()
    reused = dict(zip((b.slots[0] for b in plan.buffers), plan.reused_record_stream))
    assert reused[2] == 5 and reused[4] == 5  # step 5 waits for both side streams
    assert reused[3] == 6  # side 1 runs nothing after its block: after the join
    assert plan.record_stream.by_stream[MAIN] == 350  # 2, 4 and 5 at step 4


def test_the_one_pool_peak_is_the_heaviest_set_of_buffers_whose_lifetimes_overlap():
    plan = chain_plan()
    peak = {plan.buffers[i].slots[0] for i in plan.peak_set}
    assert peak == {2, 3, 4, 5, 7}  # the kept sum (6) comes after 2 and 4 are done
    assert plan.one_pool.total == 352
    assert plan.one_pool.by_stream == {MAIN: 350, SIDE1: 1, SIDE2: 1}


def test_a_release_before_a_reader_on_another_stream_is_ordered_is_a_race():
    steps = chain_steps()
    good = plan_captured_releases(steps, 2, {6}, 2)
    # slot 2 released before main step 4 without the wait for side step 1
    no_wait = CapturePlan(good.drops_after, good.records_event,
                          tuple(() for _ in steps), good.releases_before)
    races = chain_plan(capture=no_wait).races
    # slot 4, released before step 5: the sum waits for side step 3 anyway
    assert {(r.slots, r.use, r.reuse) for r in races} == {((2,), 1, 4)}
    assert "step 4 may reuse the memory before step 1 is done with it" in str(races[0])
    # dropped right after it is made: its readers are launched after the release
    held = plan_captured_releases(steps, 2, {6}, None)
    early = CapturePlan(((2,),) + held.drops_after[1:], held.records_event, held.waits_before,
                        held.releases_before)
    assert {(r.use, r.reuse) for r in chain_plan(capture=early).races
            if r.slots == (2,)} == {(1, 2), (2, 2)}


def test_folding_the_side_streams_orders_their_steps_and_shares_their_pool():
    plan = chain_plan(width=1)
    assert plan.order.streams == (0, 1, 0, 1, 0, 0)
    assert plan.order.precedes(1, 3)  # one CUDA stream now
    assert set(plan.today.by_stream) == {MAIN, 1}
    assert plan.races == ()


def test_a_view_of_an_earlier_steps_value_is_held_to_the_join_as_the_captured_run_pins_it():
    """Step 2 returns slot 4 as a view of slot 2 (say, a reshape): one buffer, made by step 0,
    used by steps 1 to 4; the captured run pins the view, so it is released at the join."""
    steps = chain_steps()
    memory = sized(SIZES, 8, shared=((2, 4),))
    plan = plan_memory(steps, memory, {6}, plan_captured_releases(steps, 2, {6}, 2))
    shared = next(b for b in plan.buffers if b.slots == (2, 4))
    assert shared.producer == 0 and shared.uses == (1, 2, 3, 4)
    assert plan.released_today[plan.buffers.index(shared)] == len(steps)


def test_slot_memory_groups_views_and_leaves_out_the_inputs_storage():
    weight, x = torch.randn(4, 3), torch.randn(2, 4)
    h = x @ weight
    values = [weight, x, weight.t(), h, h.view(-1), h.sum(), 3]
    memory = slot_memory(values, external_slots=(0, 1))
    assert memory.storage[2] == memory.storage[0] and not memory.owned(2)
    assert memory.storage[4] == memory.storage[3] and memory.owned(3)
    assert memory.nbytes[4] == h.numel() * 4 and memory.nbytes[5] == 4
    assert memory.storage[6] == -1 and not memory.owned(6)


# -- random programs: the plan against brute force, today's rule against the race check ------

def random_program(seed, num_steps=9, streams=3):
    """Steps on random streams reading random earlier slots; a step waits for the latest
    producer on every other stream it reads from (as `StreamProgram.build` makes it)."""
    rng = random.Random(seed)
    steps, made_on, sizes = [], {0: MAIN}, {}
    producer = {}
    for k in range(num_steps):
        stream = MAIN if k == num_steps - 1 else rng.randrange(streams)
        reads = tuple(sorted(rng.sample(sorted(made_on), min(len(made_on), rng.randint(1, 3)))))
        latest = {}
        for slot in reads:
            if slot in producer and made_on[slot] != stream:
                latest[made_on[slot]] = max(latest.get(made_on[slot], -1), producer[slot])
        outputs = tuple(range(len(made_on), len(made_on) + rng.randint(1, 2)))
        for slot in outputs:
            made_on[slot], producer[slot], sizes[slot] = stream, k, rng.randint(1, 100)
        steps.append(StepIO(stream, reads, outputs, tuple(sorted(latest.values()))))
    kept = {s for s in producer if rng.random() < 0.2}
    return steps, sized(sizes, len(made_on), external=(0,)), kept


def _overlap(a, b, order):
    return not (a.done_before(b.producer, order) and not a.kept) and not (
        b.done_before(a.producer, order) and not b.kept)


@pytest.mark.parametrize("seed", range(12))
def test_the_one_pool_peak_is_the_heaviest_antichain_found_by_brute_force(seed):
    steps, memory, kept = random_program(seed)
    plan = plan_memory(steps, memory, kept, plan_captured_releases(steps, 1, kept, None))
    buffers, order = plan.buffers, plan.order
    assert all(_overlap(buffers[i], buffers[j], order)
               for i, j in itertools.combinations(plan.peak_set, 2))
    best = 0
    for r in range(1, len(buffers) + 1):
        for subset in itertools.combinations(range(len(buffers)), r):
            if all(_overlap(buffers[i], buffers[j], order)
                   for i, j in itertools.combinations(subset, 2)):
                best = max(best, sum(buffers[i].nbytes for i in subset))
    assert plan.one_pool.total == best


@pytest.mark.parametrize("seed", range(30))
def test_todays_rule_never_races_and_the_plan_needs_no_more_than_it(seed):
    """Any lag, any folding: every release of `plan_captured_releases` is ordered after every
    use. Without a lag (no wait of its own) the one pool needs at most what the
    record_stream rule needs, which needs at most what today's pools need."""
    steps, memory, kept = random_program(seed, num_steps=12)
    for lag, width in itertools.product((None, 1, 2), (None, 1, 2)):
        plan = plan_memory(steps, memory, kept, plan_captured_releases(steps, 1, kept, lag), width)
        assert plan.races == (), (lag, width, [str(r) for r in plan.races])
        if lag is None:
            assert all(m <= t for m, t in zip(plan.reused_record_stream, plan.reused_today))
            assert plan.one_pool.total <= plan.record_stream.total <= plan.today.total


# -- what a segment holds inside ---------------------------------------------------------------

def test_a_segments_temporaries_are_its_values_alive_at_once_but_its_inputs_and_outputs():
    from torch.fx.experimental.proxy_tensor import make_fx

    from erase_fx.emit.memory_plan import segment_temporaries

    def segment(x):
        a = x * 2
        b = a + 1  # a and b alive together: the peak
        c = b.view(-1)  # a view: no memory of its own
        mean, var = torch.var_mean(c.view(4, 25), dim=0)  # two new values at once
        return mean + var, x.view(-1)

    gm = make_fx(segment, tracing_mode="fake")(torch.randn(10, 10))
    assert segment_temporaries(gm) == 2 * 100 * 4


def test_a_steps_temporaries_are_held_on_its_stream_while_it_runs():
    steps = chain_steps()
    capture = plan_captured_releases(steps, 2, {6}, None)
    values = plan_memory(steps, sized(SIZES, 8), {6}, capture)
    plan = plan_memory(steps, sized(SIZES, 8), {6}, capture,
                       temporaries=[10, 1000, 0, 0, 0, 0])
    inside = [b for b in plan.buffers if b.slots == ()]
    assert [(b.producer, b.stream, b.nbytes) for b in inside] == [(0, MAIN, 10), (1, SIDE1, 1000)]
    assert plan.today.by_stream[SIDE1] == 1001  # its loss and its temporaries
    assert plan.today.by_stream[MAIN] == values.today.by_stream[MAIN]  # freed after step 0
    # side 1's temporaries overlap the activations, slot 4 and the other losses
    assert plan.one_pool.total == values.one_pool.total + 1000
    assert plan.races == ()
