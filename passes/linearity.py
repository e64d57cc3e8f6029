"""Which ops are linear in the loss gradient.

An early block's backward is computed in the forward with the loss gradient
replaced by a seed ``s`` and returned from the backward as ``T / s * grad``.
That is exact only if every op between the tangent ``T`` and the gradients is
linear in ``T``. Autograd's derivative formulas are (a vector-Jacobian product
is linear in the cotangent), but a custom ``autograd.Function`` may clip,
normalise or square its incoming gradient. So each node of a candidate block
that reads a tangent-dependent value is checked here against known-linear ops;
an op not listed keeps the block in the backward, with the op named.

``linearity_violation(node, dependent)`` returns why the node may not be
linear in the tangent-dependent values ``dependent``, or ``None``.
"""
from __future__ import annotations

import operator
from collections.abc import Container
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims


def _packets(*names: str) -> frozenset:
    """The op packets named ``namespace.op`` that this torch version has."""
    found = []
    for name in names:
        namespace, op = name.split(".")
        try:
            found.append(getattr(getattr(torch.ops, namespace), op))
        except AttributeError:  # NB: op lists differ across torch 2.11-2.15
            continue
    return frozenset(found)


#: f(x, rest...) linear in x when only x (argument 0) depends on the tangent.
LINEAR_IN_FIRST = _packets(
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten._reshape_alias", "aten.expand",
    "aten.permute", "aten.t", "aten.transpose", "aten.squeeze", "aten.unsqueeze", "aten.clone",
    "aten.contiguous", "aten.alias", "aten.detach", "aten.neg", "aten.sum", "aten.mean",
    "aten._to_copy", "aten.to", "aten.slice", "aten.select", "aten.narrow", "aten.as_strided",
    "aten.flip", "aten.roll", "aten.repeat", "aten.tril", "aten.triu", "aten.diagonal",
    "aten.diag_embed", "aten.cumsum", "aten.split", "aten.split_with_sizes", "aten.unbind",
    "aten.chunk", "aten.index", "aten.index_select", "aten.gather", "aten.select_backward",
    "aten.slice_backward", "aten.unfold", "aten.movedim", "aten.flatten", "aten.unflatten",
    "aten.view_copy", "aten.expand_copy", "aten.permute_copy", "aten.t_copy",
    "aten.transpose_copy", "aten.unsqueeze_copy", "aten.squeeze_copy", "aten._unsafe_index",
    "aten.real", "aten.view_as_real", "aten.view_as_complex", "aten.conj_physical",
    "aten._conj", "aten.lift_fresh_copy", "prims.convert_element_type", "prims.view_of",
    # zeros shaped like the gradient: they read only its shape, dtype and device
    "aten.zeros_like", "aten.new_zeros",
    "prims.broadcast_in_dim", "prims.squeeze", "prims.sum", "prims.reshape", "prims.transpose",
    "prims.collapse_view", "prims.split_dim", "prims.expand_dims",
)

#: f(a, b, ...) linear in each operand: exactly one tensor operand may depend
#: on the tangent (the product of two tangent-dependent values is quadratic).
MULTILINEAR = _packets(
    "aten.mul", "aten.mm", "aten.bmm", "aten.matmul", "aten.dot", "aten.mv", "aten.outer",
    "aten.convolution", "aten._convolution", "aten.linear", "aten.einsum", "aten._scaled_mm",
    "prims.mul",
)

#: Sums: every tensor operand must depend on the tangent or be a zero constant
#: (``x + c`` with ``c != 0`` is affine, not linear).
ADDITIVE = _packets(
    "aten.add", "aten.sub", "aten.cat", "aten.stack", "prims.add", "prims.sub",
)

#: Ops that combine the values at some argument positions additively (each of
#: those must depend on the tangent or be a zero constant); their other tensor
#: arguments (masks, indices) must not depend on the tangent.
SCATTER_LIKE: dict[Any, tuple[int, ...]] = {
    aten.where: (1, 2),
    aten.index_put: (0, 2),
    aten._unsafe_index_put: (0, 2),
    aten.index_add: (0, 3),
    aten.scatter_add: (0, 3),
    aten.slice_scatter: (0, 1),
    aten.select_scatter: (0, 1),
    aten.diagonal_scatter: (0, 1),
    aten.as_strided_scatter: (0, 1),
    aten.masked_fill: (0, 2),
    aten.constant_pad_nd: (0, 2),
    aten.copy: (1,),
    aten.masked_scatter: (0, 2),
    **{packet: (0, 3) for packet in _packets(
        # Inductor's decompositions of an embedding's backward and of masked indexing
        "aten._unsafe_masked_index_put_accumulate", "aten._unsafe_masked_index")},
}

#: fma(a, b, c) = a * b + c (Inductor decomposes softmax's backward into it):
#: linear when exactly one factor depends on the tangent and the addend does
#: too or is zero.
#: (``prims.fma`` is registered by Inductor on import: matched by name.)
FMA_NAMES = frozenset({"prims::fma"})

#: The quotient x / y is linear in x only.
DIVISION = _packets(
    "aten.div", "prims.div",
)

_CONCATENATIONS = _packets("aten.cat", "aten.stack")

ZERO_FACTORIES = _packets(
    "aten.zeros", "aten.zeros_like", "aten.new_zeros", "aten.full", "aten.full_like",
    "aten.new_full", "aten.scalar_tensor", "aten.fill",
)


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def is_zero_constant(arg: Any) -> bool:
    """A Python zero, or a node that builds an all-zero tensor."""
    if isinstance(arg, (bool, int, float)):
        return arg == 0
    if not isinstance(arg, fx.Node) or arg.op != "call_function":
        return False
    packet = _packet(arg.target)
    if packet not in ZERO_FACTORIES:
        return False
    if packet in (aten.zeros, aten.zeros_like, aten.new_zeros):
        return True
    # full(size, value) / full_like(x, value) / new_full(x, size, value) /
    # scalar_tensor(value) / fill(x, value)
    value_pos = {aten.full: 1, aten.full_like: 1, aten.new_full: 2, aten.scalar_tensor: 0,
                 aten.fill: 1}[packet]
    value = arg.kwargs.get("fill_value", arg.kwargs.get("s", arg.kwargs.get("value")))
    if value is None and len(arg.args) > value_pos:
        value = arg.args[value_pos]
    return isinstance(value, (bool, int, float)) and value == 0


def _is_backward_op(packet: Any) -> bool:
    name = getattr(packet, "__name__", "")
    return name.endswith("_backward") or name.endswith("_backward_data")


def _tensor_args(node: fx.Node) -> list[tuple[Any, Any]]:
    """(position or keyword, value) of each fx.Node argument, lists flattened."""
    found: list[tuple[Any, Any]] = []
    for key, value in [*enumerate(node.args), *node.kwargs.items()]:
        if isinstance(value, (list, tuple)):
            found.extend((key, v) for v in value if isinstance(v, fx.Node))
        elif isinstance(value, fx.Node):
            found.append((key, value))
    return found


def linearity_violation(node: fx.Node, dependent: Container[fx.Node]) -> str | None:
    """Why ``node`` may not be linear in the tangent-dependent nodes, or None if it is."""
    if node.op != "call_function":
        return f"{node.op} {node.target} is not a plain op"
    args = _tensor_args(node)
    dep = [(key, a) for key, a in args if a in dependent]
    if not dep:
        return None
    target = node.target
    if target is operator.getitem:
        return None
    packet = _packet(target)
    op_name = str(target)
    keys = {key for key, _ in dep}

    if packet in LINEAR_IN_FIRST:
        if keys == {0}:
            return None
        return f"{op_name} reads the loss gradient in a non-linear position"
    if packet in MULTILINEAR:
        if len(dep) == 1:
            return None
        return f"{op_name} multiplies two values that depend on the loss gradient"
    if packet in DIVISION:
        if keys == {0}:
            return None
        return f"{op_name} divides by a value that depends on the loss gradient"
    if getattr(packet, "_qualified_op_name", None) in FMA_NAMES:
        return _fma_violation(node, keys, op_name)
    if packet in ADDITIVE:
        others = [a for _, a in args if a not in dependent]
        if all(is_zero_constant(a) for a in others) and _scalar_operands_are_zero(node, packet):
            return None
        return f"{op_name} adds a constant to the loss gradient (affine, not linear)"
    if packet in SCATTER_LIKE:
        positions = SCATTER_LIKE[packet]
        if not keys <= set(positions):
            return f"{op_name} reads the loss gradient in a non-linear position"
        for pos in positions:
            if pos in keys:
                continue
            value = node.args[pos] if pos < len(node.args) else None
            if value is not None and not is_zero_constant(value):
                return f"{op_name} mixes the loss gradient with a non-zero value"
        return None
    if _is_backward_op(packet):
        schema = getattr(target, "_schema", None)
        if schema is None:
            return f"{op_name} has no schema"
        arg_names = [a.name for a in schema.arguments]
        for key in keys:
            name = key if isinstance(key, str) else (arg_names[key] if key < len(arg_names) else "")
            if not name.startswith("grad"):
                return f"{op_name} reads the loss gradient through its argument {name!r}"
        return None
    return f"{op_name} is not known to be linear in the loss gradient"


def _fma_violation(node: fx.Node, keys: set, op_name: str) -> str | None:
    factors = keys & {0, 1}
    if len(factors) == 2:
        return f"{op_name} multiplies two values that depend on the loss gradient"
    addend = node.args[2] if len(node.args) > 2 else None
    if not factors:
        return f"{op_name} adds the loss gradient to a product that does not depend on it"
    if 2 in keys or is_zero_constant(addend):
        return None
    return f"{op_name} adds a constant to the loss gradient (affine, not linear)"


def _scalar_operands_are_zero(node: fx.Node, packet: Any) -> bool:
    """For add/sub with a Python scalar operand (``x + 2``), that scalar must be 0.

    (``cat``'s and ``stack``'s scalar argument is the dimension, not an operand;
    ``alpha`` scales an operand and keeps the sum linear.)
    """
    if packet in _CONCATENATIONS:
        return True
    value = node.args[1] if len(node.args) > 1 else None
    return not (isinstance(value, (bool, int, float)) and value != 0)
