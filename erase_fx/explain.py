"""``erase_fx.explain``: what the erase backend would do with a model, without training it."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from erase_fx.backend import make_backend
from erase_fx.config import EraseConfig
from erase_fx.errors import EraseError
from erase_fx.graph_breaks import graph_break_of
from erase_fx.instruments import dump_instrument_for
from erase_fx.report import GraphReport, collect_reports

#: Dynamo's limits on versions of one function's compiled code. Each explain
#: call compiles one more version of the model's forward (its backend is a new
#: one): past the limit Dynamo would run it eagerly and explain would see no graph.
_RECOMPILE_LIMITS = ("recompile_limit", "accumulated_recompile_limit")


def explain(
    model: Any,
    *example_args: Any,
    erase_options: Mapping[str, Any] | None = None,
    **example_kwargs: Any,
) -> list[GraphReport]:
    """Compile ``model`` on the example inputs and return one report per compiled graph.

    Runs one forward of the model under ``torch.compile(backend="erase")``
    with the ``aot_eager`` inner compiler: the blocks found do not depend on
    the inner compiler's code generation, and nothing is compiled to machine
    code. No backward, no optimizer step. CPU inputs are fine.

    The model itself runs, not a copy (a copy cannot always be made: a
    module holding an ``autograd.Function`` instance cannot be pickled), and
    what that forward changes is put back afterwards (`_state_kept`): its
    parameters' and buffers' values (BatchNorm's running statistics), the
    attributes its modules' forwards set (a tensor kept for logging, a
    counter, a list appended to) and the random number generators (dropout).
    What the forward or its hooks change outside the model's modules (a
    list a hook appends to, a global) is not put back. A model with lazy
    parameters not yet initialized (``nn.LazyLinear``) is refused with
    `EraseError`: its first forward turns its lazy modules into others.

    Each `GraphReport` lists the early blocks (parameters, ready point,
    stream, node count, estimated FLOPs) and the components left in the
    backward, with the reason; where Dynamo ended the graph at a graph break
    (a ``Tensor.item()``, a data-dependent op, a call it cannot trace), its
    ``graph_break`` says where in the user's code and why.

    ``erase_options`` are `EraseConfig` fields (e.g. ``{"streams": 2}``);
    every other keyword argument goes to the model.

    Raises `EraseError` if Dynamo compiled no graph (it ran the whole
    forward eagerly), rather than returning an empty list.
    """
    options = {"inner": "aot_eager", **(erase_options or {})}
    dump_dir = EraseConfig.from_options(options).dump_dir
    with collect_reports() as reports, _state_kept(model), torch.enable_grad(), \
            _unlimited_recompiles():
        backend = _noting_graph_breaks(make_backend(**options), reports, dump_dir)
        torch.compile(model, backend=backend)(*example_args, **example_kwargs)
    if not reports:
        raise EraseError("explain", "torch.compile produced no graph for this model: Dynamo "
                         "ran its forward eagerly", fix="see why with "
                         "TORCH_LOGS=graph_breaks,recompiles")
    return list(reports)


def _noting_graph_breaks(backend: Callable[..., Any], reports: list[GraphReport],
                         dump_dir: str | None) -> Any:
    """``backend``, each report it publishes given the graph break that ended its graph (in
    the dump's ``report.json`` too, with a ``dump_dir``)."""

    def compile_noting_graph_break(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        first = len(reports)
        compiled = backend(gm, example_inputs)
        graph_break = graph_break_of(gm)
        if graph_break is not None:
            reports[first:] = [dataclasses.replace(report, graph_break=graph_break)
                               for report in reports[first:]]
            for report in reports[first:]:
                dump = dump_instrument_for(dump_dir, report.graph_id)
                if dump is not None:
                    dump.write_report(report)
        return compiled

    return compile_noting_graph_break


@contextlib.contextmanager
def _unlimited_recompiles() -> Iterator[None]:
    """Lift Dynamo's recompile limits for one explain call (see `_RECOMPILE_LIMITS`)."""
    config = torch._dynamo.config
    limits = {name: 1 << 30 for name in _RECOMPILE_LIMITS if hasattr(config, name)}
    with config.patch(**limits):
        yield


# -- the model as it was: what one forward changes, put back ---------------------


@contextlib.contextmanager
def _state_kept(model: Any) -> Iterator[None]:
    """Inside: anything; after: ``model``'s tensors, module attributes and the random number
    generators as they were before (see `explain`)."""
    root = _root_module(model)
    modules = list(root.modules()) if root is not None else []
    _refuse_lazy_parameters(modules)
    tensors = _TensorValues(modules)
    attributes = [_ModuleAttributes(module) for module in modules]
    with torch.random.fork_rng(devices=_cuda_devices()):
        try:
            yield
        finally:
            for kept in attributes:
                kept.restore()
            tensors.restore()


def _refuse_lazy_parameters(modules: list[torch.nn.Module]) -> None:
    """Raise `EraseError` for a model with uninitialized lazy parameters (``nn.LazyLinear``):
    its first forward turns the lazy modules into others, which cannot be put back."""
    from torch.nn.parameter import is_lazy

    for module in modules:
        for name, tensor in (*module._parameters.items(), *module._buffers.items()):
            if tensor is not None and is_lazy(tensor):
                raise EraseError(
                    "explain", f"the model has an uninitialized lazy parameter or buffer "
                               f"({type(module).__name__}.{name}); its first forward would "
                               "initialize it, which explain cannot undo",
                    fix="run one forward of the model on a batch before explaining it")


def _cuda_devices() -> list[int]:
    """The CUDA devices whose random number generators a forward may draw from."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


def _root_module(model: Any) -> torch.nn.Module | None:
    """The module whose state a call of ``model`` may change: the model, or the module a bound
    method belongs to (``model.forward``); None for a plain function."""
    if isinstance(model, torch.nn.Module):
        return model
    owner = getattr(model, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


class _TensorValues:
    """The values of every parameter and buffer of some modules, to put back after a forward.

    NB: a tensor is written back only where it changed (its version counter
    moved, or its values differ: a write through ``.data`` moves no
    counter), so an unchanged parameter keeps its version and the graphs
    of the user that saved it still run their backward.
    """

    def __init__(self, modules: list[torch.nn.Module]):
        seen: dict[int, torch.Tensor] = {}
        for module in modules:
            for tensor in (*module._parameters.values(), *module._buffers.values()):
                if isinstance(tensor, torch.Tensor):
                    seen.setdefault(id(tensor), tensor)
        self.kept = [(t, _version_of(t), t.detach().clone()) for t in seen.values()]

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, version, value in self.kept:
                if tensor.shape != value.shape:  # resized in place: its old memory is gone
                    tensor.data = value
                elif _version_of(tensor) != version or not torch.equal(tensor.detach(), value):
                    tensor.copy_(value)


def _version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter; None for an inference tensor, which keeps none."""
    try:
        return tensor._version
    except RuntimeError:
        return None


class _ModuleAttributes:
    """A module's attributes, and the contents of those that are lists, dicts or sets (and of
    its parameter, buffer and submodule tables), to put back after a forward."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.attributes = dict(vars(module))
        self.contents = {name: _shallow_copy(value) for name, value in self.attributes.items()
                         if isinstance(value, (list, dict, set))}

    def restore(self) -> None:
        current = vars(self.module)
        for name in set(current) - set(self.attributes):
            del current[name]
        current.update(self.attributes)
        for name, contents in self.contents.items():
            _refill(self.attributes[name], contents)


def _shallow_copy(value: list | dict | set) -> list | dict | set:
    if isinstance(value, list):
        return list(value)
    return dict(value) if isinstance(value, dict) else set(value)


def _refill(container: list | dict | set, contents: list | dict | set) -> None:
    """Put ``contents`` back into ``container`` in place (those holding it see them too)."""
    if isinstance(container, list):
        container[:] = contents
        return
    container.clear()
    container.update(contents)  # type: ignore[arg-type]
