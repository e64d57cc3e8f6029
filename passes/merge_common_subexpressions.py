"""merge_common_subexpressions: the joint graph with its tangent-free common subexpressions
merged, before the blocks are found and cloned.

What: two nodes that call the same pure op on the same arguments become one
(the first), as the stock partitioner's CSE does, but only where neither reads
a tangent, directly or not: the forward's values and the backward's
tangent-free helpers (a cross-entropy's one-hot label mask ``eq(iota,
target)``, the zeros a ``select_scatter`` writes into). Never merged, as in
torch's ``fx_graph_cse``: ops that draw random numbers, mutate or are impure,
``empty``, values an output is (or is a view of), values with unbacked or
symbolic arguments, and two nodes a mutation lies between.
`partition_joint_graph` then runs the stock partitioner with its own CSE off.

Why: the stock partitioner merges every common subexpression of the joint
graph before it partitions. erase_fx partitions after
`schedule_early_backward` has cloned each early block's backward, with the
helpers it reads, into the forward; merged then, the clones of one helper (the
same label mask in every block trained on the same labels, and the last
block's own, which its backward reads after ``.backward()``) became one
forward value that every block read and the backward read too, so the
partitioner saved it for the backward: a batch x vocabulary bool mask (32 MiB
on gpt:16:384:256:8, 64 MiB on gpt:8:768:1024:6) and the attention's zeros,
alive from the first block's forward to the end of the backward, where stock
recomputes them in the backward. Merged before the cloning, each block gets its
own copy, made in its own segment and fused by Inductor into the kernels that
read it, and the last block's backward keeps the original, a backward value
that the partitioner leaves to the backward. Nodes that read a tangent stay
apart: merged, the blocks' gradients of one summed loss start from one node
(``tangent / count``), and the blocks become one component of the backward.

Invariants out (`check_merged`): a new module (the input itself when nothing
merges: ``modified`` False) with the input's placeholders, in order, and as
many outputs; no two tangent-free nodes left that the rule would merge.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from erase_fx.errors import GraphInvariantError
from erase_fx.passes.graph import (
    clone_module,
    draws_random_numbers,
    is_tangent,
    is_view,
    output_values,
    returned_values,
)
from erase_fx.passes.pass_result import DumpFile, PassContext, PassResult, graph_text

PASS_NAME = "merge_common_subexpressions"

#: Ops that make memory without writing it: two calls are two buffers (``fx_graph_cse``).
_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty",
                            "new_empty_strided"})


@dataclasses.dataclass(frozen=True)
class MergedSubexpressions:
    """What the merge did: the nodes it removed, by name; the input's placeholders and
    number of outputs (the check compares them with the result's)."""

    removed: tuple[str, ...]
    placeholders: tuple[str, ...]
    outputs: int

    def render(self, gm: fx.GraphModule) -> tuple[DumpFile, ...]:
        return (DumpFile(".py", f"the joint graph, {len(self.removed)} tangent-free common "
                                "subexpression(s) merged", graph_text(gm)),)


def merge_common_subexpressions(gm: fx.GraphModule,
                                ctx: PassContext) -> PassResult[MergedSubexpressions]:
    """``gm`` with its tangent-free common subexpressions merged; see the module docstring.

    Reads nothing from ``ctx``: no setting, the stock partitioner merges them too, always.
    """
    found = MergedSubexpressions((), _placeholders(gm), len(output_values(gm.graph)))
    pairs = _duplicates(gm.graph)
    if not pairs:
        return PassResult(gm, modified=False, artifact=found)
    merged, copy_of = clone_module(gm)
    removed = []
    for node, first in pairs:
        copy_of[node].replace_all_uses_with(copy_of[first])
        removed.append(node.name)
        merged.graph.erase_node(copy_of[node])
    merged.graph.lint()
    merged.recompile()
    return PassResult(merged, modified=True,
                      artifact=dataclasses.replace(found, removed=tuple(removed)))


def _duplicates(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """(node, the earlier node it repeats) for every node the rule merges, in graph order;
    a node's key is made with its arguments' representatives, so chains merge whole."""
    returned = _returned_storage(graph)
    reads_tangent: set[fx.Node] = set()
    representative: dict[fx.Node, fx.Node] = {}
    seen: dict[Any, fx.Node] = {}
    pairs = []
    region = 0
    for node in graph.nodes:
        if is_tangent(node) or any(a in reads_tangent for a in node.all_input_nodes):
            reads_tangent.add(node)
        if _mutates(node):
            region += 1  # NB: nothing merges across a mutation
        if node in reads_tangent or node in returned or not _mergeable(node):
            continue
        key = _key(node, representative, region)
        if key is None:
            continue
        first = seen.setdefault(key, node)
        if first is not node:
            representative[node] = first
            pairs.append((node, first))
    return pairs


def _mergeable(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False  # NB: a higher-order or Python op may be impure without saying so
    return not (node.is_impure() or target._schema.is_mutable or draws_random_numbers(node)
                or target._schema.name.split("::")[-1] in _UNINITIALIZED)


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` may write memory: an op with a mutable schema, or a higher-order op
    (it may mutate without saying so). Python arithmetic on sizes (``operator.mul`` of
    symbols) writes none."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    return isinstance(target, torch._ops.HigherOrderOperator)


def _key(node: fx.Node, representative: dict[fx.Node, fx.Node], region: int) -> Any:
    """A hashable key of the call (op, arguments with nodes as their representatives), or
    None where an argument has no stable key (a symbolic value)."""
    leaves, spec = tree_flatten((node.args, node.kwargs))
    key = []
    for leaf in leaves:
        if isinstance(leaf, fx.Node):
            key.append(("node", representative.get(leaf, leaf)))
        elif isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return None
        else:
            try:
                hash(leaf)
            except TypeError:
                return None
            key.append((type(leaf), leaf))
    return (node.target, region, str(spec), tuple(key))


def _returned_storage(graph: fx.Graph) -> set[fx.Node]:
    """The values an output is, and every value of their view chains (up to the base,
    `returned_values`, and down to other views of it): they hold an output's memory."""
    held = returned_values(graph)
    stack = list(held)
    while stack:
        for user in stack.pop().users:
            if is_view(user) and user not in held:
                held.add(user)
                stack.append(user)
    return held


def _placeholders(gm: fx.GraphModule) -> tuple[str, ...]:
    return tuple(n.name for n in gm.graph.find_nodes(op="placeholder"))


def check_merged(result: PassResult[MergedSubexpressions], ctx: PassContext) -> None:
    """The invariants out (module docstring)."""
    found = result.artifact
    after = _placeholders(result.gm)
    if after != found.placeholders:
        raise GraphInvariantError(
            PASS_NAME, f"the placeholders changed: {list(found.placeholders)} -> {list(after)}")
    if len(output_values(result.gm.graph)) != found.outputs:
        raise GraphInvariantError(PASS_NAME, "the number of outputs changed")
    left = _duplicates(result.gm.graph)
    if left:
        raise GraphInvariantError(PASS_NAME, "common subexpressions are left",
                                  node=left[0][0].name)
