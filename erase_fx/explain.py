"""``erase_fx.explain``: what the erase backend would do with a model, without training it."""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from erase_fx.backend import make_backend
from erase_fx.errors import EraseError
from erase_fx.report import GraphReport, collect_reports

#: Dynamo's limits on versions of one function's compiled code. Each explain
#: call compiles a fresh copy of the model, one more version of its forward:
#: past the limit Dynamo would run it eagerly and explain would see no graph.
_RECOMPILE_LIMITS = ("recompile_limit", "accumulated_recompile_limit")


def explain(
    model: Any,
    *example_args: Any,
    erase_options: Mapping[str, Any] | None = None,
    **example_kwargs: Any,
) -> list[GraphReport]:
    """Compile ``model`` on the example inputs and return one report per compiled graph.

    Runs one forward of a deep copy of the model (so the model itself, its
    buffers included, is untouched) under ``torch.compile(backend="erase")``
    with the ``aot_eager`` inner compiler: the blocks found do not depend on
    the inner compiler's code generation, and nothing is compiled to machine
    code. No backward, no optimizer step. CPU inputs are fine.

    Each `GraphReport` lists the early blocks (parameters, ready point,
    stream, node count, estimated FLOPs) and the components left in the
    backward, with the reason.

    ``erase_options`` are `EraseConfig` fields (e.g. ``{"streams": 2}``);
    every other keyword argument goes to the model.

    Raises `EraseError` if Dynamo compiled no graph (it ran the whole
    forward eagerly), rather than returning an empty list.
    """
    subject = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model
    options = {"inner": "aot_eager", **(erase_options or {})}
    compiled = torch.compile(subject, backend=make_backend(**options))
    with collect_reports() as reports, torch.enable_grad(), _unlimited_recompiles():
        compiled(*example_args, **example_kwargs)
    if not reports:
        raise EraseError("explain", "torch.compile produced no graph for this model: Dynamo "
                         "ran its forward eagerly", fix="see why with "
                         "TORCH_LOGS=graph_breaks,recompiles")
    return list(reports)


@contextlib.contextmanager
def _unlimited_recompiles() -> Iterator[None]:
    """Lift Dynamo's recompile limits for one explain call (see `_RECOMPILE_LIMITS`)."""
    config = torch._dynamo.config
    limits = {name: 1 << 30 for name in _RECOMPILE_LIMITS if hasattr(config, name)}
    with config.patch(**limits):
        yield
