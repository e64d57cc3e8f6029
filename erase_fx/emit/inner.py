"""The inner compilers: what turns one FX graph (a segment, the backward) into a callable.

Every compiled callable uses the boxed calling convention of AOTAutograd: it
takes one list of arguments (which it may clear to free inputs early) and
returns a tuple or list of outputs.

- ``inductor``: ``compile_fx_inner``, one Inductor graph per segment. Each
  segment compiles inside its own ``TracingContext.report_output_strides()``
  (``compile_fx_inner`` reports into that list), and every segment output is
  marked user-visible so Inductor gives it the strides of the FX graph: the
  next segment and the backward were traced with those strides.
- ``aot_eager``: the graph's own FX code, as torch's ``aot_eager`` runs it.
- ``eager``: ``torch.fx.Interpreter``, node by node: slow, but an error or a
  breakpoint points at the aten node.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import make_boxed_func

from erase_fx.passes.graph import output_node, output_values

BoxedCallable = Callable[[list[Any]], Any]


def decompositions_for(inner: str) -> dict[Any, Any] | None:
    """The decomposition table AOTAutograd traces with, for an inner compiler."""
    if inner == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    return None


def run_stock_joint_passes(gm: fx.GraphModule, inner: str) -> fx.GraphModule:
    """The joint-graph passes the stock path of this inner compiler runs (in place).

    Inductor runs its pattern-matcher passes on the joint graph before
    partitioning; erase_fx does the same, before its own analysis, so that
    it analyses the graph that will be compiled.
    """
    if inner != "inductor":
        return gm
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    result = joint_graph_passes(gm)
    return result if isinstance(result, fx.GraphModule) else gm


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    inner: str,
    *,
    is_backward: bool = False,
    is_inference: bool = False,
) -> BoxedCallable:
    """Compile a whole graph (the backward, an inference graph, a stock forward)."""
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx_inner

        kwargs: dict[str, Any] = {"is_backward": is_backward}
        if is_inference:
            kwargs["is_inference"] = True
        _mark_outputs_user_visible(gm)
        return compile_fx_inner(gm, list(example_inputs), **kwargs)
    return _compile_eagerly(gm, inner)


def compile_segment(gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str) -> BoxedCallable:
    """Compile one forward segment (a graph returning a tuple)."""
    if inner == "inductor":
        from torch._guards import TracingContext
        from torch._inductor.compile_fx import compile_fx_inner

        _mark_outputs_user_visible(gm)
        # NB: AOT opened report_output_strides() for one forward compile and
        # compile_fx_inner appends to it; each segment gets its own list, so
        # the outer one stays empty and AOT keeps the FX strides for the
        # backward (which the user-visible outputs above guarantee).
        context = TracingContext.try_get()
        scope = TracingContext.report_output_strides() if context else contextlib.nullcontext()
        with scope:
            return compile_fx_inner(gm, list(example_inputs))
    return _compile_eagerly(gm, inner)


def _compile_eagerly(gm: fx.GraphModule, inner: str) -> BoxedCallable:
    if inner == "eager":
        interpreter = fx.Interpreter(gm)

        def run(args: list[Any]) -> Any:
            return interpreter.boxed_run(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run
    return make_boxed_func(gm.forward)


def _mark_outputs_user_visible(gm: fx.GraphModule) -> None:
    out = output_node(gm.graph)
    out.meta["user_visible_output_idxs"] = [
        i for i, value in enumerate(output_values(gm.graph)) if isinstance(value, fx.Node)
    ]


def example_inputs_of(gm: fx.GraphModule) -> list[Any]:
    """The example values of a graph's placeholders (fake tensors, SymInts)."""
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if value is None and "example_value" in node.meta:
            value = node.meta["example_value"]
        values.append(value)
    return values


def cuda_device_of(example_inputs: Sequence[Any]) -> torch.device | None:
    """The CUDA device the graph runs on, or None for a CPU graph."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return value.device
    return None
