"""Inductor segments that keep what Inductor decided for the whole forward.

A forward with early blocks is split into per-stream segments
(`erase_fx.passes.split_segments`), and each segment is one
``compile_fx_inner`` call. Compiled one by one without care, the segments
would each make decisions stock Inductor makes once for the whole forward,
and lose to it (measured on torchvision conv nets: channels-last decided per
segment, and every tensor crossing a boundary forced back to the strides of
the FX graph, each a copy). So:

- **One layout decision.** ``GraphLowering.decide_layout_opt`` is asked once,
  about the whole forward, and every segment compiles with that answer
  (``layout_opt=``), as the whole graph would have.
- **Strides flow between segments.** Only the outputs stock Inductor keeps
  unpadded (the user-visible outputs of the forward) and the early values
  (below) are marked so in the segment that makes them. Every other segment output gets
  the layout Inductor prefers; ``compile_fx_inner`` reports it
  (``TracingContext.report_output_strides``), and each later segment that
  reads the tensor is compiled for exactly those strides (its example input
  re-strided to them). The forward's saved tensors are reported to
  AOTAutograd in the same way a whole-graph compile reports them, so the
  backward is compiled for the strides the forward really produces.
- **Early values are never padded.** An early gradient leaves the forward
  as a saved tensor and reaches ``.grad`` through the backward unchanged, so
  it must be dense, as the backward's own outputs are in stock Inductor:
  otherwise Inductor pads its rows on a GPU (``comprehensive_padding``),
  and then AccumulateGrad copies it and erase_fx cannot scale it in place (a
  copy of every early gradient at every step, measured as 0.54 -> 0.66 ms on
  an H200 chain). `keep_early_values_at_fx_strides` marks every
  early-backward value the forward returns as user-visible, before the
  forward compiles (whole or in segments). A user-visible output keeps the
  layout of its segment's FX graph, which follows the segment's (re-strided)
  inputs, so it too is reported as made. Inductor's FX graph cache keys a
  graph by its code, not its user-visible outputs: a cached segment whose
  visible outputs come back padded is compiled again without the cache.
- **Early values keep eager's memory format.** Inductor re-derives a
  segment's FX strides from its re-strided inputs, so a convolution's weight
  gradient read from a channels-last activation comes out channels-last
  (seen on an H200, DGL ResNet-18), while its parameter is contiguous:
  AccumulateGrad then copies it into ``.grad`` at the end of the backward, on
  the main stream, at every step (and the early optimizer update cannot take
  it). `pin_early_outputs_to_fx_layout` returns each early gradient through a
  ``clone`` to the memory format of its FX strides, the strides eager makes:
  the conversion runs inside the segment, on its side stream, early.
  Inductor removes the clone where the strides already agree
  (``remove_noop_ops``), so it costs nothing there.
- **Large in-place writes on side streams.** Under capture each side
  stream keeps a memory pool of its own, as large as its segments' peak; a
  side-stream segment compiles inside `inplace_fusion.keep_inplace_writes`
  (`Tuning.keep_inplace_writes`), which refuses the fusions that would
  keep Inductor from writing a large value over its input (a local loss's
  logits and their gradient).
- **Dynamic shapes** (symbolic sizes or strides): every segment output keeps
  the FX strides, the simple rule that needs no symbolic stride algebra.
- **Unbacked sizes** (a boolean mask's row count, under
  ``capture_dynamic_output_shape_ops``), in a graph whose inputs are static:
  a segment returns the size itself (a SymInt) to the segments that read it,
  and Inductor reports no strides for it, nor for a tensor whose strides
  hold it, as in a whole-graph compile. Those keep their FX strides, in their
  readers and in the backward, as AOTAutograd assumes for stock Inductor.
  A reader's inputs bind no unbacked size (`drop_unbacked_bindings_of_inputs`):
  only the segment that makes the value does.

Inductor's generated code assumes the strides of its example inputs, so the
strides a segment is compiled for must be those its producer makes: they are
taken from the producer's own report, never guessed.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from erase_fx.emit import inplace_fusion
from erase_fx.emit.inner import BoxedCallable, has_symbolic_shapes, mark_outputs_user_visible
from erase_fx.emit.scale_grads import is_dense_layout
from erase_fx.errors import GraphInvariantError
from erase_fx.passes import MAIN_STREAM, SegmentedForward
from erase_fx.passes.graph import output_node, output_values
from erase_fx.passes.node_meta import get_meta, is_early

WHERE = "compile_inductor_segments"
log = logging.getLogger("erase_fx")
Stride = tuple[int, ...]


def compile_inductor_segments(
    segmented: SegmentedForward,
    whole: fx.GraphModule,
    example_inputs: Sequence[Any],
    inductor_kwargs: dict[str, Any],
    keep_inplace_writes: bool = True,
) -> dict[str, BoxedCallable]:
    """Compile every segment of ``segmented`` with Inductor; see the module docstring.

    Args:
        segmented: the split forward.
        whole: the forward before splitting, as stock Inductor received it
            (its output node says which outputs are user-visible).
        example_inputs: the forward's example inputs.
        inductor_kwargs: what ``compile_fx`` passed for the whole forward
            (``static_input_idxs``, ``graph_id``, ...).
        keep_inplace_writes: compile side-stream segments inside
            `inplace_fusion.keep_inplace_writes` (`Tuning.keep_inplace_writes`).
    """
    from torch._guards import TracingContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.utils import BoxedBool

    layout_opt = GraphLowering.decide_layout_opt(whole, is_inference=False)
    top = segmented.gm.graph
    input_index = {node: i for i, node in enumerate(top.find_nodes(op="placeholder"))}
    static = set(inductor_kwargs.get("static_input_idxs") or ())
    results = output_values(top)
    visible = _user_visible_values(whole, results)
    context = TracingContext.try_get()
    keep_fx_strides = context is None or has_symbolic_shapes(example_inputs)

    strides: dict[fx.Node, Stride | None] = {}
    compiled: dict[str, BoxedCallable] = {}
    for call in top.find_nodes(op="call_module"):
        segment = getattr(segmented.gm, call.target)
        drop_unbacked_bindings_of_inputs(segment)
        inputs = _inputs_with_strides(segment, call.args, strides)
        getitems = {user.args[1]: user for user in call.users}
        held = sorted(i for i, node in getitems.items() if node in visible)
        if not keep_fx_strides:
            pin_early_outputs_to_fx_layout(segment, held)
        mark_outputs_user_visible(segment, None if keep_fx_strides else held)
        kwargs = dict(
            static_input_idxs=[j for j, arg in enumerate(call.args)
                               if input_index.get(arg) in static],
            # NB: Inductor's own CUDA graphs cannot capture a side stream's
            # allocations; erase_fx captures the whole program instead.
            cudagraphs=BoxedBool(False),
            graph_id=inductor_kwargs.get("graph_id"),
            layout_opt=layout_opt,
        )
        # NB: a side stream's segment keeps Inductor's large in-place writes
        # possible (`inplace_fusion`): its stream's pool is its own under capture.
        keep = keep_inplace_writes and segmented.segment(call.target).stream != MAIN_STREAM
        compiled[call.target], reported = _compile_segment(
            segment, call.target, inputs, kwargs, keep, None if keep_fx_strides else held)
        for i, node in getitems.items():
            # NB: a user-visible output keeps the strides of the segment's own
            # FX graph, which follow its inputs' (re-strided) layouts: report
            # what was made, visible or not, so that readers and the backward
            # are compiled for it.
            strides[node] = None if keep_fx_strides else _reported_stride(
                segment, reported, i, call.target)
    if context is not None and context.output_strides is not None:
        context.output_strides.extend(
            strides.get(value) if isinstance(value, fx.Node) else None for value in results)
    return compiled


def _compile_segment(segment: fx.GraphModule, name: str, inputs: Sequence[Any],
                     kwargs: dict[str, Any], keep: bool,
                     held: list[int] | None) -> tuple[BoxedCallable, Any]:
    """One segment compiled by Inductor (inside `_fusion`), and the output strides it reported.

    ``held``: the user-visible outputs that must come out at their FX strides,
    unpadded (None: no such check).
    """
    from torch._guards import TracingContext
    from torch._inductor.compile_fx import compile_fx_inner

    with _fusion(keep, name), TracingContext.report_output_strides() as reported:
        compiled = compile_fx_inner(segment, inputs, **kwargs)
    if held is not None and not _unpadded(segment, reported, held):
        # NB: Inductor's FX graph cache keys a graph by its code, not by
        # which outputs are user-visible: the same segment code cached
        # with other outputs visible can come back with other strides.
        from torch._inductor import config as inductor_config

        with _fusion(keep, name), inductor_config.patch(fx_graph_cache=False), \
                TracingContext.report_output_strides() as reported:
            compiled = compile_fx_inner(segment, inputs, **kwargs)
        if not _unpadded(segment, reported, held):
            raise GraphInvariantError(
                WHERE, f"Inductor padded user-visible outputs {held} of {name}")
    return compiled, reported


@contextlib.contextmanager
def _fusion(keep_inplace_writes: bool, segment: str) -> Iterator[None]:
    """Inside: `inplace_fusion.keep_inplace_writes` if asked; its refusals logged (debug)."""
    if not keep_inplace_writes:
        yield
        return
    with inplace_fusion.keep_inplace_writes() as handler:
        yield
    for refused in handler.refused:
        log.debug("erase_fx: %s: a fusion refused, so that %s can write over %s (%.1f MiB)",
                  segment, refused.writer, refused.buffer, refused.nbytes / 2**20)


def keep_early_values_at_fx_strides(fw: fx.GraphModule) -> None:
    """Add the forward's early-backward outputs (early grads, parts) to its user-visible outputs."""
    out = output_node(fw.graph)
    values = output_values(fw.graph)
    visible = set(out.meta.get("user_visible_output_idxs") or ())
    visible |= {i for i, value in enumerate(values)
                if isinstance(value, fx.Node) and is_early(value)}
    out.meta["user_visible_output_idxs"] = sorted(visible)


def pin_early_outputs_to_fx_layout(segment: fx.GraphModule, indices: Sequence[int]) -> list[int]:
    """Return each early gradient among outputs ``indices`` of ``segment`` through a ``clone`` to
    the memory format of its FX strides (contiguous or channels-last); the indices it pinned.

    Call it before the segment first compiles: its FX strides are then still
    those of the whole forward's trace (eager's), not yet re-derived from
    re-strided inputs. Only whole gradients of a primal (``grad_of``), which
    autograd adopts as ``.grad`` if their layout is the parameter's: an early
    part of a gradient, which a sum in the backward reads, keeps the layout
    Inductor chose. A value whose strides are no memory format is left as it is.
    """
    graph = segment.graph
    out = output_node(graph)
    values = output_values(graph)
    pinned = []
    for i in indices:
        value = values[i]
        if not _is_early_gradient(value):
            continue
        example = value.meta.get("val")
        memory_format = _memory_format(example)
        if memory_format is None:
            continue
        with graph.inserting_before(out):
            clone = graph.call_function(torch.ops.aten.clone.default, (value,),
                                        {"memory_format": memory_format})
        clone.meta = dict(value.meta)
        clone.meta["val"] = _restrided(example, tuple(example.stride()))
        values[i] = clone
        pinned.append(i)
    if pinned:
        returned = out.args[0]
        out.args = (type(returned)(values) if isinstance(returned, (tuple, list))
                    else values[0],)
        segment.recompile()
    return pinned


def _is_early_gradient(value: Any) -> bool:
    """An early block's whole gradient of a primal (what autograd will adopt as ``.grad``)."""
    meta = get_meta(value) if isinstance(value, fx.Node) else None
    return meta is not None and is_early(value) and meta.grad_of is not None


def _memory_format(value: Any) -> torch.memory_format | None:
    """The memory format a static-shaped tensor's strides are, or None."""
    if not isinstance(value, torch.Tensor) or has_symbolic_shapes([value]):
        return None
    if value.is_contiguous():
        return torch.contiguous_format
    for memory_format, dim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if value.dim() == dim and value.is_contiguous(memory_format=memory_format):
            return memory_format
    return None


def drop_unbacked_bindings_of_inputs(segment: fx.GraphModule) -> list[str]:
    """Drop the ``unbacked_bindings`` a segment's inputs carry; the names of those inputs.

    torch's ``split_module`` copies each input's meta from the node that made
    it, so a tensor of data-dependent size (a boolean mask's rows) read in a
    later segment says there that it binds its unbacked size. Inductor then
    asserts its input's lowering binds it (it binds a placeholder's sizes
    from the tensor passed in instead): an input takes a size, only the
    segment that made it binds one. Stock Inductor skips the check for the
    backward's inputs, which AOTAutograd's partitioner makes the same way.
    """
    dropped = []
    for node in segment.graph.find_nodes(op="placeholder"):
        if node.meta.pop("unbacked_bindings", None) is not None:
            dropped.append(node.name)
    return dropped


def _user_visible_values(whole: fx.GraphModule, results: Sequence[Any]) -> set[Any]:
    """The top-level values of the split module that stock Inductor keeps at FX strides."""
    indices = output_node(whole.graph).meta.get("user_visible_output_idxs")
    if indices is None:
        indices = range(len(results))
    return {results[i] for i in indices if i < len(results) and isinstance(results[i], fx.Node)}


def _inputs_with_strides(
    segment: fx.GraphModule, args: Sequence[Any], strides: dict[fx.Node, Stride | None]
) -> list[Any]:
    """The segment's example inputs, re-strided to what their producers really make."""
    inputs = []
    for node, arg in zip(segment.graph.find_nodes(op="placeholder"), args):
        value = node.meta.get("val")
        stride = strides.get(arg) if isinstance(arg, fx.Node) else None
        if (stride is not None and isinstance(value, torch.Tensor)
                and tuple(value.stride()) != stride):
            value = _restrided(value, stride)
            node.meta["val"] = value
        inputs.append(value)
    return inputs


def _restrided(value: torch.Tensor, stride: Stride) -> torch.Tensor:
    with getattr(value, "fake_mode", None) or contextlib.nullcontext():
        return torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device)


def _unpadded(segment: fx.GraphModule, reported: Sequence[Any] | None,
              indices: Sequence[int]) -> bool:
    """Whether the outputs at ``indices`` came out unpadded (a cache entry may have padded them).

    Unpadded: the strides the segment's FX graph gives the output (those
    Inductor recorded from the segment's re-strided inputs, or those of the
    trace), or any dense layout (a layout Inductor re-derived, channels-last
    from a channels-last input). NB: not "dense" alone: a view of a larger
    tensor (a task's slice of a stacked tensor, returned to the user) is not
    dense in eager either, and Inductor keeps it at its FX strides.
    """
    if reported is None:
        return True  # no tracing context: nothing reported, all outputs kept visible
    values = output_values(segment.graph)
    recorded = output_node(segment.graph).meta.get("original_output_strides") or ()
    for i in indices:
        strides = reported[i] if i < len(reported) else None
        value = values[i].meta.get("val") if isinstance(values[i], fx.Node) else None
        if (strides is None or not isinstance(value, torch.Tensor)
                or not all(isinstance(s, int) for s in (*strides, *value.shape))):
            continue
        fx_strides = {tuple(value.stride())}
        if i < len(recorded) and recorded[i] is not None:
            fx_strides.add(tuple(recorded[i]))
        if tuple(strides) not in fx_strides and not is_dense_layout(tuple(value.shape),
                                                                     tuple(strides)):
            return False
    return True


def _reported_stride(segment: fx.GraphModule, reported: Sequence[Any] | None, index: int,
                     name: str) -> Stride | None:
    """The strides Inductor gave output ``index`` of segment ``name`` (static shapes: integers).

    None where there are none to give: for a size (a SymInt the segment
    returns: the row count of a boolean mask, under
    ``capture_dynamic_output_shape_ops``, that its readers need), and for a
    tensor whose FX strides hold such an unbacked size. Inductor reports no
    strides for those, in a whole-graph compile too, and AOTAutograd then
    takes the FX graph's; so do the segments that read them.
    """
    value = reported[index] if reported is not None and index < len(reported) else None
    if value is None and not _has_static_strides(output_values(segment.graph)[index]):
        return None
    if value is None or not all(isinstance(s, int) for s in value):
        raise GraphInvariantError(
            WHERE, f"Inductor reported no static strides for output {index} of {name}; "
                   "its readers could not be compiled for them")
    return tuple(value)


def _has_static_strides(value: Any) -> bool:
    """Whether an FX value is a tensor whose strides hold no unbacked symbol (a data-dependent
    size); not for a SymInt, which has no strides."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    example = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(example, torch.Tensor) and not free_unbacked_symbols(example.stride())
