"""The whole early gradients of a compiled forward: final once their block has run.

An early block's gradient of a parameter is *whole* when the backward hands
it to autograd as the forward computed it (the saved early gradient, scaled
by ``T / seed``) and its memory is its own. Two features act on such a
gradient in the middle of the forward, as soon as its block's early backward
has run: `erase_fx.ddp` all-reduces it (DDP), `erase_fx.early_update` lets the
optimizer update its parameter (``compile_step(..., early_optimizer=True)``).
Both group the gradients by block (`block_key`): one completion per block.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.passes import get_meta, run_pass
from erase_fx.passes.graph import output_values
from erase_fx.passes.pipeline import DEFER_GRAD_SCALING


@dataclasses.dataclass(frozen=True)
class EarlyGrad:
    """A parameter's whole gradient, computed early: final once its block has run.

    Attributes:
        param: the primal's index: the forward's input and the backward's output index.
        result: the forward output (a saved tensor) the gradient lives in.
        saved: the backward input that saved tensor is.
        block: the early block that computes it (None if not tagged).
    """

    param: int
    result: int
    saved: int
    block: int | None


def plan_early_grads(fw: fx.GraphModule, bw: fx.GraphModule,
                     num_fwd_outputs: int) -> tuple[EarlyGrad, ...]:
    """The whole early gradients of ``fw``: those final once their block has run.

    A gradient qualifies when the backward returns it as ``saved * (T / seed)``
    and reads that saved tensor for nothing else (`defer_grad_scaling`'s rule),
    and when, in the forward, the saved tensor's memory is its own: made by an
    op that returns fresh memory, or a view chain of one, that nothing else
    reads and that is returned once. Writing into it (the all-reduced values)
    or handing it to the optimizer as ``.grad`` then touches nothing anyone
    else reads. Other early gradients (a part of a gradient that a sum in the
    backward completes, a gradient sharing memory, a gradient of a block at
    the graph's end, which a disarmed program leaves to the backward) are
    reduced by DDP and updated by the optimizer after the backward, as usual.
    """
    # NB: defer_grad_scaling reads no setting: the plan asks its rule, with the defaults
    deferred = run_pass(DEFER_GRAD_SCALING, bw, EraseConfig())
    if not deferred.modified:
        return ()
    bw_inputs = list(bw.graph.find_nodes(op="placeholder"))
    fw_outputs = output_values(fw.graph)
    returned = collections.Counter(v for v in fw_outputs if isinstance(v, fx.Node))
    saved_at = {}
    for index, value in enumerate(fw_outputs):
        if index >= num_fwd_outputs and isinstance(value, fx.Node):
            saved_at.setdefault(value.name, index)
    grads = []
    for entry in deferred.artifact.scaled:
        # NB: the partitioner names each backward input after the forward node it saves.
        index = saved_at.get(bw_inputs[entry.saved_index].name)
        if index is None:
            continue
        node = fw_outputs[index]
        if returned[node] != 1 or not _owns_its_memory(node):
            continue
        meta = get_meta(node)
        if meta is not None and meta.at_graph_end:
            # NB: a block at the graph's end may be left to the backward (emit.graph_end):
            # its gradients are not there during every forward
            continue
        grads.append(EarlyGrad(entry.grad_index, index, entry.saved_index,
                               meta.block if meta is not None else None))
    return tuple(grads)


def _owns_its_memory(node: fx.Node) -> bool:
    """Whether ``node``'s memory is written by it (or the view chain above it) and read by nothing
    else: each node of the chain has one user, and its root returns fresh memory."""
    while True:
        if len(node.users) != 1 or node.op != "call_function":
            return False
        if node.target is operator.getitem:
            parent = node.args[0]
            return isinstance(parent, fx.Node) and _returns_fresh(parent)
        if _returns_fresh(node):
            return True
        if not _returns_view(node) or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]


def _returns_fresh(node: fx.Node) -> bool:
    target = node.target
    return (isinstance(target, torch._ops.OpOverload)
            and all(r.alias_info is None for r in target._schema.returns))


def _returns_view(node: fx.Node) -> bool:
    """An op returning a view of its first argument (not a write to it)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    first = target._schema.arguments[0].alias_info if target._schema.arguments else None
    return (len(returns) == 1 and returns[0].alias_info is not None
            and not returns[0].alias_info.is_write and first is not None
            and not first.is_write)


def block_key(grad: EarlyGrad) -> Any:
    """The group of early gradients one completion marks: the block's (or the gradient alone)."""
    return grad.block if grad.block is not None else ("result", grad.result)


def hook_each_block(program: Any, grads: Sequence[EarlyGrad], begin: Callable[..., Any],
                    on_block: Callable[..., None]) -> None:
    """Hook ``program`` (`StreamProgram.add_completion_hooks`) once per block of ``grads``:
    ``on_block(members, context, values, after, streams)`` once the block's gradients are made,
    ``members`` their indices in ``grads``."""
    by_block: dict[Any, list[int]] = {}
    for i, grad in enumerate(grads):
        by_block.setdefault(block_key(grad), []).append(i)
    hooks = [(tuple(grads[i].result for i in members),
              functools.partial(on_block, tuple(members)))
             for members in by_block.values()]
    program.add_completion_hooks(begin, hooks)
