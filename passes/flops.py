"""Estimated floating-point operations of graph nodes, from torch's own FLOP formulas.

Uses the registry behind ``torch.utils.flop_counter.FlopCounterMode`` on each
node's example values. Ops without a formula (elementwise ops, views) count 0:
the estimate covers the matrix work that dominates a block's cost. Symbolic
shapes are evaluated at their example hints.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry


def node_flops(node: fx.Node) -> int:
    if node.op != "call_function":
        return 0
    formula = flop_registry.get(getattr(node.target, "overloadpacket", node.target))
    if formula is None:
        return 0
    # NB: the example values read directly: graph.py imports this module
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda arg: arg.meta.get("val"))
    flops = formula(*args, **kwargs, out_val=node.meta.get("val"))
    return _concrete(flops)


def _concrete(value) -> int:
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else 0
    return int(value)
