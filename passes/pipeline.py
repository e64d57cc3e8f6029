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

Every pass is called the same way, ``run(gm, ctx) -> PassResult``, and every
check ``check(result, ctx) -> None``, where ``ctx`` is a `PassContext`: the
config, the results so far in the list, and what the caller gave; a pass
reads what it needs there (``ctx.artifact("find_stop_gradient_blocks")``,
``ctx.given["num_fwd_outputs"]``). A `Pass` entry names the pass, its check,
and whether it runs at all (``runs_if``: the scheduling and the partition need
an early block; when an entry's ``runs_if`` is false, it and the rest of its
list are skipped, since they read what it would return).

NB: the lists hold the entries themselves, so a test breaks or watches a
stage everywhere by replacing its entry's function:
``monkeypatch.setattr(pipeline.SPLIT_SEGMENTS, "run", broken)`` (hence `Pass`
is not frozen).
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
from erase_fx.passes.pass_result import PassContext, PassResult
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


def _always(context: PassContext) -> bool:
    return True


@dataclasses.dataclass(eq=False)
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
    return _run_checked(entry, gm, PassContext.of(cfg, results, **given))


def _run_checked(entry: Pass, gm: fx.GraphModule, context: PassContext) -> PassResult:
    result = entry.run(gm, context)
    if not isinstance(result, PassResult):
        raise GraphInvariantError(entry.name, f"the pass returned a {type(result).__name__}, "
                                  "not a PassResult")
    entry.check(result, context)
    return result


# -- the entries --------------------------------------------------------------

def _found_blocks(context: PassContext) -> bool:
    analysis: BlockAnalysis = context.artifact(FIND_STOP_GRADIENT_BLOCKS.name)
    return bool(analysis.blocks)


MERGE_COMMON_SUBEXPRESSIONS = Pass("merge_common_subexpressions", merge_common_subexpressions,
                                   check_merged)
FIND_STOP_GRADIENT_BLOCKS = Pass("find_stop_gradient_blocks", find_stop_gradient_blocks,
                                 check_block_analysis)
SCHEDULE_EARLY_BACKWARD = Pass("schedule_early_backward", schedule_early_backward,
                               check_early_schedule, runs_if=_found_blocks)
PARTITION_JOINT_GRAPH = Pass("partition_joint_graph", partition_joint_graph, check_partition)
COPY_INPUT_VALUES_PER_BLOCK = Pass("copy_input_values_per_block", copy_input_values_per_block,
                                   check_input_values_per_block)
ASSIGN_STREAMS = Pass("assign_streams", assign_streams, check_stream_assignment)
RECOMPUTE_BOUNDARY_VALUES = Pass("recompute_boundary_values", recompute_boundary_values,
                                 check_boundary_values)
SPLIT_SEGMENTS = Pass("split_segments", split_segments, check_segments)
SPECIALIZE_UNUSED_TANGENTS = Pass("specialize_unused_tangents", specialize_unused_tangents,
                                  check_unused_tangents)
DEFER_GRAD_SCALING = Pass("defer_grad_scaling", defer_grad_scaling, check_deferred_scaling)

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
