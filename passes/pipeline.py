"""The pass lists, declared once, and the driver that runs them.

AOTAutograd hands erase_fx three modules at three times
(`erase_fx.compilation`): the joint graph, then the forward, then, at the
first ``.backward()``, the backward. Each has its list of passes, in order::

    JOINT_PASSES     merge_common_subexpressions > find_stop_gradient_blocks
                     > schedule_early_backward > partition_joint_graph
    FORWARD_PASSES   copy_input_values_per_block > assign_streams > recompute_boundary_values
                     > split_segments
    BACKWARD_PASSES  defer_grad_scaling
    UNUSED_TANGENT_BACKWARD_PASSES  specialize_unused_tangents > defer_grad_scaling

`run_passes` runs one list over a module with the config: each pass reads the
module the pass before returned (``PassResult.gm``), is checked by its own
``check_*`` and shown to the caller's instruments (timings, dumps) through
its runner; the results come back by pass name. What is not a pass
(Inductor compiling segments, the stream program, CUDA graphs) is the
caller's: `erase_fx.compilation`, `erase_fx.emit`.

A `Pass` entry says how its pass is called (``run``: the module, a
`PassContext` with the config, the results so far and what the caller gave),
how its result is checked (``check``), and whether it runs at all
(``runs_if``: the scheduling and the partition need an early block; when an
entry's ``runs_if`` is false, it and the rest of its list are skipped, since
they read what it would return).

NB: ``run`` and ``check`` call the passes by their names in this module, so a
test breaks a stage with ``monkeypatch.setattr(pipeline, "split_segments", ...)``.
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.errors import GraphInvariantError
from erase_fx.passes.assign_streams import assign_streams, check_stream_assignment
from erase_fx.passes.copy_input_values_per_block import (
    check_input_values_per_block,
    copy_input_values_per_block,
)
from erase_fx.passes.defer_grad_scaling import check_deferred_scaling, defer_grad_scaling
from erase_fx.passes.find_stop_gradient_blocks import (
    BlockAnalysis,
    check_block_analysis,
    find_stop_gradient_blocks,
)
from erase_fx.passes.merge_common_subexpressions import check_merged, merge_common_subexpressions
from erase_fx.passes.partition_joint_graph import check_partition, partition_joint_graph
from erase_fx.passes.pass_result import PassResult
from erase_fx.passes.recompute_boundary_values import (
    check_boundary_values,
    recompute_boundary_values,
)
from erase_fx.passes.schedule_early_backward import check_early_schedule, schedule_early_backward
from erase_fx.passes.specialize_unused_tangents import (
    check_unused_tangents,
    specialize_unused_tangents,
)
from erase_fx.passes.split_segments import check_segments, split_segments


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass entry reads besides its module.

    Attributes:
        cfg: the compilation's settings.
        results: this list's results so far, by pass name.
        given: what the caller handed `run_passes` (AOT's ``num_fwd_outputs``,
            ``joint_inputs``, ``partition_kwargs``; ``primal_names``).
    """

    cfg: EraseConfig
    results: Mapping[str, PassResult]
    given: Mapping[str, Any]

    def artifact(self, name: str) -> Any:
        """The artifact of the earlier pass ``name``."""
        return self.results[name].artifact


def _always(context: PassContext) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Pass:
    """One entry of a pass list; see the module docstring."""

    name: str
    run: Callable[[fx.GraphModule, PassContext], PassResult]
    check: Callable[[PassResult, PassContext], None]
    runs_if: Callable[[PassContext], bool] = _always


class Runner(Protocol):
    """Calls ``fn(*args)`` with the instruments around it (`erase_fx.instruments.PassRunner`)."""

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any: ...


def run_passes(
    passes: Sequence[Pass], gm: fx.GraphModule, cfg: EraseConfig, *,
    runner: Runner | None = None,
    after: Mapping[str, Callable[[PassResult], None]] | None = None,
    **given: Any,
) -> dict[str, PassResult]:
    """Run ``passes`` in order over ``gm``; the checked results, by pass name, in order.

    ``after[name](result)`` runs right after pass ``name`` (and its dump),
    before the next pass: the caller's own bookkeeping (the report).
    """
    results: dict[str, PassResult] = {}
    view = types.MappingProxyType(results)
    for entry in passes:
        context = PassContext(cfg, view, types.MappingProxyType(given))
        if not entry.runs_if(context):
            break
        if runner is None:
            result = _run_checked(entry, gm, context)
        else:
            result = runner.run(entry.name, _run_checked, entry, gm, context)
        results[entry.name] = result
        if after is not None and entry.name in after:
            after[entry.name](result)
        gm = result.gm
    return results


def module_given_to(results: Mapping[str, PassResult], name: str) -> fx.GraphModule:
    """The module pass ``name`` ran on, from `run_passes`' results: the one the pass before it
    returned (the first pass's input is not among the results: asking for it raises)."""
    names = list(results)
    position = names.index(name)
    if position == 0:
        raise ValueError(f"{name} ran first: the module it was given is not in the results")
    return results[names[position - 1]].gm


def run_pass(entry: Pass, gm: fx.GraphModule, cfg: EraseConfig, *,
             results: Mapping[str, PassResult] | None = None, **given: Any) -> PassResult:
    """One pass, checked, outside a pipeline (tests, `erase_fx.early_grads`'s plan);
    ``results``: the earlier passes' results it reads, by name."""
    return _run_checked(entry, gm, PassContext(cfg, dict(results or {}), given))


def _run_checked(entry: Pass, gm: fx.GraphModule, context: PassContext) -> PassResult:
    result = entry.run(gm, context)
    if not isinstance(result, PassResult):
        raise GraphInvariantError(entry.name, f"the pass returned a {type(result).__name__}, "
                                  "not a PassResult")
    entry.check(result, context)
    return result


# -- the entries --------------------------------------------------------------

def _merge(gm: fx.GraphModule, context: PassContext) -> PassResult:
    return merge_common_subexpressions(gm, context.cfg)


def _check_merged(result: PassResult, context: PassContext) -> None:
    check_merged(result)


def _find_blocks(gm: fx.GraphModule, context: PassContext) -> PassResult:
    return find_stop_gradient_blocks(gm, context.cfg,
                                     num_fwd_outputs=context.given["num_fwd_outputs"],
                                     primal_names=context.given.get("primal_names", ()),
                                     graph_end=context.given.get("graph_end", False))


def _check_blocks(result: PassResult, context: PassContext) -> None:
    check_block_analysis(result.gm, result.artifact)


def _found_blocks(context: PassContext) -> bool:
    analysis: BlockAnalysis = context.artifact(FIND_STOP_GRADIENT_BLOCKS.name)
    return bool(analysis.blocks)


def _schedule(gm: fx.GraphModule, context: PassContext) -> PassResult:
    return schedule_early_backward(gm, context.cfg,
                                   context.artifact(FIND_STOP_GRADIENT_BLOCKS.name))


def _check_schedule(result: PassResult, context: PassContext) -> None:
    check_early_schedule(result.gm, context.artifact(FIND_STOP_GRADIENT_BLOCKS.name))


def _partition(gm: fx.GraphModule, context: PassContext) -> PassResult:
    given = context.given
    return partition_joint_graph(gm, context.cfg, given["joint_inputs"],
                                 num_fwd_outputs=given["num_fwd_outputs"],
                                 **given.get("partition_kwargs", {}))


def _check_partition(result: PassResult, context: PassContext) -> None:
    check_partition(result.artifact.bw)


def _copy_input_values(gm: fx.GraphModule, context: PassContext) -> PassResult:
    return copy_input_values_per_block(gm, context.cfg)


def _check_input_values(result: PassResult, context: PassContext) -> None:
    if context.cfg.copy_input_values:
        check_input_values_per_block(result)


def _assign_streams(gm: fx.GraphModule, context: PassContext) -> PassResult:
    return assign_streams(gm, context.cfg)


def _check_streams(result: PassResult, context: PassContext) -> None:
    check_stream_assignment(result.gm)


def _recompute_boundary_values(gm: fx.GraphModule, context: PassContext) -> PassResult:
    return recompute_boundary_values(gm, context.cfg)


def _check_boundary_values(result: PassResult, context: PassContext) -> None:
    if context.cfg.recompute_boundary_values:
        check_boundary_values(result)


def _split_segments(gm: fx.GraphModule, context: PassContext) -> PassResult:
    return split_segments(gm, context.cfg)


def _check_segments(result: PassResult, context: PassContext) -> None:
    check_segments(result)


def _specialize_unused_tangents(gm: fx.GraphModule, context: PassContext) -> PassResult:
    return specialize_unused_tangents(gm, context.cfg, context.given["unused_tangents"])


def _check_unused_tangents(result: PassResult, context: PassContext) -> None:
    check_unused_tangents(result.gm, result.artifact)


def _defer_grad_scaling(gm: fx.GraphModule, context: PassContext) -> PassResult:
    return defer_grad_scaling(gm, context.cfg)


def _check_deferred(result: PassResult, context: PassContext) -> None:
    check_deferred_scaling(result)


MERGE_COMMON_SUBEXPRESSIONS = Pass("merge_common_subexpressions", _merge, _check_merged)
FIND_STOP_GRADIENT_BLOCKS = Pass("find_stop_gradient_blocks", _find_blocks, _check_blocks)
SCHEDULE_EARLY_BACKWARD = Pass("schedule_early_backward", _schedule, _check_schedule,
                               runs_if=_found_blocks)
PARTITION_JOINT_GRAPH = Pass("partition_joint_graph", _partition, _check_partition)
COPY_INPUT_VALUES_PER_BLOCK = Pass("copy_input_values_per_block", _copy_input_values,
                                   _check_input_values)
ASSIGN_STREAMS = Pass("assign_streams", _assign_streams, _check_streams)
RECOMPUTE_BOUNDARY_VALUES = Pass("recompute_boundary_values", _recompute_boundary_values,
                                 _check_boundary_values)
SPLIT_SEGMENTS = Pass("split_segments", _split_segments, _check_segments)
SPECIALIZE_UNUSED_TANGENTS = Pass("specialize_unused_tangents", _specialize_unused_tangents,
                                  _check_unused_tangents)
DEFER_GRAD_SCALING = Pass("defer_grad_scaling", _defer_grad_scaling, _check_deferred)

#: On AOT's joint graph (after Inductor's joint-graph passes, with Inductor
#: inside). The scheduling and the partition run only when the analysis found
#: an early block; the caller then partitions with the stock partitioner.
JOINT_PASSES: tuple[Pass, ...] = (
    MERGE_COMMON_SUBEXPRESSIONS, FIND_STOP_GRADIENT_BLOCKS, SCHEDULE_EARLY_BACKWARD,
    PARTITION_JOINT_GRAPH)
#: On the forward AOT hands over, when it holds early nodes.
FORWARD_PASSES: tuple[Pass, ...] = (COPY_INPUT_VALUES_PER_BLOCK, ASSIGN_STREAMS,
                                    RECOMPUTE_BOUNDARY_VALUES, SPLIT_SEGMENTS)
#: On the backward, at the first ``.backward()``, when the graph has early blocks.
BACKWARD_PASSES: tuple[Pass, ...] = (DEFER_GRAD_SCALING,)
#: The backward that runs when the outputs besides the loss that early blocks read the
#: gradients of (``unused_tangents``, given) get none: compiled beside the one above.
UNUSED_TANGENT_BACKWARD_PASSES: tuple[Pass, ...] = (SPECIALIZE_UNUSED_TANGENTS,
                                                    DEFER_GRAD_SCALING)
