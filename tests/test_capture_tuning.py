"""`erase_fx.capture_tuning`: ``release_lag`` and ``side_cuda_streams`` chosen by timed
captures, and the plumbing.

The pure rules (`candidates_for`, `choose`, `next_candidate`) and the
tuner's sequence are checked directly; the programs' side (an ``"auto"``
program says what it can tune, and plans its captured frees and folds its
streams as the step's scope sets them) on CPU through the captured path and
virtual streams; `compile_step`'s side with the fake CUDA of ``fake_cuda.py``,
timings and pool sizes given per choice by the test. The GPU runs it for
real in ``bench/check_step.py`` (``--checks release-lag``).
"""
from __future__ import annotations

import logging
import weakref

import pytest
import torch

from erase_fx import capture_tuning, compile_step
from erase_fx.step import tuning as step_tuning
from erase_fx.capture_tuning import (
    KEEP,
    STOCK_CHOICE,
    CaptureMeasurement,
    CaptureTuner,
    candidates_for,
    choose,
    erase_over_stock,
    next_candidate,
)
from erase_fx.config import EraseConfig, Tuning
from erase_fx.emit import capture_scope
from erase_fx.emit import program as program_module
from erase_fx.emit.capture_scope import CaptureChoice, StepScope, Tunables
from fake_cuda import fake_cuda  # noqa: F401 - a fixture
from graphs import Chain as GraphChain
from graphs import Stages, chain_inputs, real_values
from test_program import build
from test_step import erase_training, two_model_step

MiB = 2**20


C = CaptureChoice
T = Tunables
#: what a program with release_lag="auto" alone asks for: the lags, one CUDA stream each
LAGS_ONLY = candidates_for([T(release_lag=True)])


def m(lag, ms, mib, width=None):
    return CaptureMeasurement(C(lag, width), ms, ms, ms, mib * MiB)


def stock(ms, mib):
    """The stock program's measurement (``Tuning.stock_candidate``)."""
    return CaptureMeasurement(STOCK_CHOICE, ms, ms, ms, mib * MiB)


def key(choice):
    """How the tests' tables name a choice: its lag, or (lag, width) when folded; "stock"."""
    if choice.stock:
        return "stock"
    return choice.lag if choice.width is None else (choice.lag, choice.width)


# -- the rules ------------------------------------------------------------------


def test_candidates_are_what_the_programs_asked_for_the_default_first():
    assert LAGS_ONLY == (C(None), C(2), C(1))
    assert candidates_for([]) == candidates_for([T(), T(side_streams=1)]) == (C(),)
    assert candidates_for([T(side_streams=4)]) == (C(None), C(None, 2))
    assert candidates_for([T(side_streams=2)]) == (C(),)  # nothing to fold
    assert candidates_for([T(release_lag=True), T(side_streams=3)]) == (
        C(None), C(2), C(1), C(None, 2), C(2, 2), C(1, 2))


def test_choose_takes_the_least_memory_among_the_fast():
    assert choose([m(None, 10.0, 500), m(2, 10.1, 300), m(1, 11.0, 200)]) == C(2)
    assert choose([m(None, 10.0, 500), m(2, 10.5, 300)]) == C(None)  # 5% slower: too slow
    assert choose([m(None, 10.1, 500), m(2, 10.0, 500)]) == C(None)  # a tie: the first
    assert choose([m(None, 10.0, 500), m(2, 10.5, 300)], tolerance=0.1) == C(2)
    assert choose([m(None, 10.0, 500), m(None, 10.1, 300, width=2)]) == C(None, 2)
    with pytest.raises(ValueError):
        choose([])


def test_next_candidate_skips_what_waits_no_less_than_a_slow_one():
    assert next_candidate([], LAGS_ONLY) == C(None)
    assert next_candidate([m(None, 10.0, 500)], LAGS_ONLY) == C(2)
    assert next_candidate([m(None, 10.0, 500), m(2, 10.1, 400)], LAGS_ONLY) == C(1)
    # 2 was too slow: 1 waits sooner still, so it is not tried
    assert next_candidate([m(None, 10.0, 500), m(2, 12.0, 400)], LAGS_ONLY) is None
    # a slow 1 says nothing of 2
    assert next_candidate([m(None, 10.0, 500), m(1, 12.0, 400)], (C(None), C(1), C(2))) == C(2)
    assert next_candidate([m(None, 1, 1), m(2, 1, 1), m(1, 1, 1)], LAGS_ONLY) is None
    both = (C(None), C(2), C(1), C(None, 2), C(2, 2), C(1, 2))
    # lag 2 too slow on four streams: lag 1 and lag 2 on two are skipped, two streams held
    # to the join are not (they wait at the join only)
    assert next_candidate([m(None, 10.0, 500), m(2, 12.0, 400)], both) == C(None, 2)
    # two streams too slow: every folded candidate goes
    assert next_candidate([m(None, 10.0, 500), m(2, 10.0, 400), m(1, 10.0, 300),
                           m(None, 12.0, 200, width=2)], both) is None


def test_a_program_that_can_run_stock_adds_the_stock_candidate_last():
    assert STOCK_CHOICE == C(stock=True) and STOCK_CHOICE.describe() == "stock (no early blocks)"
    assert candidates_for([T(stock=True)]) == (C(), STOCK_CHOICE)
    assert candidates_for([T(release_lag=True), T(stock=True)]) == (*LAGS_ONLY, STOCK_CHOICE)
    assert candidates_for([T(stock=True), T(side_streams=4)]) == (
        C(None), C(None, 2), STOCK_CHOICE)
    assert STOCK_CHOICE not in candidates_for([T(release_lag=True), T(side_streams=4)])


def test_next_candidate_never_skips_stock_for_a_slow_erase_schedule():
    with_stock = (*LAGS_ONLY, STOCK_CHOICE)
    # lag 2 too slow: lag 1 is skipped, stock is not
    assert next_candidate([m(None, 10.0, 500), m(2, 12.0, 400)], with_stock) == STOCK_CHOICE
    # the default too slow: stock waits on nothing like it
    assert next_candidate([m(None, 12.0, 500), m(2, 10.0, 400), m(1, 10.0, 300)],
                          with_stock) == STOCK_CHOICE
    assert next_candidate([m(None, 12.0, 500)], (C(), STOCK_CHOICE)) == STOCK_CHOICE
    # a slow stock program skips no erase schedule either
    assert next_candidate([stock(20.0, 100), m(None, 10.0, 500)],
                          (STOCK_CHOICE, C(None), C(2))) == C(2)
    assert next_candidate([m(None, 10.0, 500), stock(9.0, 100)], (C(), STOCK_CHOICE)) is None


def test_choose_takes_stock_where_erase_is_slower_or_as_fast_with_more_memory():
    assert choose([m(None, 13.5, 300), stock(10.0, 600)]) == STOCK_CHOICE  # erase slower
    assert choose([m(None, 10.1, 300), m(2, 12.0, 200), stock(10.0, 600)]) == C(None)
    assert choose([m(None, 9.9, 500), stock(10.0, 400)]) == STOCK_CHOICE  # within 2%, smaller
    assert choose([m(None, 9.9, 500), stock(10.0, 600)]) == C(None)  # within 2%, larger
    assert choose([m(None, 9.0, 500), stock(10.0, 400)]) == C(None)  # erase faster by more
    assert erase_over_stock([m(None, 13.5, 300), m(2, 12.0, 200), stock(10.0, 600)]) == 1.2
    assert erase_over_stock([m(None, 13.5, 300)]) is None


class FakeTimes:
    """`timed_replay` and `median_and_range` as the GPU would answer, per the tuner's choice
    (`key`)."""

    def __init__(self, monkeypatch, ms_by_choice):
        self.ms_by_choice = ms_by_choice
        self.tuner = None
        self.replays = 0
        monkeypatch.setattr(capture_tuning, "timed_replay", self.timed_replay)
        monkeypatch.setattr(capture_tuning, "median_and_range", self.median_and_range)

    def timed_replay(self, graph):
        graph.replay()
        self.replays += 1
        return None, None

    def median_and_range(self, pairs):
        ms = self.ms_by_choice[key(self.tuner.choice)]
        return ms, ms, ms


class Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def run_tuner(tuner, times, mib_by_choice):
    """Drive a tuner as compile_step does; the choices it captured, in order (`key`)."""
    times.tuner = tuner
    captured = []
    while not tuner.done:
        captured.append(key(tuner.choice))
        tuner.captured(mib_by_choice[key(tuner.choice)] * MiB)
        graph = Graph()
        verdict = KEEP
        while verdict == KEEP and not tuner.done:
            tuner.replay(graph)
            verdict = tuner.next_capture()
        assert graph.replays == capture_tuning.TIMED_REPLAYS + 1  # the capture's own, untimed
    if verdict != KEEP:
        captured.append(key(verdict))  # the choice's capture, not timed
    return captured


def test_the_tuner_measures_each_candidate_and_keeps_the_choice_in_hand(monkeypatch):
    times = FakeTimes(monkeypatch, {None: 10.0, 2: 10.1, 1: 10.9})
    tuner = CaptureTuner(LAGS_ONLY)
    captured = run_tuner(tuner, times, {None: 500, 2: 300, 1: 250})
    # 1 is too slow; 2 is the least memory among the fast: captured again to keep it
    assert captured == [None, 2, 1, 2] and tuner.done and tuner.chosen == C(2)
    assert [x.choice.lag for x in tuner.measured] == [None, 2, 1]
    assert tuner.choice == C(2)  # the next capture's
    assert times.replays == 3 * capture_tuning.TIMED_REPLAYS


def test_the_tuner_skips_a_lag_below_a_slow_one_and_recaptures_the_choice(monkeypatch):
    times = FakeTimes(monkeypatch, {None: 10.0, 2: 13.0, 1: 9.0})
    tuner = CaptureTuner(LAGS_ONLY)
    captured = run_tuner(tuner, times, {None: 500, 2: 300, 1: 250})
    assert captured == [None, 2, None] and tuner.chosen == C(None)  # 1 skipped: 2 was slow
    assert tuner.measured[-1].describe().startswith(
        "release_lag=2, side_cuda_streams=None: 13.000 ms")


def test_the_tuner_keeps_the_graph_in_hand_when_it_is_the_choice(monkeypatch):
    times = FakeTimes(monkeypatch, {None: 10.0, 2: 10.0, 1: 10.0})
    tuner = CaptureTuner(LAGS_ONLY)
    assert run_tuner(tuner, times, {None: 500, 2: 300, 1: 250}) == [None, 2, 1]
    assert tuner.chosen == C(1)


def test_the_tuner_measures_stock_last_and_keeps_it_in_hand_when_faster(monkeypatch):
    times = FakeTimes(monkeypatch, {None: 13.0, 2: 13.5, 1: 14.0, "stock": 10.0})
    tuner = CaptureTuner(candidates_for([T(release_lag=True), T(stock=True)]))
    captured = run_tuner(tuner, times, {None: 500, 2: 300, 1: 250, "stock": 400})
    # 2 too slow: 1 skipped, stock measured, fastest and kept (no capture again)
    assert captured == [None, 2, "stock"] and tuner.chosen == STOCK_CHOICE
    assert tuner.describe().startswith(
        "stock (no early blocks) chosen; release_lag=None, side_cuda_streams=None: 13.000 ms")
    assert tuner.describe().endswith("; stock (no early blocks): 10.000 ms (10.000-10.000), "
                                     "400 MiB")
    assert repr(tuner) == f"CaptureTuner({tuner.describe()})"


def test_the_tuner_folds_streams_where_that_is_as_fast_and_smaller(monkeypatch):
    both = candidates_for([T(release_lag=True, side_streams=4)])
    times = FakeTimes(monkeypatch, {None: 10.0, 2: 10.5, (None, 2): 10.1})
    tuner = CaptureTuner(both)
    captured = run_tuner(tuner, times, {None: 900, 2: 700, (None, 2): 600})
    # lag 2 too slow: lag 1 and every lag on two streams skipped; two streams kept
    assert captured == [None, 2, (None, 2)] and tuner.chosen == C(None, 2)


def test_pool_bytes_sums_a_graph_pools_segments(monkeypatch):
    segments = [{"segment_pool_id": (0, 0), "total_size": 100},  # the default pool
                {"segment_pool_id": (1, 2), "total_size": 20},
                {"segment_pool_id": (1, 2), "total_size": 6},
                {"segment_pool_id": (1, 5), "total_size": 8}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert capture_tuning.graph_pools() == {(1, 2): 26, (1, 5): 8}
    assert capture_tuning.pool_bytes((1, 2)) == 26 and capture_tuning.pool_bytes((7, 7)) == 0


# -- the programs' side ---------------------------------------------------------------


def build_program(release_lag=None, side_cuda_streams=None, streams=2, trace=False):
    """Chain(5), stages on the main stream (block activations cross streams): the program, its
    virtual streams and fresh copies of its inputs' list."""
    stages = Stages(GraphChain(5), chain_inputs(),
                    EraseConfig(inner="aot_eager", streams=streams,
                                tuning=Tuning(stages_on_side=False)))
    program, stream_ops = build(stages, trace, release_lag, side_cuda_streams)
    values = real_values(stages.fw)
    args = [values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")]
    return program, stream_ops, lambda: list(args)


def test_an_auto_program_plans_with_the_lag_its_step_sets_and_says_it_can_tune(monkeypatch):
    program, _, inputs = build_program("auto")
    assert program.lag_matters and program.tunables == T(release_lag=True)
    assert program._choice()[0] == program.capture_plan_for(None)  # outside a step
    assert program.capture_plan_for(2) != program.capture_plan_for(None)
    plans = []
    original = program_module.StreamProgram._run_captured

    def spy(self, env, plan, streams, contexts=None):
        plans.append(plan)
        original(self, env, plan, streams, contexts)

    monkeypatch.setattr(program_module.StreamProgram, "_run_captured", spy)
    monkeypatch.setattr(program_module, "stream_capturing", lambda: True)
    program(inputs())
    scope, inner = StepScope(), StepScope()
    with scope.entered():
        program(inputs())  # a warm-up: the defaults
        with scope.trying(C(2)) as met:
            program(inputs())
            # a step inside a step: the outer one decides
            with inner.entered(), inner.trying(C(1)) as inner_met:
                program(inputs())
        program(inputs())
    program(inputs())
    assert plans == [program.capture_plan_for(lag) for lag in (None, None, 2, 2, None, None)]
    assert met == [T(release_lag=True)] * 2 and inner_met == []


def test_a_program_with_a_fixed_lag_or_nothing_to_release_does_not_ask():
    fixed, _, inputs = build_program(2)
    scope = StepScope()
    with scope.entered(), scope.trying(C(1)) as met:
        fixed(inputs())
        assert fixed._choice()[0] == fixed.capture_plan_for(2)
    assert met == [T()] and candidates_for(met) == (C(),)
    stages = Stages(GraphChain(5), chain_inputs(),
                    EraseConfig(inner="aot_eager", streams=2, tuning=Tuning(stages_on_side=True)))
    on_side, _ = build(stages, trace=False, release_lag="auto")
    assert not on_side.lag_matters  # each block's activations are made on its own stream
    assert on_side.tunables == T()


# -- compile_step ------------------------------------------------------------------
#
# NB: under the fake capture (a TorchDispatchMode) Dynamo runs compiled models eagerly, so the
# step stands in for a release_lag="auto" program by meeting the step's scope as one does.


class Asking:
    """A model call that runs with the lag its step sets, as a ``release_lag="auto"`` program
    does (`StreamProgram.tunables`, `tune`); its capture with a lag in ``fails_with`` raises (as
    one out of memory would)."""

    tunables = Tunables(release_lag=True)

    def __init__(self, model, fails_with=()):
        self.model = model
        self.lags = []
        self.fails_with = fails_with
        self.tuned = C()

    def tune(self, choice):
        self.tuned = choice

    def __call__(self, x, y):
        capture_scope.meet(self)
        lag = self.tuned.lag
        self.lags.append(lag)
        if lag in self.fails_with:
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return self.model(x, y)


def tuned_training(monkeypatch, ms_by_lag, mib_by_lag, ask=True, fails_with=(), backend=None):
    (model,), (opt,) = (x[:1] for x in erase_training("sgd"))
    (ref_model,), (ref_opt,) = (x[:1] for x in erase_training("sgd"))
    run = model if backend is None else torch.compile(model, backend=backend)
    asking = Asking(run, fails_with) if ask else model
    step = compile_step(two_model_step([model], [opt], [asking]))
    reference = two_model_step([ref_model], [ref_opt], [ref_model])
    times = FakeTimes(monkeypatch, ms_by_lag)
    monkeypatch.setattr(step_tuning, "pool_bytes",
                        lambda pool: mib_by_lag[key(step.capture_tunings[-1].choice)] * MiB)
    return step, reference, times, asking, (model, ref_model), (opt, ref_opt)


def assert_trains_like_eager(models, opts):
    """Every parameter, its gradient and its SGD momentum buffer equal to eager's."""
    (model, ref_model), (opt, ref_opt) = models, opts
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
        assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])


def train(step, reference, times, calls, seed=3, after_each=lambda: None):
    g = torch.Generator().manual_seed(seed)
    for i in range(calls):
        if step.capture_tunings:
            times.tuner = step.capture_tunings[0]
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        assert torch.equal(step(x, y), reference(x, y)), i
        after_each()


def test_compile_step_tunes_an_auto_lag_and_trains_like_eager(fake_cuda, monkeypatch, caplog):
    step, reference, times, asking, models, opts = tuned_training(
        monkeypatch, {None: 10.0, 2: 10.1, 1: 12.0}, {None: 500, 2: 300, 1: 250})
    calls = 3 + 3 * (capture_tuning.TIMED_REPLAYS + 1) + 4
    with caplog.at_level(logging.INFO, logger="erase_fx.step"):
        train(step, reference, times, calls)
    (tuner,) = step.capture_tunings
    assert tuner.done and tuner.chosen == C(2)
    assert [x.choice.lag for x in tuner.measured] == [None, 2, 1]
    # two warm-ups, the capture with None, then captures with 2, 1 and the chosen 2, two
    # micro-batches each: no warm-up between them (the module hook stays to the tuning's end,
    # so Dynamo's guards do not change and nothing recompiles; see compile_step)
    assert asking.lags == [None] * 6 + [2, 2, 1, 1, 2, 2]
    assert (step.captures, step.tuning_captures, step.warmups) == (1, 3, 2)
    assert step.replays == calls - 2
    assert "release_lag=2, side_cuda_streams=None chosen" in caplog.text
    assert_trains_like_eager(models, opts)


def test_no_warm_up_comes_between_the_tunings_captures(fake_cuda, monkeypatch):
    """The module hook stays until the tuning ends (then goes): removing it after the first
    capture changed what Dynamo guards on, so a warm-up, where Dynamo may compile again,
    came before the next candidate's capture."""
    step, reference, times, _, models, opts = tuned_training(
        monkeypatch, {None: 10.0, 2: 10.1, 1: 12.0}, {None: 500, 2: 300, 1: 250},
        backend="eager")
    hooked = []
    train(step, reference, times, 2 + 3 * (capture_tuning.TIMED_REPLAYS + 1) + 4,
          after_each=lambda: hooked.append((step.tuning, step._uses.module_hook_installed)))
    assert step.capture_tunings[0].done and step.warmups == 2
    assert all(hook for tuning, hook in hooked if tuning) and hooked[-1] == (False, False)
    assert_trains_like_eager(models, opts)


def test_tuning_captures_do_not_count_toward_max_captures(fake_cuda, monkeypatch):
    step, reference, times, *_ = tuned_training(
        monkeypatch, {None: 10.0, 2: 10.0, 1: 10.0}, {None: 500, 2: 300, 1: 250})
    step.max_captures = 1
    train(step, reference, times, 3 + 3 * (capture_tuning.TIMED_REPLAYS + 1) + 2)
    assert (step.captures, step.tuning_captures) == (1, 2)
    assert step.capture_tunings[0].chosen == C(1) and step.uncaptured_reason is None


def test_a_step_without_an_auto_program_is_not_tuned(fake_cuda, monkeypatch):
    step, reference, times, *_ = tuned_training(monkeypatch, {}, {}, ask=False)
    train(step, reference, times, 8)
    assert (step.captures, step.tuning_captures, step.capture_tunings) == (1, 0, [])


def test_when_the_pools_are_released_no_grad_of_a_dropped_capture_is_alive(fake_cuda,
                                                                           monkeypatch):
    """A pool's segments go back to the driver only once all its blocks are free: when the
    tuning releases the candidates' pools, nothing may hold their ``.grad`` tensors."""
    step, reference, times, _, (model, _), _ = tuned_training(
        monkeypatch, {None: 10.0, 2: 10.1, 1: 12.0}, {None: 500, 2: 300, 1: 250})
    grads_of_captures = []
    seen = [0]

    def watch_captures():
        made = step.captures + step.tuning_captures
        if made > seen[0]:
            seen[0] = made
            grads_of_captures.append([weakref.ref(p.grad) for p in model.parameters()])

    alive_at_release = []

    def release():
        current = {id(p.grad) for p in model.parameters()}
        alive_at_release.append(sum(1 for refs in grads_of_captures for r in refs
                                    if r() is not None and id(r()) not in current))

    monkeypatch.setattr(step_tuning, "release_dropped_pools", release)
    train(step, reference, times, 3 + 3 * (capture_tuning.TIMED_REPLAYS + 1) + 2,
          after_each=watch_captures)
    assert step.tuning_captures == 3 and len(grads_of_captures) == 4  # the last: the choice
    assert alive_at_release == [0]


def test_a_guard_failing_during_the_tuning_recaptures_the_same_candidate(fake_cuda, monkeypatch):
    """A float lr changed while candidate 2 is timed: warm-up and a capture of 2 again (a
    recapture, counted as such; the warm-ups run with 2, the choice of the capture they
    prepare); its timings start over; training stays exact."""
    step, reference, times, asking, models, opts = tuned_training(
        monkeypatch, {None: 10.0, 2: 10.1, 1: 12.0}, {None: 500, 2: 300, 1: 250})
    train(step, reference, times, 3 + (capture_tuning.TIMED_REPLAYS + 1) + 3)
    tuner = step.capture_tunings[0]
    assert tuner.choice == C(2) and [m.choice for m in tuner.measured] == [C(None)]
    for opt in opts:
        opt.param_groups[0]["lr"] = 0.02
    train(step, reference, times, 2 + 3 * (capture_tuning.TIMED_REPLAYS + 1) + 2, seed=4)
    assert tuner.done and tuner.chosen == C(2)
    assert [m.choice.lag for m in tuner.measured] == [None, 2, 1]
    assert (step.captures, step.tuning_captures) == (2, 3)
    assert asking.lags[-10:] == [2] * 4 + [2, 2, 1, 1, 2, 2]  # warm-ups, then the captures
    assert_trains_like_eager(models, opts)


def test_a_candidate_whose_capture_fails_ends_the_tuning_with_what_was_measured(
        fake_cuda, monkeypatch, caplog):
    """Capturing with lag 2 raises: that call runs uncaptured, the tuning keeps None (the only
    one measured), the next call captures it, and the step stays captured and exact."""
    step, reference, times, asking, models, opts = tuned_training(
        monkeypatch, {None: 10.0, 2: 10.1, 1: 12.0}, {None: 500, 2: 300, 1: 250},
        fails_with=(2,))
    with caplog.at_level(logging.INFO, logger="erase_fx.step"):
        train(step, reference, times, 3 + (capture_tuning.TIMED_REPLAYS + 1) + 1 + 4)
    (tuner,) = step.capture_tunings
    assert tuner.done and tuner.chosen == C(None)
    assert [m.choice for m in tuner.measured] == [C(None)]
    assert "capturing with release_lag=2, side_cuda_streams=None failed" in caplog.text
    assert (step.captures, step.tuning_captures) == (1, 1)
    assert step.uncaptured_reason is None and not step.tuning
    assert_trains_like_eager(models, opts)


def test_an_auto_width_program_folds_its_side_streams_as_its_step_sets():
    program, streams, inputs = build_program(side_cuda_streams="auto", streams=4, trace=True)
    assert program.side_streams == (1, 2, 3, 4)

    def run_on():
        streams.trace.clear()
        got = program(inputs())
        return got, {e[1] for e in streams.trace if e[0] == "run"}

    want, used = run_on()
    assert used == {0, 1, 2, 3, 4}
    scope = StepScope()
    with scope.entered(), scope.trying(C(None, 2)) as met:
        got, used = run_on()
    assert used == {0, 1, 2} and met == [T(side_streams=4)]
    for a, b in zip(want, got):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    fixed, fixed_streams, inputs = build_program(side_cuda_streams=1, streams=4, trace=True)
    fixed(inputs())
    assert {e[1] for e in fixed_streams.trace if e[0] == "run"} == {0, 1}
