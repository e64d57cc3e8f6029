"""compile_step(early_optimizer=True): which parameters, the session's checks, exact training.

On CPU the streams are virtual, so an early update runs where ``optimizer.step()``
is called; what these tests pin is everything else: the plan (which parameters
nothing reads once their gradient is made), each condition of the session
(`erase_fx.early_update`), that narrowing the optimizer's groups trains bit for
bit as one step does, and the torch internals the session reaches into. On a
GPU, ``bench/check_step.py`` checks the overlap itself.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from erase_fx import compile_step
from erase_fx.step import capture as step_capture
from erase_fx.config import EraseConfig
from erase_fx.early_grads import plan_early_grads
from erase_fx.early_update import (
    PER_PARAMETER_OPTIMIZERS,
    _other_step_hooks,
    _step_function,
    active_session,
    open_session,
    plan_early_updates,
)
from erase_fx.emit.capture_scope import StepScope
from erase_fx.errors import EraseOptionError
from fake_cuda import fake_cuda  # noqa: F401 - a fixture
from graphs import Chain, Stages, chain_inputs
from test_step import Chain as Detached  # three detached stages with local heads

CFG = EraseConfig(inner="aot_eager", streams=2)


@contextlib.contextmanager
def session_of(optimizers=()):
    """An early-update session on a step scope of its own, current meanwhile, as compile_step
    opens one around a capture."""
    scope = StepScope()
    with scope.entered(), open_session(scope, optimizers) as session:
        assert active_session() is session
        yield session


# -- the plan ---------------------------------------------------------------------------


def _planned(model, inputs=None):
    stages = Stages(model, inputs or chain_inputs(), CFG)
    grads = plan_early_grads(stages.fw, stages.bw, stages.joint.num_fwd_outputs)
    placeholders = list(stages.fw.graph.find_nodes(op="placeholder"))
    planned = plan_early_updates(stages.recomputed.gm, grads)
    return grads, planned, placeholders


def test_every_whole_early_gradient_of_a_chain_is_planned():
    grads, planned, _ = _planned(Chain(3))
    assert len(grads) == 16 and planned == grads


class SharedLater(Chain):
    """Block 0's head weight is read again, detached, by block 1: not updated early."""

    def forward(self, x, labels):
        loss = x.new_zeros(())
        h = x
        for i, (stage, head) in enumerate(zip(self.stages, self.heads)):
            h = stage(h)
            logits = head(h)
            if i == 1:
                logits = logits + h @ self.heads[0].weight.detach().t()
            loss = loss + F.cross_entropy(logits, labels)
            h = h.detach()
        return loss


class SavedForLast(Chain):
    """The last (late) block reads block 0's first weight, detached: it is saved for the
    backward, so not updated early."""

    def forward(self, x, labels):
        loss = x.new_zeros(())
        h = x
        last = len(self.stages) - 1
        for i, (stage, head) in enumerate(zip(self.stages, self.heads)):
            h = stage(h)
            if i == last:
                h = h * self.stages[0][0].weight.detach().sum()
            loss = loss + F.cross_entropy(head(h), labels)
            h = h.detach()
        return loss


@pytest.mark.parametrize("model_cls, shape", [(SharedLater, (5, 16)), (SavedForLast, (32, 16))])
def test_a_parameter_read_once_its_gradient_is_made_is_not_planned(model_cls, shape):
    grads, planned, placeholders = _planned(model_cls(3))
    left = [g for g in grads if g not in planned]
    assert [tuple(placeholders[g.param].meta["val"].shape) for g in left] == [shape]
    assert len(planned) == len(grads) - 1


def test_explain_says_how_many_parameters_an_optimizer_may_update_early():
    from erase_fx import explain
    from erase_fx.report_text import format_report

    x, y = torch.randn(8, 8), torch.randn(8, 1)
    (report,) = explain(Detached(), x, y)
    assert (report.early_updatable, report.whole_early_grads) == (8, 8)
    assert ("an optimizer may update 8 of the 8 parameters with a whole early gradient during "
            "the forward") in format_report(report)
    (seeded,) = explain(Detached(), x, y, erase_options={"seed": 2.0})
    assert (seeded.early_updatable, seeded.whole_early_grads) == (0, 8)  # T/seed not provable
    (later,) = explain(SharedLater(3), *chain_inputs())
    assert later.whole_early_grads - later.early_updatable == 1


# -- torch internals the session relies on (pinned for torch 2.11-2.14) -----------------


@pytest.mark.parametrize("cls", PER_PARAMETER_OPTIMIZERS)
def test_the_optimizer_step_without_hooks_is_the_wrapped_function(cls):
    opt = cls([nn.Parameter(torch.randn(3))], lr=0.1)
    assert getattr(type(opt).step, "hooked", False)
    assert _step_function(opt) is cls.step.__wrapped__
    # NB: the class's own step (AdamW's is Adam's on torch 2.13), not torch's hook wrapper
    assert not getattr(_step_function(opt), "hooked", False)
    assert _step_function(opt).__qualname__.endswith("Adam.step") or \
        _step_function(opt).__qualname__ == f"{cls.__name__}.step"


def test_step_hooks_are_found_where_torch_keeps_them():
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    opt = torch.optim.SGD([nn.Parameter(torch.randn(3))], lr=0.1)
    assert _other_step_hooks(opt, []) == ""

    def mine(*args):
        return None

    handle = opt.register_step_post_hook(mine)
    assert "mine" in _other_step_hooks(opt, [])
    handle.remove()
    handle = register_optimizer_step_pre_hook(mine)
    assert "mine" in _other_step_hooks(opt, []) and _other_step_hooks(opt, [mine]) == ""
    handle.remove()


def test_tensor_backward_calls_torch_autograd_backward_by_its_module_attribute():
    assert "torch.autograd.backward(" in inspect.getsource(torch.Tensor.backward)
    x = torch.randn((), requires_grad=True)
    with session_of() as session:
        (x * 2).backward()
        (x * 3).backward(torch.tensor(2.0))
        assert [call.gradient_given for call in session.backwards] == [False, True]
    assert torch.autograd.backward is importlib.import_module("torch.autograd").backward
    assert active_session() is None


def test_the_current_autograd_node_is_the_outputs_grad_fn():
    seen = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(torch._C._current_autograd_node())
            return grad * 2

    out = Double.apply(torch.randn((), requires_grad=True))
    out.backward()
    assert seen == [out.grad_fn] and seen[0] is out.grad_fn


# -- narrowing the groups trains as one step does ---------------------------------------


@pytest.mark.parametrize("cls, kwargs", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "foreach": True}),
    (torch.optim.Adam, {"lr": 0.01, "foreach": False, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.01, "foreach": True, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 0.01, "fused": True}),
    (torch.optim.AdamW, {"lr": 0.01, "fused": True, "weight_decay": 0.1}),
])
def test_a_step_in_two_narrowed_calls_equals_one_step_bitwise(cls, kwargs):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3)) for _ in range(5)]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    whole, split = cls(params, **kwargs), cls(twins, **kwargs)
    for _ in range(3):
        for p, q in zip(params, twins):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        whole.step()
        group = split.param_groups[0]
        everything = group["params"]
        for part in (everything[:2], everything[2:]):
            group["params"] = part
            _step_function(split)(split)
        group["params"] = everything
    for p, q in zip(params, twins):
        assert torch.equal(p, q)
        for key, value in whole.state[p].items():
            assert torch.equal(value, split.state[q][key]), key


# -- the whole step --------------------------------------------------------------------


def _training(optimizer, seed=0, capturable=False):
    torch.manual_seed(seed)
    model = Detached()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=capturable)
    return model, opt


def _step(model, opt, compiled, *, scale=None, clip=None, micro_batches=1, set_to_none=True):
    def step(x, y):
        opt.zero_grad(set_to_none=set_to_none)
        total = 0
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = compiled(xs, ys)
            (loss if scale is None else loss * scale).backward()
            total = total + loss.detach()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return total
    return step


def _run(optimizer="adam", *, steps=4, hook=None, **variant):
    """Train with each step inside an `UpdateSession` (as compile_step's capture opens one),
    against eager; the sessions' counts.

    NB: uncaptured, because under the CPU stand-in's capture (a dispatch mode) the compiled
    model runs eagerly: the session is what is tested here, compile_step's use of it below.
    """
    model, opt = _training(optimizer)
    ref_model, ref_opt = _training(optimizer)
    ref_model.load_state_dict(model.state_dict())
    if hook is not None:
        opt.register_step_pre_hook(hook)
        ref_opt.register_step_pre_hook(hook)
    compiled = torch.compile(model, backend="erase",
                             options={"inner": "aot_eager", "on_error": "raise"})
    step = _step(model, opt, compiled, **variant)
    reference = _step(ref_model, ref_opt, ref_model, **variant)
    g = torch.Generator().manual_seed(3)
    updated, refused = [], []
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        with session_of([opt]) as session:
            got = step(x, y)
        assert torch.equal(got, reference(x, y))
        updated.append(session.updated)
        refused.append(dict(session.refused))
        assert [g["params"] for g in opt.param_groups] == [list(model.parameters())]
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, ref_opt.state[q][key]), key
    return updated, refused


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_early_blocks_parameters_are_updated_early_and_train_exactly(optimizer):
    updated, refused = _run(optimizer)
    # two early blocks (the last block's backward stays late), each a stage and a head:
    # 2 x (weight, bias) x 2, at every step
    assert updated == [8] * 4 and refused == [{}] * 4


@pytest.mark.parametrize("variant, why", [
    ({"scale": 0.5}, "did not start at its graph's loss"),
    ({"clip": 1e-3}, "changed in place before optimizer.step()"),
    ({"micro_batches": 2}, "ran twice in the step"),
    ({"hook": lambda opt, args, kwargs: None}, "step hooks"),
    # NB: the first step's .grad is None either way: early then, late once zeroed in place
    ({"set_to_none": False}, ".grad was not None before the backward"),
])
def test_what_would_change_the_update_keeps_every_parameter_late(variant, why):
    updated, refused = _run(**variant)
    assert updated[1:] == [0] * 3 and updated[0] in (0, 8)
    assert all(any(why in reason for reason in r) for r in refused[1:]), refused


class Reader(nn.Module):
    """Detached stages whose first stage also reads another model's head weight, detached."""

    def __init__(self, other):
        super().__init__()
        self.chain = Detached()
        self.other = [other]  # NB: a list: not a submodule, its parameters are not ours

    def forward(self, x, y):
        shared = self.other[0].heads[0].weight.detach()
        return self.chain(x + (x @ shared.t()).mean(), y)


def test_a_parameter_another_graph_reads_later_in_the_step_is_not_updated_early():
    torch.manual_seed(0)
    first = Detached()
    second = Reader(first)
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.05)
    options = {"inner": "aot_eager", "on_error": "raise"}
    compiled = [torch.compile(m, backend="erase", options=options) for m in (first, second)]
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    for _ in range(2):
        with session_of([opt]) as session:
            opt.zero_grad(set_to_none=True)
            for fn in compiled:
                fn(x, y).backward()
            opt.step()
    assert session.updated == 15  # 8 of each chain, but the shared weight
    assert session.refused == {"another compiled graph of the step reads it after its block": 1}


def test_a_gradient_autograd_copied_is_refused_with_its_layout(caplog):
    """AccumulateGrad copies a gradient it cannot adopt (another layout than the parameter's,
    or another reference to it): the copy is made in the backward, so the parameter waits,
    and the reason says whether the layouts differ."""
    from erase_fx.early_update import UpdateSession, _BackwardCall, _Param

    param = nn.Parameter(torch.randn(4, 3))
    loss = (param * 2).sum()
    session = UpdateSession()
    session.backwards.append(_BackwardCall((loss,), False, False, False))
    entry = _Param(param, owner=None, streams=None, events=[], param_version=param._version,
                   node=loss.grad_fn)
    assert session._changed(entry) == ("autograd did not accumulate the early gradient into "
                                       ".grad")
    handed = torch.randn(3, 4).t()  # strides (1, 4); the parameter's are (3, 1)
    entry.adopted_ptr, entry.grad_version = handed.data_ptr(), handed._version
    entry.handed_stride = tuple(handed.stride())
    param.grad = handed.contiguous()  # AccumulateGrad's copy
    with caplog.at_level(logging.INFO, logger="erase_fx.early_update"):
        assert session._changed(entry) == ("autograd copied the early gradient into .grad: its "
                                           "layout is not the parameter's")
    assert any("strides (3, 1)" in r.getMessage() and "(1, 4)" in r.getMessage()
               for r in caplog.records)
    entry.handed_stride = (3, 1)
    assert session._changed(entry) == "autograd copied the early gradient into .grad (same layout)"
    param.grad, entry.adopted_ptr = handed, handed.data_ptr()  # adopted as is
    entry.grad_version = handed._version
    assert session._changed(entry) is None


def test_compile_step_opens_a_session_around_the_capture_only(fake_cuda, monkeypatch, caplog):
    opened = []

    class Session:
        updated, refused = 3, {"why not": 2}

    @contextlib.contextmanager
    def fake_open(scope, optimizers, own_hooks):
        opened.append(([type(o).__name__ for o in optimizers], len(own_hooks)))
        yield Session()

    monkeypatch.setattr(step_capture, "open_session", fake_open)
    model, opt = _training("adam", capturable=True)
    step = compile_step(_step(model, opt, model), early_optimizer=True)
    plain = compile_step(_step(model, opt, model))
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    with caplog.at_level(logging.INFO, logger="erase_fx.step"):
        for _ in range(4):
            step(x, y)
            plain(x, y)
    assert opened == [(["Adam"], 1)]  # at the capture, with the warm-ups' optimizer
    assert (step.early_updated, step.early_refused) == (3, {"why not": 2})
    assert (plain.early_updated, plain.early_refused) == (0, {})
    assert any("3 parameters updated early; not early: why not (2)" in r.getMessage()
               for r in caplog.records)


def test_a_step_with_nothing_to_update_early_says_where_early_updates_come_from(fake_cuda,
                                                                              caplog):
    model, opt = _training("adam", capturable=True)
    step = compile_step(_step(model, opt, model), early_optimizer=True)  # eager: no erase graph
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    with caplog.at_level(logging.INFO, logger="erase_fx.step"):
        for _ in range(4):
            step(x, y)
    assert step.captures == 1 and step.early_updated == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("0 parameters updated early; not early: no compiled graph" in m
               and "backend='erase'" in m for m in warnings), warnings


def test_early_optimizer_is_checked_like_the_other_options():
    with pytest.raises(EraseOptionError, match="early_optimizer"):
        compile_step(lambda: None, early_optimizer="yes")
    assert compile_step(early_optimizer=True)(lambda: None).early_optimizer is True


def test_each_blocks_update_runs_on_the_update_stream_of_its_side_stream(monkeypatch):
    # NB: on the H200 one update stream for every block made Adam's early updates a serial
    # chain longer than the rest of the step (ctr:1024: 0.99x of stock, 0.95x without them)
    from erase_fx.emit.streams import VirtualStreams

    lanes = []
    run_update = VirtualStreams.run_update

    def noted(self, lane, events, fn):
        lanes.append((lane, tuple(events)))
        return run_update(self, lane, events, fn)

    monkeypatch.setattr(VirtualStreams, "run_update", noted)
    updated, _ = _run("sgd", steps=1)
    assert updated == [8]
    # two early blocks, each on a side stream of its own: its update waits for that stream's
    # event and runs on the update stream paired with it
    assert sorted(lanes) == [(0, (1,)), (1, (2,))], lanes
