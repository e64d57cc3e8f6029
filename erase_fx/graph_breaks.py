"""Dynamo's record of why it ended a graph, as a `GraphBreakReport`.

When Dynamo meets code it cannot put in a graph (a ``Tensor.item()``, a
data-dependent op such as ``nonzero``, a call it cannot trace), it compiles
the graph so far, runs that code eagerly, and starts a new graph after it. A
backward in the graph before the break is then ready only when that graph's
forward ends, so users need to know where the breaks are and why.

NB: the torch API this relies on (torch 2.11-2.14): Dynamo sets
``gm.compile_subgraph_reason``, a ``torch._dynamo.output_graph.GraphCompileReason``
(``reason``, ``user_stack``, ``graph_break``), on every graph it hands a
backend. It is the record ``torch._dynamo.explain`` reads itself
(``torch._dynamo.backends.debugging._explain_graph_detail``), with no reset
of Dynamo's caches, which ``torch._dynamo.explain`` does. The reason's text
is laid out by ``torch._dynamo.exc.format_graph_break_message`` (a one-line
name, then ``Explanation:``, ``Hint:`` lines, a developer context and a
documentation link); older one-line reasons are read as the name alone.
``tests/test_graph_breaks.py`` pins both.
"""
from __future__ import annotations

import os
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from erase_fx.report import GraphBreakReport

#: Where torch's own sources are: frames there are not the user's code.
TORCH_ROOT = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

_EXPLANATION = "Explanation:"
_HINT = "Hint:"
_CONTEXT = "Developer debug context:"
_DOCUMENTATION = "For more details about this graph break, please visit:"


def ends_at_graph_break(gm: Any) -> bool:
    """Whether Dynamo ended the graph ``gm`` at a graph break (more of the forward follows it).

    NB: Dynamo's ``gm.compile_subgraph_reason`` (a ``GraphCompileReason``, torch
    2.11-2.14), the record ``torch._dynamo.explain`` reads; a graph without it (not made
    by Dynamo) counts as ending at its return.
    """
    return bool(getattr(getattr(gm, "compile_subgraph_reason", None), "graph_break", False))


def graph_break_of(gm: Any) -> GraphBreakReport | None:
    """Where and why Dynamo ended the graph ``gm`` at a graph break; None where it ended at
    the function's return, or where Dynamo left no record (a graph not made by Dynamo)."""
    if not ends_at_graph_break(gm):
        return None
    record = gm.compile_subgraph_reason
    reason, explanation, hints, documentation = parse_reason(str(record.reason))
    frame, inside = user_frame(getattr(record, "user_stack", None) or ())
    return GraphBreakReport(
        reason=reason, explanation=explanation, hints=hints, documentation=documentation,
        file=frame.filename if frame else "", line=(frame.lineno or 0) if frame else 0,
        function=frame.name if frame else "", code=(frame.line or "").strip() if frame else "",
        inside_torch=inside)


def parse_reason(text: str) -> tuple[str, str, tuple[str, ...], str]:
    """Dynamo's reason text as ``(name, explanation, hints, documentation link)``.

    The layout is ``torch._dynamo.exc.format_graph_break_message``'s; a
    line it does not start continues the field before it (a hint over
    several lines), and the developer context is left out.
    """
    lines = text.strip().splitlines()
    name = lines[0].strip() if lines else text
    fields: dict[str, list[str]] = {"explanation": [], "documentation": []}
    hints: list[list[str]] = []
    current: list[str] | None = None
    for raw in lines[1:]:
        line = raw.strip()
        if line.startswith(_EXPLANATION):
            current = fields["explanation"]
            line = line[len(_EXPLANATION):]
        elif line.startswith(_HINT):
            current = []
            hints.append(current)
            line = line[len(_HINT):]
        elif line.startswith(_DOCUMENTATION):
            current = fields["documentation"]
            line = line[len(_DOCUMENTATION):]
        elif line.startswith(_CONTEXT):
            current = None
        if current is not None and line.strip():
            current.append(line.strip())
    return (name, " ".join(fields["explanation"]), tuple(" ".join(h) for h in hints if h),
            " ".join(fields["documentation"]))


def user_frame(
    stack: Sequence[traceback.FrameSummary],
) -> tuple[traceback.FrameSummary | None, str]:
    """The innermost frame of ``stack`` in the user's code (outside torch's sources), and the
    torch function called from it that the break is in (``torch.autograd.function.apply``),
    or "" when the break is in the user's code itself."""
    for i in range(len(stack) - 1, -1, -1):
        if not _in_torch(stack[i].filename):
            inner = stack[i + 1] if i + 1 < len(stack) else None
            return stack[i], _torch_function(inner) if inner is not None else ""
    return (stack[-1], "") if stack else (None, "")


def _in_torch(filename: str) -> bool:
    return os.path.abspath(filename).startswith(TORCH_ROOT)


def _torch_function(frame: traceback.FrameSummary) -> str:
    """``torch.autograd.function.apply`` for a frame of ``torch/autograd/function.py``."""
    relative = os.path.relpath(os.path.abspath(frame.filename), os.path.dirname(TORCH_ROOT[:-1]))
    module = os.path.splitext(relative)[0].replace(os.sep, ".")
    return f"{module}.{frame.name}"
