"""specialize_unused_tangents: the backward for a step where some outputs get no gradient.

What: given the backward module and some of its tangents (``unused``), returns
the backward with those tangents taken as zero: every node that then computes
zeros is gone (`copy_folding_zeros`), sums with them reduce to their other
operand, and a gradient that would be all zeros is returned as ``full(shape,
0)``.

Why: an early block that reads the gradients of other outputs besides its loss
(a tensor kept on the module for logging, an activation a forward hook
captured, per-layer outputs returned beside the loss) runs its loss term's
part early and leaves those outputs' part in the backward
(`schedule_early_backward`). Usually nobody differentiates those outputs:
autograd then hands the backward zeros for their gradients, and the part
computed from them is zeros, at the full cost of the block's backward. The
runtime (`erase_fx.emit.live_tangents`) sees, before the backward runs,
whether any of those outputs got a gradient, and runs this specialized
backward when none did: exact, since the backward is linear in its tangents.

Invariants in: a backward module (AOTAutograd's placeholders: saved values,
then ``tangents_*``); ``unused`` names some of its tangents.
Invariants out (`check_unused_tangents`): a new module (the input untouched)
with the same placeholders and as many outputs; no node reads an unused
tangent. With nothing to specialize the pass returns its input, unmodified.

Before::

    add_3 = add(mm, div)                      # div = expand(tangents_4) / 8
    threshold_backward = threshold_backward(add_3, relu_2, 0)
    return (..., mul(t_9, tangents_1), ...)

After (``unused=("tangents_4",)``)::

    threshold_backward = threshold_backward(mm, relu_2, 0)
    return (..., mul(t_9, tangents_1), ...)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from erase_fx.errors import GraphInvariantError
from erase_fx.passes.graph import clone_module, fake_mode_of, is_tangent, output_node
from erase_fx.passes.pass_result import DumpFile, PassContext, PassResult, graph_text
from erase_fx.passes.zero_folding import ZERO, copy_folding_zeros, zeros_like

PASS_NAME = "specialize_unused_tangents"


@dataclasses.dataclass(frozen=True)
class UnusedTangents:
    """The tangents the backward was specialized for as zero, by placeholder name."""

    unused: tuple[str, ...]

    def render(self, gm: fx.GraphModule) -> tuple[DumpFile, ...]:
        return (DumpFile(".py", "the backward that runs when " + ", ".join(self.unused)
                         + " get no gradient", graph_text(gm)),)


def specialize_unused_tangents(bw: fx.GraphModule,
                               ctx: PassContext) -> PassResult[UnusedTangents]:
    """The backward with the tangents ``ctx.given["unused_tangents"]`` (names) taken as zero;
    see the module docstring."""
    unused: Sequence[str] = ctx.given.get("unused_tangents", ())
    if not unused:
        return PassResult(bw, modified=False, artifact=UnusedTangents(()))
    gm, _ = clone_module(bw)
    graph = gm.graph
    fake_mode = fake_mode_of(graph)
    env: dict[fx.Node, Any] = {n: ZERO for n in graph.find_nodes(op="placeholder")
                               if n.name in unused}
    if len(env) != len(set(unused)):
        missing = sorted(set(unused) - {n.name for n in env})
        raise GraphInvariantError(PASS_NAME, f"the backward has no tangent {missing}")
    dependent = _tangent_dependent(graph)
    out = output_node(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or not any(a in env for a in node.all_input_nodes):
            continue
        with graph.inserting_before(node):
            env[node] = copy_folding_zeros(graph, node, env, dependent, fake_mode=fake_mode)
    with graph.inserting_before(out):
        zeros = {value: zeros_like(graph, value, fake_mode) for value in env
                 if env[value] is ZERO and value in out.all_input_nodes}
    out.args = fx.node.map_arg(out.args, lambda a: zeros.get(a, env.get(a, a)))
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return PassResult(gm, modified=True, artifact=UnusedTangents(tuple(unused)))


def _tangent_dependent(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that read a tangent, directly or not (the tangents included)."""
    dependent: set[fx.Node] = set()
    for node in graph.nodes:
        if is_tangent(node) or any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


def check_unused_tangents(result: PassResult[UnusedTangents], ctx: PassContext) -> None:
    """No node reads an unused tangent; raises GraphInvariantError."""
    gm, found = result.gm, result.artifact
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.name in found.unused and node.users:
            raise GraphInvariantError(PASS_NAME, "the specialized backward still reads an unused "
                                      "tangent", node=node.name)
