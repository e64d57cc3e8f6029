"""A CUDA graph and CUDA's streams on CPU, for compile_step's tests (`fake_cuda`).

The stand-in (`FakeGraph`) behaves like a CUDA graph where it matters to
compile_step: a capture records every aten op the step runs (a
`TorchDispatchMode`) and then undoes their effect on tensors that existed
before it (a real capture executes nothing); a replay runs the recorded ops
again on the same tensor objects and writes each result into the tensor the
capture produced (the graph's memory), so ``.grad`` tensors, optimizer state
and BatchNorm statistics behave as under a real replay, and a host sync
(``.item()``) under capture raises as CUDA does.
"""
from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from erase_fx.step import arguments as step_arguments

aten = torch.ops.aten

SYNC_ERROR = "CUDA error: operation not permitted when stream is capturing"


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class FakeGraph:
    """Records a step's aten ops at capture; replays them into the same tensors."""

    capturing: FakeGraph | None = None

    def __init__(self):
        self.ops = []
        self.replays = 0

    def replay(self):
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                result = func(*args, **kwargs)
                returns = func._schema.returns
                outs = list(out) if isinstance(out, (list, tuple)) else [out]
                results = list(result) if isinstance(result, (list, tuple)) else [result]
                for spec, o, r in zip(returns, outs, results):
                    if spec.alias_info is None:  # a fresh output: graph memory
                        for a, b in zip(_tensors(o), _tensors(r)):
                            a.copy_(b)
        self.replays += 1


class _Recorder(TorchDispatchMode):
    """Record ops into a FakeGraph; keep the first value of every tensor older than the capture
    that an op reads or writes, to put it back at the end (a capture executes nothing).

    NB: every such tensor, not only those the schema marks written: native_batch_norm
    updates the running statistics without saying so.
    """

    def __init__(self, graph):
        super().__init__()
        self.graph = graph
        self.made: set[int] = set()
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._local_scalar_dense.default, aten.is_nonzero.default):
            raise RuntimeError(SYNC_ERROR)
        for t in _tensors(list(args) + list(kwargs.values())):
            if t.untyped_storage().data_ptr() not in self.made and id(t) not in self.saved:
                self.saved[id(t)] = (t, t.clone())
        out = func(*args, **kwargs)
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        for spec, o in zip(func._schema.returns, outs):
            if spec.alias_info is None:
                self.made.update(t.untyped_storage().data_ptr() for t in _tensors(o))
        self.graph.ops.append((func, args, kwargs, out))
        return out

    def roll_back(self):
        with torch.no_grad():
            for t, value in self.saved.values():
                t.copy_(value)


@contextlib.contextmanager
def fake_capture(graph, pool=None, stream=None, capture_error_mode="global"):
    recorder = _Recorder(graph)
    FakeGraph.capturing = graph
    try:
        with recorder:
            yield
    finally:
        FakeGraph.capturing = None
        recorder.roll_back()


class FakeStream:
    def wait_stream(self, other):
        pass


def _health_check(self):
    """torch's check, as on CUDA: a non-capturable optimizer may not step under capture."""
    if FakeGraph.capturing is not None and not all(g["capturable"] for g in self.param_groups):
        raise RuntimeError(f"Attempting CUDA graph capture of step() for an instance of "
                           f"{type(self).__name__} but param_groups' capturable is False.")


# NB: raised from torch's optimizer module on CUDA: the failure report names the user's line
# that called it, not torch's, so the stand-in claims torch's file too.
_health_check.__code__ = _health_check.__code__.replace(
    co_filename=importlib.import_module("torch.optim.optimizer").__file__)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as compile_step sees it on a GPU, with `FakeGraph` for graphs."""
    # NB: not torch.cuda.is_available itself: Dynamo would then save CUDA's RNG state
    monkeypatch.setattr(step_arguments, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing",
                        lambda: FakeGraph.capturing is not None)
    monkeypatch.setattr(step_arguments, "on_cuda", lambda t: True)
    monkeypatch.setattr(torch.optim.Optimizer, "_accelerator_graph_capture_health_check",
                        _health_check)
    # NB: capturable Adam checks its device; CPU stands in for CUDA here
    monkeypatch.setattr(importlib.import_module("torch.optim.adam"),
                        "_get_capturable_supported_devices",
                        lambda *a, **k: ["cuda", "cpu"])
    yield
    FakeGraph.capturing = None
