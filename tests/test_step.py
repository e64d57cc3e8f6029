"""compile_step on CPU: the state machine and every guard, with a stand-in for CUDA graphs.

The stand-in (`fake_cuda.FakeGraph`) behaves like a CUDA graph where it
matters here: a capture records every aten op and undoes it, a replay runs
them again into the capture's tensors, a host sync under capture raises.
That makes "trains exactly like eager" a meaningful check of the state
machine on CPU. The real thing runs on a GPU in ``bench/check_step.py``.
"""
from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import erase_fx
from erase_fx import CompiledStep, EraseOptionError, StepCaptureError, compile_step
from erase_fx.step.uses import bindings_of
from erase_fx.emit import cudagraphs
from erase_fx.emit.capture_scope import StepScope, current_scope
from erase_fx.emit.cudagraphs import GraphedForward, Unreplayed, graph_backward
from fake_cuda import fake_cuda  # noqa: F401 - a fixture

aten = torch.ops.aten


# -- models and training --------------------------------------------------------


class Net(nn.Module):
    """Linear-BatchNorm-ReLU-Linear with a detached second stage and a local head."""

    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 1)
        self.second = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x, y):
        h = self.first(x)
        local = F.mse_loss(self.head(h), y)
        return local + F.mse_loss(self.second(h.detach()), y)


def make(optimizer="sgd", seed=0, **kwargs):
    torch.manual_seed(seed)
    model = Net()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=kwargs.pop("lr", 0.1), momentum=0.9,
                              **kwargs)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=kwargs.pop("lr", 0.01), **kwargs)
    return model, opt


def twins(optimizer="sgd", **kwargs):
    """Two identical (model, optimizer) pairs: one for compile_step, one for eager."""
    model, opt = make(optimizer, **kwargs)
    other, other_opt = make(optimizer, **kwargs)
    other.load_state_dict(model.state_dict())
    return (model, opt), (other, other_opt)


def plain_step(model, opt):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        return loss
    return step


def batches(n, batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 4, generator=g), torch.randn(batch, 1, generator=g))
            for _ in range(n)]


def assert_same_training(a, b):
    """Parameters, buffers, gradients and optimizer state bitwise equal."""
    (model, opt), (other, other_opt) = a, b
    for (name, x), (_, y) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(x, y), name
    for p, q in zip(model.parameters(), other.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad)
    for p, q in zip(model.parameters(), other.parameters()):
        s, t = opt.state.get(p, {}), other_opt.state.get(q, {})
        assert s.keys() == t.keys()
        for key in s:
            if isinstance(s[key], torch.Tensor):
                assert torch.equal(s[key], t[key]), key
            else:
                assert s[key] == t[key], key


def run_both(step, reference, data):
    """Call the compiled step and the eager reference on each batch; return both outputs."""
    return [(step(*b), reference(*b)) for b in data]


# -- the CPU path ---------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path needs a machine without CUDA")
def test_without_cuda_the_step_runs_as_written():
    a, b = twins()
    step = compile_step(plain_step(*a))
    reference = plain_step(*b)
    for got, want in run_both(step, reference, batches(4)):
        assert torch.equal(got, want)
    assert (step.captures, step.replays, step.warmups) == (0, 0, 0)
    assert step.uncaptured_reason == erase_fx.step.NO_CUDA
    assert_same_training(a, b)


# -- the state machine ----------------------------------------------------------


def test_warm_up_then_capture_and_replay_for_the_same_call(fake_cuda):
    a, b = twins()
    step = compile_step(plain_step(*a), warmup=2)
    reference = plain_step(*b)
    data = batches(6)
    counts = []
    for x, y in data:
        got, want = step(x, y), reference(x, y)
        assert torch.equal(got, want)
        counts.append((step.warmups, step.captures, step.replays))
        assert step.uncaptured_reason is None
    assert counts == [(1, 0, 0), (2, 0, 0), (2, 1, 1), (2, 1, 2), (2, 1, 3), (2, 1, 4)]
    assert_same_training(a, b)  # BN statistics and momentum advanced once per call


def test_outputs_are_fresh_copies(fake_cuda):
    (model, opt), _ = twins()

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        return {"loss": loss, "scaled": [2 * loss.detach()], "tag": "train"}

    compiled = compile_step(step, warmup=1)
    data = batches(4)
    compiled(*data[0])
    first = compiled(*data[1])  # captured and replayed
    kept = first["loss"].clone()
    second = compiled(*data[2])
    assert compiled.replays == 2
    assert torch.equal(first["loss"], kept)  # not overwritten by the next replay
    assert first["tag"] == "train" and torch.equal(second["scaled"][0], 2 * second["loss"])
    (entry,) = compiled._entries.values()
    assert all(o.data_ptr() != t.data_ptr() for o in entry.outputs
               if isinstance(o, torch.Tensor) for t in (first["loss"], second["loss"]))


def test_a_new_signature_is_captured_apart_and_both_replay(fake_cuda):
    a, b = twins()
    step = compile_step(plain_step(*a), warmup=1)
    reference = plain_step(*b)
    big, small = batches(5, batch=8), batches(5, batch=4, seed=2)
    data = [big[0], big[1], small[0], small[1], big[2], small[2], big[3], small[3]]
    for got, want in run_both(step, reference, data):
        assert torch.equal(got, want)
    assert step.captures == 2 and step.replays == 6
    assert_same_training(a, b)  # .grad put back when the other graph last wrote it


def test_a_python_argument_is_part_of_the_signature(fake_cuda):
    a, b = twins()

    def weighted(model, opt):
        def step(x, y, weight):
            opt.zero_grad(set_to_none=True)
            loss = weight * model(x, y)
            loss.backward()
            opt.step()
            return loss
        return step

    step = compile_step(weighted(*a), warmup=1)
    reference = weighted(*b)
    data = batches(6)
    for i, (x, y) in enumerate(data):
        weight = 1.0 if i < 3 else 0.5
        assert torch.equal(step(x, y, weight), reference(x, y, weight))
    assert step.captures == 2
    assert_same_training(a, b)


def test_beyond_max_captures_calls_run_uncaptured_with_the_reason_logged_once(fake_cuda, caplog):
    a, b = twins()
    step = compile_step(plain_step(*a), warmup=1, max_captures=1)
    reference = plain_step(*b)
    big, small = batches(4, batch=8), batches(4, batch=4, seed=2)
    reasons = []
    with caplog.at_level(logging.WARNING, logger="erase_fx.step"):
        for pair in zip(big, small):
            for x, y in pair:
                assert torch.equal(step(x, y), reference(x, y))
                reasons.append(step.uncaptured_reason)
    # big: warm-up, capture, replay, replay; small: warm-up (no capture yet), then over the bound
    assert reasons[0::2] == [None] * 4 and reasons[1] is None
    assert all("max_captures=1 reached" in r for r in reasons[3::2])
    assert step.captures == 1 and step.replays == 3
    assert sum("max_captures=1 reached" in r.getMessage() for r in caplog.records) == 1
    assert_same_training(a, b)


def test_max_captures_zero_never_captures(fake_cuda):
    a, b = twins()
    step = compile_step(plain_step(*a), max_captures=0)
    reference = plain_step(*b)
    for got, want in run_both(step, reference, batches(3)):
        assert torch.equal(got, want)
    assert (step.warmups, step.captures) == (0, 0)
    assert_same_training(a, b)


def test_arguments_the_step_mutates_are_copied_back(fake_cuda):
    (model, opt), _ = twins()

    def step(x, y, seen):
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
        seen.add_(1)

    compiled = compile_step(step, warmup=1)
    seen = torch.zeros(())
    for x, y in batches(4):
        compiled(x, y, seen)
    assert compiled.replays == 3 and seen.item() == 4


def test_arguments_that_cannot_be_captured_run_uncaptured(fake_cuda):
    (model, opt), _ = twins()

    class Batch:
        def __init__(self, x, y):
            self.x, self.y = x, y

    def step(batch):
        opt.zero_grad(set_to_none=True)
        model(batch.x, batch.y).backward()
        opt.step()

    compiled = compile_step(step, warmup=1)
    for x, y in batches(3):
        compiled(Batch(x, y))
    assert compiled.captures == 0 and "neither a tensor nor a plain value" in \
        compiled.uncaptured_reason
    x, y = batches(1)[0]
    grad_step = compile_step(lambda x, y: model(x, y).backward(), warmup=1)
    grad_step(x.requires_grad_(), y)
    assert "requires grad" in grad_step.uncaptured_reason


def test_the_cuda_malloc_async_allocator_runs_the_step_as_written(fake_cuda, monkeypatch, caplog):
    """Under cudaMallocAsync a capture can abort the process: never captured, exact, said why."""
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    a, b = twins()
    step = compile_step(plain_step(*a), warmup=1)
    reference = plain_step(*b)
    with caplog.at_level(logging.WARNING, logger="erase_fx.step"):
        for got, want in run_both(step, reference, batches(4)):
            assert torch.equal(got, want)
    assert (step.warmups, step.captures, step.replays) == (0, 0, 0)
    assert "cudaMallocAsync" in step.uncaptured_reason
    assert "backend at native" in step.uncaptured_reason  # the fix
    assert sum("cudaMallocAsync" in r.getMessage() for r in caplog.records) == 1
    assert_same_training(a, b)
    strict = compile_step(plain_step(*a), on_unsupported="raise")
    with pytest.raises(StepCaptureError, match="cudaMallocAsync"):
        strict(*batches(1)[0])


# -- guards: what Python changed between calls ------------------------------------


def captured(step, data):
    """Run until captured; returns the batches left."""
    data = list(data)
    while step.captures == 0:
        step(*data.pop(0))
    return data


def test_a_moved_parameter_recaptures(fake_cuda):
    a, b = twins()
    step = compile_step(plain_step(*a), warmup=1)
    reference = plain_step(*b)
    data = batches(6)
    for got, want in run_both(step, reference, data[:3]):
        assert torch.equal(got, want)
    for model, _ in (a, b):
        model.first[0].weight.data = model.first[0].weight.data.clone()  # new memory
    for got, want in run_both(step, reference, data[3:]):
        assert torch.equal(got, want)
    assert step.captures == 2 and step.replays == 4  # warm-up, then capture again
    assert_same_training(a, b)


def test_a_reassigned_parameter_or_submodule_recaptures(fake_cuda):
    (model, opt), _ = twins()
    step = compile_step(plain_step(model, opt), warmup=1)
    data = captured(step, batches(8))
    old = model.second[0].weight
    model.second[0].weight = nn.Parameter(old.detach().clone())
    opt.param_groups[0]["params"] = [model.second[0].weight if p is old else p
                                    for p in opt.param_groups[0]["params"]]
    step(*data.pop(0))
    assert step.captures == 1 and step.warmups == 2  # recapturing: warm-up first
    step(*data.pop(0))
    assert step.captures == 2
    model.head = nn.Linear(8, 1)
    step(*data.pop(0))
    assert step.captures == 2 and step.warmups == 3


def test_load_state_dict_in_place_needs_no_recapture(fake_cuda):
    a, b = twins()
    step = compile_step(plain_step(*a), warmup=1)
    reference = plain_step(*b)
    data = batches(6)
    run_both(step, reference, data[:3])
    snapshot = {k: v * 0.5 if v.is_floating_point() else v for k, v in b[0].state_dict().items()}
    for model, _ in (a, b):
        model.load_state_dict(snapshot)  # copies into the same memory
    for got, want in run_both(step, reference, data[3:]):
        assert torch.equal(got, want)
    assert step.captures == 1
    assert_same_training(a, b)


def test_a_new_optimizer_recaptures(fake_cuda):
    (model, opt), (other, other_opt) = twins()
    holder = {"opt": opt}

    def step(x, y):
        holder["opt"].zero_grad(set_to_none=True)
        model(x, y).backward()
        holder["opt"].step()

    compiled = compile_step(step, warmup=1)
    data = batches(6)
    for x, y in data[:3]:
        compiled(x, y)
        plain_step(other, other_opt)(x, y)
    holder["opt"] = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)
    del opt  # the old one is freed
    other_opt = torch.optim.Adam(other.parameters(), lr=0.01, capturable=True)
    for x, y in data[3:]:
        compiled(x, y)
        plain_step(other, other_opt)(x, y)
    assert compiled.captures == 2
    assert_same_training((model, holder["opt"]), (other, other_opt))


OPTIMIZER = None
MODEL = None


def global_step(x, y):
    OPTIMIZER.zero_grad(set_to_none=True)
    MODEL(x, y).backward()
    OPTIMIZER.step()


def test_a_rebound_global_recaptures_even_if_the_old_object_lives(fake_cuda):
    global OPTIMIZER, MODEL
    (MODEL, OPTIMIZER), _ = twins()
    compiled = compile_step(global_step, warmup=1)
    data = captured(compiled, batches(6))
    kept = OPTIMIZER  # still alive: only the name changed
    OPTIMIZER = torch.optim.SGD(MODEL.parameters(), lr=0.05)
    compiled(*data.pop(0))
    compiled(*data.pop(0))
    assert compiled.captures == 2 and kept is not OPTIMIZER
    OPTIMIZER = MODEL = None


def test_a_float_lr_change_recaptures_and_names_the_tensor_lr(fake_cuda, caplog):
    a, b = twins()
    step = compile_step(plain_step(*a), warmup=1)
    reference = plain_step(*b)
    data = batches(7)
    run_both(step, reference, data[:3])
    for _, opt in (a, b):
        opt.param_groups[0]["lr"] = 0.05
    with caplog.at_level(logging.WARNING, logger="erase_fx.step"):
        for got, want in run_both(step, reference, data[3:]):
            assert torch.equal(got, want)
    assert step.captures == 2
    assert any("'lr'] changed from 0.1 to 0.05" in r.getMessage() and "tensor lr" in
               r.getMessage() for r in caplog.records)
    assert_same_training(a, b)


def test_a_tensor_lr_with_capturable_adam_needs_no_recapture(fake_cuda):
    a, b = twins("adam", lr=torch.tensor(0.01), capturable=True)
    step = compile_step(plain_step(*a), warmup=1)
    reference = plain_step(*b)
    for i, (x, y) in enumerate(batches(8)):
        if i == 4:
            for _, opt in (a, b):
                opt.param_groups[0]["lr"].fill_(0.002)
        assert torch.equal(step(x, y), reference(x, y))
    assert step.captures == 1 and step.replays == 7
    assert_same_training(a, b)


def test_train_eval_switch_recaptures(fake_cuda):
    (model, opt), _ = twins()
    step = compile_step(plain_step(model, opt), warmup=1)
    data = captured(step, batches(5))
    model.second.eval()
    step(*data.pop(0))
    step(*data.pop(0))
    assert step.captures == 2


# -- .grad between calls -------------------------------------------------------------


def test_grads_set_to_none_outside_the_step_are_put_back(fake_cuda):
    # the step zeroes with set_to_none=True: a replay rewrites .grad without reading it
    a, b = twins()
    step = compile_step(plain_step(*a), warmup=1)
    reference = plain_step(*b)
    data = batches(6)
    run_both(step, reference, data[:2])
    captured_grads = [p.grad for p in a[0].parameters()]
    for x, y in data[2:]:
        for model, opt in (a, b):
            opt.zero_grad(set_to_none=True)  # outside the step, after it: usual loop shape
        assert torch.equal(step(x, y), reference(x, y))
        assert all(p.grad is g for p, g in zip(a[0].parameters(), captured_grads))
    assert step.captures == 1 and step.replays == 5
    assert_same_training(a, b)


def test_grads_an_accumulating_step_reads_recapture_when_changed_outside(fake_cuda):
    # the step accumulates into .grad across calls; the loop zeroes every other call
    a, b = twins()

    def accumulate(model, opt):
        def step(x, y):
            model(x, y).backward()
        return step

    step = compile_step(accumulate(*a), warmup=1)
    reference = accumulate(*b)
    for i, (x, y) in enumerate(batches(10)):
        step(x, y)
        reference(x, y)
        if i % 3 == 2:
            for model, opt in (a, b):
                opt.step()
                opt.zero_grad(set_to_none=True)
    assert step.captures >= 2
    assert_same_training(a, b)


# -- captures that fail or are refused -------------------------------------------


def item_step(model, opt):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        return loss.item()  # a host sync
    return step


def test_a_failed_capture_restores_state_and_falls_back(fake_cuda, caplog):
    a, b = twins()
    step = compile_step(item_step(*a), warmup=1)
    reference = item_step(*b)
    with caplog.at_level(logging.WARNING, logger="erase_fx.step"):
        for got, want in run_both(step, reference, batches(5)):
            assert got == want
    assert step.captures == 0 and step.warmups == 1
    reason = step.uncaptured_reason
    assert "return loss.item()" in reason and "test_step.py" in reason
    assert "Fix: move host syncs out of the step" in reason
    assert sum("return loss.item()" in r.getMessage() for r in caplog.records) == 1
    assert_same_training(a, b)  # the failed capture left no trace in grads or state


def test_a_failed_capture_raises_under_raise_and_leaves_state_as_before(fake_cuda):
    (model, opt), _ = twins("adam")  # not capturable
    step = compile_step(plain_step(model, opt), warmup=1, on_unsupported="raise")
    data = batches(3)
    step(*data[0])
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    grads = [p.grad for p in model.parameters()]
    with pytest.raises(StepCaptureError, match="capturable=True") as excinfo:
        step(*data[1])
    assert "Fix:" in str(excinfo.value) and "opt.step()" in str(excinfo.value)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    after = (model.state_dict(), opt.state_dict())
    for x, y in zip(before[0].values(), after[0].values()):
        assert torch.equal(x, y)
    assert opt.state_dict()["state"].keys() == before[1]["state"].keys()


def test_adam_without_capturable_falls_back_naming_the_fix(fake_cuda):
    a, b = twins("adam")
    step = compile_step(plain_step(*a), warmup=1)
    reference = plain_step(*b)
    for got, want in run_both(step, reference, batches(4)):
        assert torch.equal(got, want)
    assert "capturable=True" in step.uncaptured_reason
    assert_same_training(a, b)


def test_a_python_branch_on_a_tensor_fails_capture_naming_the_line(fake_cuda):
    a, b = twins()

    def branchy(model, opt):
        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = model(x, y)
            if loss > 100:  # data-dependent Python
                loss = loss / 2
            loss.backward()
            opt.step()
        return step

    step = compile_step(branchy(*a), warmup=1)
    reference = branchy(*b)
    run_both(step, reference, batches(4))
    assert "if loss > 100:" in step.uncaptured_reason
    assert_same_training(a, b)


def test_a_hyperparameter_changed_inside_the_step_refuses_capture(fake_cuda):
    a, b = twins()

    def scheduled(model, opt):
        def step(x, y):
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            opt.step()
            opt.param_groups[0]["lr"] *= 0.9  # a scheduler inside the step
        return step

    step = compile_step(scheduled(*a), warmup=1)
    reference = scheduled(*b)
    run_both(step, reference, batches(4))
    assert step.captures == 0 and "LR scheduler inside the step" in step.uncaptured_reason
    assert_same_training(a, b)


def test_an_optimizer_made_inside_the_step_refuses_capture(fake_cuda):
    (model, _), _ = twins()

    def step(x, y):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()

    compiled = compile_step(step, warmup=1)
    for x, y in batches(3):
        compiled(x, y)
    assert compiled.captures == 0 and "an optimizer made inside the step" in \
        compiled.uncaptured_reason


# -- hooks and erase's own graphs -------------------------------------------------


def test_hooks_are_removed(fake_cuda):
    from torch.nn.modules import module as module_hooks
    from torch.optim import optimizer as optimizer_hooks

    a, _ = twins()
    step = compile_step(plain_step(*a), warmup=2)
    data = batches(4)
    step(*data[0])
    # NB: the module hook stays from the first call to the first capture (Dynamo guards on it)
    assert len(module_hooks._global_forward_pre_hooks) == 1
    assert len(optimizer_hooks._global_optimizer_pre_hooks) == 0
    step(*data[1])
    step(*data[2])
    assert step.captures == 1
    assert len(module_hooks._global_forward_pre_hooks) == 0
    assert len(optimizer_hooks._global_optimizer_pre_hooks) == 0
    assert current_scope() is None


def test_the_modules_that_ran_are_found_by_the_hook(fake_cuda):
    a, _ = twins()
    models = {"net": a[0]}  # not a name the step's code reads: only the hook finds it

    def step(x, y):
        a[1].zero_grad(set_to_none=True)
        models["net"](x, y).backward()
        a[1].step()

    compiled = compile_step(step, warmup=1)
    data = captured(compiled, batches(5))
    a[0].first[1].running_mean = a[0].first[1].running_mean.clone()  # a buffer: not optimized
    compiled(*data.pop(0))
    assert compiled.warmups == 2  # recapturing


def test_erase_graphs_run_as_is_inside_a_step_scope(monkeypatch):
    def no_graph(*args, **kwargs):
        raise AssertionError("erase captured a graph of its own")

    monkeypatch.setattr(torch.cuda, "graph", no_graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_graph)
    monkeypatch.setattr(cudagraphs, "backward_keeps_graph", lambda: False)
    calls = []
    fw = GraphedForward(lambda args: calls.append("fw") or [args[0] * 2],
                        num_user_outputs=1, static_input_indices=[], device=torch.device("cpu"),
                        name="test")
    bw = graph_backward(fw, lambda args: calls.append("bw") or [args[0]], num_saved=0,
                        name="test backward")
    scope = StepScope()
    with scope.entered():
        assert current_scope() is scope
        for _ in range(3):
            (out,) = fw([torch.ones(2)])
            bw([torch.ones(2)])
        # NB: a CUDA backward runs on the autograd engine's thread, where the scope is not
        # current: it goes by what its forward saw
        fw([torch.ones(2)])
        seen = []

        def backward_elsewhere():
            seen.append((current_scope(), bw.unreplayed([torch.ones(2)])))
            bw([torch.ones(2)])

        worker = threading.Thread(target=backward_elsewhere)
        worker.start()
        worker.join()
    assert current_scope() is None and seen == [(None, Unreplayed.INSIDE_CAPTURE)]
    assert fw.graph is None and fw.replays == 0 and bw.graph is None
    assert calls == ["fw", "bw"] * 4 and torch.equal(out, torch.full((2,), 2.0))


# -- options --------------------------------------------------------------------------


def test_options_are_checked():
    with pytest.raises(EraseOptionError, match="warmup"):
        compile_step(lambda: None, warmup=0)
    with pytest.raises(EraseOptionError, match="'fallback' or 'raise'"):
        compile_step(lambda: None, on_unsupported="ignore")
    with pytest.raises(EraseOptionError, match="max_captures"):
        compile_step(lambda: None, max_captures=-1)


def test_decorator_forms():
    @compile_step
    def bare(x):
        """Doc."""
        return x + 1

    @compile_step(warmup=3, max_captures=2)
    def configured(x):
        return x

    assert isinstance(bare, CompiledStep) and bare.__name__ == "bare" and bare.__doc__ == "Doc."
    assert (configured.warmup, configured.max_captures) == (3, 2)
    assert compile_step(bare.fn, on_unsupported="raise").on_unsupported == "raise"


# -- end to end: backend="erase" inside compile_step ------------------------------------


class Chain(nn.Module):
    """Three detached stages with local heads (the kind of model erase schedules early)."""

    def __init__(self, d=8):
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(3))
        self.heads = nn.ModuleList(nn.Linear(d, 1) for _ in range(3))

    def forward(self, x, y):
        loss = 0
        for stage, head in zip(self.stages, self.heads):
            x = stage(x)
            loss = loss + F.mse_loss(head(x), y)
            x = x.detach()
        return loss


def two_model_step(models, opts, compiled, micro_batches=2):
    """Both models, gradient accumulation over micro-batches, one optimizer step each."""
    def step(x, y):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        total = 0
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            for fn in compiled:
                loss = fn(xs, ys)
                loss.backward()
                total = total + loss.detach()
        for opt in opts:
            opt.step()
        return total
    return step


class Fronted(nn.Module):
    """A front layer trained through the first stage's loss, then a detached chain."""

    def __init__(self):
        super().__init__()
        self.front = nn.Linear(8, 6)
        self.chain = Chain(d=6)

    def forward(self, x, y):
        return self.chain(torch.relu(self.front(x)), y)


def erase_training(optimizer, seed=0):
    torch.manual_seed(seed)
    models = [Chain(), Fronted()]
    if optimizer == "sgd":
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    else:
        opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    return models, opts


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path needs a machine without CUDA")
def test_compile_step_over_erase_trains_like_eager(optimizer):
    models, opts = erase_training(optimizer)
    ref_models, ref_opts = erase_training(optimizer)
    for m, r in zip(models, ref_models):
        r.load_state_dict(m.state_dict())
    compiled = [torch.compile(m, backend="erase",
                              options={"inner": "aot_eager", "on_error": "raise"})
                for m in models]
    step = compile_step(two_model_step(models, opts, compiled))
    reference = two_model_step(ref_models, ref_opts, ref_models)
    g = torch.Generator().manual_seed(3)
    with erase_fx.collect_reports() as reports:
        for _ in range(4):
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
            assert torch.equal(step(x, y), reference(x, y))
    assert sum(len(r.blocks) for r in reports) >= 2  # erase did schedule early blocks
    for pair in zip(zip(models, opts), zip(ref_models, ref_opts)):
        (m, o), (r, ro) = pair
        for p, q in zip(m.parameters(), r.parameters()):
            assert torch.equal(p, q)
            for key, value in o.state[p].items():
                assert torch.equal(value, ro.state[q][key]), key


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fake_capture_over_erase_trains_like_eager(fake_cuda, optimizer):
    models, opts = erase_training(optimizer)
    ref_models, ref_opts = erase_training(optimizer)
    for m, r in zip(models, ref_models):
        r.load_state_dict(m.state_dict())
    if optimizer == "adam":
        for o in opts + ref_opts:
            for group in o.param_groups:
                group["capturable"] = True
    compiled = [torch.compile(m, backend="erase",
                              options={"inner": "aot_eager", "on_error": "raise"})
                for m in models]
    step = compile_step(two_model_step(models, opts, compiled))
    reference = two_model_step(ref_models, ref_opts, ref_models)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        assert torch.equal(step(x, y), reference(x, y))
    assert step.captures == 1 and step.replays == 3
    for (m, o), (r, ro) in zip(zip(models, opts), zip(ref_models, ref_opts)):
        for p, q in zip(m.parameters(), r.parameters()):
            assert torch.equal(p, q)
            for key, value in o.state[p].items():
                assert torch.equal(value, ro.state[q][key]), key


class Trainer:
    """A step as a method: its attributes are guards too."""

    def __init__(self):
        (self.model, self.opt), _ = twins()
        self.steps = 0
        self.scale = 1.0

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        (self.scale * self.model(x, y)).backward()
        self.opt.step()

    def counting_step(self, x, y):
        self.step(x, y)
        self.steps += 1  # Python state a replay would not advance


def test_a_bound_method_step_guards_its_attributes(fake_cuda):
    trainer = Trainer()
    step = compile_step(trainer.step, warmup=1)
    data = captured(step, batches(6))
    step(*data.pop(0))
    trainer.scale = 0.5
    step(*data.pop(0))
    assert step.warmups == 2  # 'scale' changed: recapturing
    counting = compile_step(trainer.counting_step, warmup=1)
    for x, y in batches(3):
        counting(x, y)
    assert counting.captures == 0 and "assigns 'steps'" in counting.uncaptured_reason
    assert trainer.steps == 3  # the refused capture's increment was undone
    names = {b.key for b in bindings_of(trainer.counting_step)}
    assert {"steps", "model", "opt", "scale"} <= names  # self.step() followed


def test_gradscaler_falls_back_and_its_state_is_restored(fake_cuda):
    # GradScaler's inf check syncs with the host; the failed capture has already marked the
    # optimizer unscaled: left so, the fallback would skip unscaling and step scaled grads
    a, b = twins()
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]

    def scaled(model, opt, scaler):
        def step(x, y):
            opt.zero_grad(set_to_none=True)
            scaler.scale(model(x, y)).backward()
            scaler.step(opt)
            scaler.update()
        return step

    step = compile_step(scaled(*a, scalers[0]), warmup=1)
    reference = scaled(*b, scalers[1])
    run_both(step, reference, batches(4))
    assert step.captures == 0 and "Fix: move host syncs" in step.uncaptured_reason
    assert_same_training(a, b)
    assert scalers[0].get_scale() == scalers[1].get_scale()


def test_a_step_that_is_a_modules_method_guards_its_submodules(fake_cuda):
    class Learner(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net()
            self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)

        def training_step(self, x, y):
            self.opt.zero_grad(set_to_none=True)
            self.net(x, y).backward()
            self.opt.step()

    learner = Learner()
    names = {b.key for b in bindings_of(learner.training_step)}
    assert {"net", "opt"} <= names
