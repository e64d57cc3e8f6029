"""The ``erase`` torch.compile backend.

``torch.compile(model, backend="erase", options={...})`` calls
`erase_backend` once per graph Dynamo captures (the ``torch_dynamo_backends``
entry point makes the name known after ``pip install``). It builds an
AOTAutograd backend whose partition function and compilers are those of a
`GraphCompilation`, and returns the compiled callable.

NB: torch's ``aot_autograd(...)`` object drops keyword arguments it is called
with, so ``options`` would be lost if it were registered directly; this plain
function takes them and builds ``aot_autograd`` itself.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd

from erase_fx.compilation import GraphCompilation, input_names
from erase_fx.config import EraseConfig
from erase_fx.emit import decompositions_for
from erase_fx.errors import EraseOptionError
from erase_fx.report import publish

_graph_ids = itertools.count()


def erase_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Any:
    """Compile one Dynamo graph with early backward scheduling.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs.
        options: `EraseConfig` fields, from ``torch.compile(..., options=...)``.
        mode: not supported: erase_fx has no modes; settings go in ``options``.
    """
    if mode is not None:
        raise EraseOptionError("mode", mode,
                               "no mode: erase_fx takes its settings in options={...}")
    cfg = EraseConfig.from_options(options)
    compilation = GraphCompilation(cfg, next(_graph_ids), input_names(gm))
    backend = aot_autograd(
        fw_compiler=compilation.compile_forward,
        bw_compiler=compilation.compile_backward,
        inference_compiler=compilation.compile_inference,
        partition_fn=compilation.partition,
        decompositions=decompositions_for(cfg.inner),
        keep_inference_input_mutations=True,
    )
    compiled = backend(gm, example_inputs)
    report = compilation.finish()
    publish(report)
    if not compilation.has_early_blocks:
        return compiled
    return _guarded(compiled, compilation)


def _guarded(compiled: Any, compilation: GraphCompilation) -> Any:
    """The compiled callable, raising clear errors on backward uses erase_fx cannot run."""

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        outputs = compiled(*args)
        compilation.guard_backward(outputs)
        return outputs

    # NB: like AOTAutograd's own result, Dynamo must not trace into this wrapper.
    return torch._dynamo.disable(run)


def make_backend(**options: Any) -> Any:
    """``erase_backend`` with options bound, for ``torch.compile(backend=make_backend(...))``."""
    EraseConfig.from_options(options)  # fail early on bad options
    return functools.partial(erase_backend, options=options)
