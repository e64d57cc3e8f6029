"""``erase_fx.explain``: what the erase backend would do with a model, without training it."""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from erase_fx.backend import make_backend
from erase_fx.report import GraphReport, collect_reports


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
    """
    subject = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model
    options = {"inner": "aot_eager", **(erase_options or {})}
    compiled = torch.compile(subject, backend=make_backend(**options))
    with collect_reports() as reports, torch.enable_grad():
        compiled(*example_args, **example_kwargs)
    return list(reports)
