"""``Tuning.stock_candidate``: the stock compilation of a graph as one more capture candidate.

Three parts: the switch the backend builds (`erase_fx.emit.stock_switch`),
which runs erase's program or the stock one as the step's scope chooses, with
gradients bitwise those of the program that ran; where the backend builds it
(inside a compile_step's scope, with the option on, a graph with early
blocks; not under DDP, with early updates, with dynamic shapes); and
compile_step's state machine with the fake CUDA of ``fake_cuda.py``: the stock
candidate is warmed up before its capture and chosen when its timed replays
are faster. The rules (`candidates_for`, `next_candidate`, `choose`) are
checked in ``test_capture_tuning.py``.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from erase_fx import backend as backend_module
from erase_fx import capture_tuning, collect_reports, compile_step
from erase_fx.capture_tuning import STOCK_CHOICE
from erase_fx.emit.capture_scope import CaptureChoice, StepScope, Tunables
from erase_fx.emit.stock_switch import StockSwitch, stock_candidate_refusal
from fake_cuda import FakeGraph, fake_cuda  # noqa: F401 - a fixture
from test_capture_tuning import MiB, Asking, FakeTimes, assert_trains_like_eager, key, train
from test_step import Chain, erase_training, two_model_step
from erase_fx.step import tuning as step_tuning

ERASE_OPTIONS = {"inner": "aot_eager", "on_error": "raise"}
WITH_STOCK = {**ERASE_OPTIONS, "tuning": {"stock_candidate": True}}
#: how the backend's INFO line says why a graph has no stock candidate
NO_STOCK = "no stock candidate for compile_step's tuning: "


@pytest.fixture
def switches(monkeypatch):
    """The `StockSwitch` objects the backend builds, in order."""
    built = []

    class Recorded(StockSwitch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(backend_module, "StockSwitch", Recorded)
    return built


def count_calls(switch):
    """Count the calls of each of the switch's programs: ``{"erase": n, "stock": n}``."""
    calls = {"erase": 0, "stock": 0}
    for name in calls:
        run = getattr(switch, name)

        def counted(*args, _run=run, _name=name):
            calls[_name] += 1
            return _run(*args)

        setattr(switch, name, counted)
    return calls


def inputs(seed=0, batch=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 8, generator=g), torch.randn(batch, 1, generator=g)


def grads_after_one_backward(compiled, model, *args):
    model.zero_grad(set_to_none=True)
    compiled(*args).backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_bitwise_equal(grads, expected):
    assert len(grads) == len(expected)
    for a, b in zip(grads, expected):
        assert torch.equal(a, b)


# -- the switch ------------------------------------------------------------------------


def test_the_switch_runs_erase_unless_its_scope_tunes_it_to_stock():
    ran = []
    switch = StockSwitch(lambda x: ran.append("erase") or x + 1,
                         lambda x: ran.append("stock") or x + 2, graph_id=0)
    assert switch.tunables == Tunables(stock=True)
    assert switch(1) == 2  # outside any compile_step: erase's
    scope = StepScope()
    with scope.entered():
        switch(1)  # a warm-up with the defaults
        with scope.trying(STOCK_CHOICE) as met:
            assert switch(1) == 3
        with scope.trying(CaptureChoice(2)):
            switch(1)
        switch(1)
    switch(1)
    assert ran == ["erase", "erase", "stock", "erase", "erase", "erase"]
    assert met == [Tunables(stock=True)]


def test_switched_gradients_are_stock_aot_eager_s_and_erase_s_otherwise(switches):
    torch.manual_seed(0)
    model = Chain()
    twins = [copy.deepcopy(model) for _ in range(2)]
    switched = torch.compile(model, backend="erase", options=WITH_STOCK)
    stock = torch.compile(twins[0], backend="aot_eager")
    erase = torch.compile(twins[1], backend="erase", options=ERASE_OPTIONS)
    scope = StepScope()
    x, y = inputs()
    with scope.entered():
        erase_grads = grads_after_one_backward(switched, model, x, y)  # compiles here
    (switch,) = switches
    calls = count_calls(switch)
    with scope.entered(), scope.trying(STOCK_CHOICE):
        stock_grads = grads_after_one_backward(switched, model, x, y)
    assert calls == {"erase": 0, "stock": 1}
    assert_bitwise_equal(stock_grads, grads_after_one_backward(stock, twins[0], x, y))
    assert_bitwise_equal(erase_grads, grads_after_one_backward(erase, twins[1], x, y))
    with scope.entered():
        again = grads_after_one_backward(switched, model, x, y)
    outside = grads_after_one_backward(switched, model, x, y)
    assert calls == {"erase": 2, "stock": 1}
    assert_bitwise_equal(again, erase_grads)
    assert_bitwise_equal(outside, erase_grads)


# -- where the backend builds it ----------------------------------------------------------


def compile_and_run(model, options, scope=None, **compile_kwargs):
    """Compile ``model`` afresh (Dynamo's cache would serve an earlier model of its class) and
    run one forward and backward, inside ``scope`` if given."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="erase", options=options, **compile_kwargs)
    if scope is None:
        compiled(*inputs()).backward()
        return
    with scope.entered():
        compiled(*inputs()).backward()


def test_the_backend_builds_it_only_inside_a_compile_step_with_the_option(switches):
    compile_and_run(Chain(), WITH_STOCK)  # outside a compile_step
    compile_and_run(Chain(), ERASE_OPTIONS, StepScope())  # the option off
    assert switches == []
    compile_and_run(Chain(), WITH_STOCK, StepScope())
    assert len(switches) == 1


def test_a_graph_without_early_blocks_gets_no_switch(switches):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    compiled = torch.compile(model, backend="erase", options=WITH_STOCK)
    with StepScope().entered():
        compiled(inputs()[0]).sum().backward()
    assert switches == []


def test_dynamic_shapes_get_no_switch_and_say_why(switches, caplog):
    with caplog.at_level(logging.INFO, logger="erase_fx.backend"):
        compile_and_run(Chain(), WITH_STOCK, StepScope(), dynamic=True)
    assert switches == [] and f"{NO_STOCK}dynamic shapes" in caplog.text


def test_a_step_updating_early_gets_no_switch_for_a_graph_with_early_updates(switches, caplog):
    with collect_reports() as reports, caplog.at_level(logging.INFO, logger="erase_fx.backend"):
        compile_and_run(Chain(), WITH_STOCK, StepScope(early_optimizer=True))
    assert sum(r.early_updatable for r in reports) > 0  # the graph has early updates planned
    assert switches == [] and f"{NO_STOCK}the step updates this graph's" in caplog.text
    compile_and_run(Chain(), WITH_STOCK, StepScope(early_optimizer=False))
    assert len(switches) == 1
    # with no side stream the graph plans no early update: nothing to skip
    with collect_reports() as reports:
        compile_and_run(Chain(), {**WITH_STOCK, "streams": 0}, StepScope(early_optimizer=True))
    assert sum(len(r.blocks) for r in reports) > 0 and reports[0].early_updatable == 0
    assert len(switches) == 2


@pytest.fixture
def world_of_one(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_gets_no_switch_and_says_why(world_of_one, switches, caplog):
    model = nn.parallel.DistributedDataParallel(Chain())
    with caplog.at_level(logging.INFO, logger="erase_fx.backend"):
        compile_and_run(model, WITH_STOCK, StepScope())
    assert switches == [] and f"{NO_STOCK}under DistributedDataParallel" in caplog.text


def test_the_refusals_in_order():
    static = [torch.zeros(2)]
    assert stock_candidate_refusal(data_parallel=False, updates_early=False,
                                   example_inputs=static) is None
    assert "DistributedDataParallel" in stock_candidate_refusal(
        data_parallel=True, updates_early=True, example_inputs=static)
    assert "early_optimizer" in stock_candidate_refusal(
        data_parallel=False, updates_early=True, example_inputs=static)


# -- compile_step ------------------------------------------------------------------------
#
# NB: under the fake capture Dynamo runs compiled models eagerly: the switch is built here
# around two stand-ins of compiled functions, which note whether each call was captured.


class Program:
    """A compiled function's stand-in: runs ``model``, noting for each call whether a capture
    was under way (False: a warm-up)."""

    def __init__(self, model):
        self.model = model
        self.captured = []

    def __call__(self, x, y):
        self.captured.append(FakeGraph.capturing is not None)
        return self.model(x, y)


def stock_training(monkeypatch, ms, mib, auto_lag=False):
    """A step over a switch between ``erase`` (an ``"auto"`` program with ``auto_lag``) and
    ``stock``, its eager twin, times and pools per choice (`key`)."""
    (model,), (opt,) = (x[:1] for x in erase_training("sgd"))
    (ref_model,), (ref_opt,) = (x[:1] for x in erase_training("sgd"))
    erase = Program(Asking(model) if auto_lag else model)
    stock = Program(model)
    step = compile_step(two_model_step([model], [opt], [StockSwitch(erase, stock, 0)]))
    reference = two_model_step([ref_model], [ref_opt], [ref_model])
    times = FakeTimes(monkeypatch, ms)
    monkeypatch.setattr(step_tuning, "pool_bytes",
                        lambda pool: mib[key(step.capture_tunings[-1].choice)] * MiB)
    return step, reference, times, (erase, stock), (model, ref_model), (opt, ref_opt)


#: calls of one candidate: its capture and its timed replays
CANDIDATE = 1 + capture_tuning.TIMED_REPLAYS
#: per call of the step, calls of the model (two micro-batches)
MICRO = 2


def test_stock_is_warmed_up_before_its_capture_and_chosen_when_faster(fake_cuda, monkeypatch,
                                                                      caplog):
    step, reference, times, (erase, stock), models, opts = stock_training(
        monkeypatch, {None: 13.0, "stock": 10.0}, {None: 500, "stock": 400})
    with caplog.at_level(logging.INFO, logger="erase_fx.step"):
        train(step, reference, times, 2 + CANDIDATE + 2 + CANDIDATE + 3)
    (tuner,) = step.capture_tunings
    assert tuner.done and tuner.chosen == STOCK_CHOICE
    assert [m.choice for m in tuner.measured] == [CaptureChoice(), STOCK_CHOICE]
    # the stock program ran first in two warm-ups, then in its capture; it is kept (no
    # capture again), and the rest are replays
    assert stock.captured == [False] * (2 * MICRO) + [True] * MICRO
    assert erase.captured == [False] * (2 * MICRO) + [True] * MICRO
    assert (step.captures, step.tuning_captures, step.warmups) == (1, 1, 4)
    assert not step.tuning and step.uncaptured_reason is None
    assert "stock (no early blocks) chosen" in caplog.text
    assert "stock (no early blocks): 10.000 ms" in caplog.text
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "erase's fastest candidate took 1.30x the time of the stock program" in (
        warnings[0].getMessage())
    assert_trains_like_eager(models, opts)


def test_erase_is_captured_again_when_faster_than_stock(fake_cuda, monkeypatch, caplog):
    step, reference, times, (erase, stock), models, opts = stock_training(
        monkeypatch, {None: 10.0, 2: 9.9, 1: 9.85, "stock": 10.5},
        {None: 500, 2: 450, 1: 300, "stock": 200}, auto_lag=True)
    with caplog.at_level(logging.INFO, logger="erase_fx.step"):
        train(step, reference, times, 2 + 3 * CANDIDATE + 2 + CANDIDATE + 1 + 2)
    (tuner,) = step.capture_tunings
    # every lag within 2% of the fastest, 1 the least memory; stock, with less, 7% slower
    assert tuner.chosen == CaptureChoice(1)
    assert [key(m.choice) for m in tuner.measured] == [None, 2, 1, "stock"]
    assert stock.captured == [False] * (2 * MICRO) + [True] * MICRO
    assert erase.model.lags == [None] * (3 * MICRO) + [2, 2, 1, 1] + [1, 1]
    assert (step.captures, step.tuning_captures, step.warmups) == (1, 4, 4)
    assert not step.tuning
    assert "erase's fastest candidate" not in caplog.text
    assert_trains_like_eager(models, opts)


def test_the_stock_warning_comes_once_per_step(fake_cuda, monkeypatch, caplog):
    """Two signatures (batch sizes), each tuned apart, both choosing stock: one warning."""
    step, reference, times, _, models, opts = stock_training(
        monkeypatch, {None: 13.0, "stock": 10.0}, {None: 500, "stock": 400})
    calls = 2 + CANDIDATE + 2 + CANDIDATE + 1
    with caplog.at_level(logging.INFO, logger="erase_fx.step"):
        for batch in (8, 4):
            for i in range(calls):
                times.tuner = step.capture_tunings[-1] if step.capture_tunings else None
                x, y = inputs(seed=i, batch=batch)
                assert torch.equal(step(x, y), reference(x, y))
    assert [t.chosen for t in step.capture_tunings] == [STOCK_CHOICE] * 2
    assert caplog.text.count("stock (no early blocks) chosen") == 2
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert_trains_like_eager(models, opts)
