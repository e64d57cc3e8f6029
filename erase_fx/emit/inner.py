"""The inner compilers: what turns one FX graph (a segment, the backward) into a callable.

Every compiled callable uses the boxed calling convention of AOTAutograd: it
takes one list of arguments (which it may clear to free inputs early) and
returns a tuple or list of outputs.

- ``inductor``: ``compile_fx_inner``, called from stock Inductor's own
  ``compile_fx`` (erase_fx is its inner compiler: see
  `erase_fx.emit.inductor_route`); a forward with early blocks compiles
  segment by segment (`erase_fx.emit.inductor_segments`).
- ``aot_eager``: the graph's own FX code, as torch's ``aot_eager`` runs it.
- ``eager``: ``torch.fx.Interpreter``, node by node: slow, but an error or a
  breakpoint points at the aten node.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import make_boxed_func

from erase_fx.passes.graph import output_node, output_values

BoxedCallable = Callable[[list[Any]], Any]


class Boxed:
    """Base of erase_fx's compiled callables: AOTAutograd's boxed calling convention.

    AOTAutograd calls a callable with ``_boxed_call`` set with one list of
    arguments, which the callee may clear to free the inputs early.
    """

    def __init__(self) -> None:
        # NB: an instance attribute: wrappers such as torch._dynamo.disable copy
        # the instance __dict__, not class attributes, and AOT reads this flag.
        self._boxed_call = True


def decompositions_for(inner: str) -> dict[Any, Any] | None:
    """The decomposition table AOTAutograd traces with, for an inner compiler."""
    if inner == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    return None


def compile_graph(
    gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str, **inductor_kwargs: Any
) -> BoxedCallable:
    """Compile a whole graph: the backward, an inference graph, a forward with no early block.

    ``inductor_kwargs`` are those stock Inductor's ``compile_fx`` passes to
    its inner compiler (``static_input_idxs``, ``is_backward``,
    ``is_inference``, ``cudagraphs``, ...); erase_fx passes them on
    unchanged, so a graph it schedules nothing in compiles as stock.
    """
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx_inner

        return compile_fx_inner(gm, list(example_inputs), **inductor_kwargs)
    return _compile_eagerly(gm, inner)


def compile_segment(gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str) -> BoxedCallable:
    """Compile one forward segment with a non-Inductor inner compiler (a graph returning a tuple).

    Inductor segments are compiled together, by `compile_inductor_segments`,
    which keeps the whole forward's layout decisions.
    """
    if inner == "inductor":
        raise ValueError("Inductor segments are compiled by compile_inductor_segments")
    return _compile_eagerly(gm, inner)


def _compile_eagerly(gm: fx.GraphModule, inner: str) -> BoxedCallable:
    if inner == "eager":
        interpreter = fx.Interpreter(gm)

        def run(args: list[Any]) -> Any:
            return interpreter.boxed_run(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run
    return make_boxed_func(gm.forward)


def mark_outputs_user_visible(gm: fx.GraphModule, indices: Sequence[int] | None = None) -> None:
    """Say which outputs Inductor must give the strides of the FX graph (default: all)."""
    out = output_node(gm.graph)
    if indices is None:
        indices = [i for i, value in enumerate(output_values(gm.graph))
                   if isinstance(value, fx.Node)]
    out.meta["user_visible_output_idxs"] = list(indices)


def example_inputs_of(gm: fx.GraphModule) -> list[Any]:
    """The example values of a graph's placeholders (fake tensors, SymInts)."""
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if value is None and "example_value" in node.meta:
            value = node.meta["example_value"]
        values.append(value)
    return values


def has_symbolic_shapes(example_inputs: Sequence[Any]) -> bool:
    """Whether any example input is a SymInt or a tensor of symbolic size or strides."""
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(
                isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride())):
            return True
    return False


def cuda_device_of(example_inputs: Sequence[Any]) -> torch.device | None:
    """The CUDA device the graph runs on, or None for a CPU graph."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return value.device
    return None


def stream_capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (False without
    CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
