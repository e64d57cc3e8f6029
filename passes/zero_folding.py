"""Copy backward nodes with some of their tangent-dependent inputs known to be zero.

The backward is linear in all its tangents together: ``B(T, g) = B(T, 0) +
B(0, g)``. `schedule_early_backward` splits a block's backward that way (its
loss term's part early with ``T`` replaced by a seed, the other outputs' part
in the backward), and `specialize_unused_tangents` makes the backward that runs
when those other outputs get no gradient. Each copies nodes with some inputs
replaced by a *zero*: this module says what each copy becomes.

A node whose tangent-dependent inputs are all zero and that is linear in them
(`linearity_violation`) is zero itself: it is not copied (``ZERO``). A sum
(``add``/``sub``) of a zero and another value is that value. Any other node
with a zero input gets a real zero tensor there (``full(shape, 0)``): exact,
at the cost of the op. Only where that tensor's shape is symbolic can no zero
be made (`CannotFoldZero`).

Nothing here decides which inputs are zero; the callers do, and place and tag
the copies.
"""
from __future__ import annotations

from collections.abc import Callable, Container, MutableMapping
from typing import Any

import torch
import torch.fx as fx

from erase_fx.passes.graph import aten, call_with_val, val_of
from erase_fx.passes.linearity import linearity_violation


class _Zero:
    """The value of a node known to be all zeros (a copy that was not made)."""

    def __repr__(self) -> str:
        return "ZERO"


ZERO = _Zero()

#: ``add(a, b)`` / ``sub(a, b)``: with ``b`` zero the result is ``a``.
_SUMS = (aten.add.Tensor, aten.sub.Tensor)


class CannotFoldZero(Exception):
    """A zero input has a symbolic shape: no zero tensor can be made in its place."""


def copy_folding_zeros(
    graph: fx.Graph,
    node: fx.Node,
    env: MutableMapping[fx.Node, Any],
    dependent: Container[fx.Node],
    *,
    fake_mode: Any,
    made: Callable[[fx.Node], None] = lambda node: None,
) -> fx.Node | _Zero:
    """``node`` copied at the graph's insert point, its inputs read through ``env``.

    ``env`` maps an original node to its copy, or to ``ZERO``; a node not in it
    is read as it is. ``dependent``: the original nodes that depend on a
    tangent (for the linearity of ``node``). ``made`` sees every node created.
    Returns the copy, the input it reduces to, or ``ZERO``.
    """
    zero_inputs = [a for a in node.all_input_nodes if env.get(a) is ZERO]
    if not zero_inputs:
        copy = graph.node_copy(node, lambda a: env.get(a, a))
        made(copy)
        return copy
    tangent_inputs = [a for a in node.all_input_nodes if a in dependent]
    if set(tangent_inputs) <= set(zero_inputs) and linearity_violation(node, dependent) is None:
        return ZERO
    kept = _sum_with_zero(node, env)
    if kept is not None:
        return kept
    zeros = {a: zeros_like(graph, a, fake_mode, made) for a in dict.fromkeys(zero_inputs)}
    copy = graph.node_copy(node, lambda a: zeros[a] if a in zeros else env.get(a, a))
    made(copy)
    return copy


def _sum_with_zero(node: fx.Node, env: MutableMapping[fx.Node, Any]) -> fx.Node | None:
    """``a + 0``, ``a - 0``, ``0 + b``: the other operand, when it has the sum's shape and
    dtype (no broadcast, promotion or ``alpha``); else None."""
    if node.target not in _SUMS or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    a, b = node.args
    if env.get(b) is ZERO and isinstance(a, fx.Node) and env.get(a) is not ZERO:
        other = a
    elif (node.target is aten.add.Tensor and env.get(a) is ZERO and isinstance(b, fx.Node)
          and env.get(b) is not ZERO):
        other = b
    else:
        return None
    value, result = val_of(other), val_of(node)
    if not (isinstance(value, torch.Tensor) and isinstance(result, torch.Tensor)):
        return None
    if value.shape != result.shape or value.dtype != result.dtype:
        return None
    return env.get(other, other)


def zeros_like(graph: fx.Graph, original: fx.Node, fake_mode: Any,
               made: Callable[[fx.Node], None] = lambda node: None) -> fx.Node:
    """``full(shape, 0)`` with ``original``'s shape, dtype and device, at the insert point."""
    value = val_of(original)
    if not all(isinstance(size, int) for size in value.shape):
        raise CannotFoldZero(f"{original.name} has a symbolic shape {tuple(value.shape)}")
    zeros = call_with_val(
        graph, aten.full.default, (list(value.shape), 0.0),
        {"dtype": value.dtype, "layout": torch.strided, "device": value.device,
         "pin_memory": False}, fake_mode=fake_mode)
    made(zeros)
    return zeros
