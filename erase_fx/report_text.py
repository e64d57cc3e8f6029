"""Reports as text: the table ``erase-fx explain`` and the demo print.

`format_report` renders a `GraphReport`: each early block with its stream,
parameters, ready point (where in the model: module and op) and estimated
backward FLOPs, then each component left in the backward with its reason,
and under it the reason in words (wrapped: for loss terms that meet in sums
of gradients it names the modules where they meet), then the table's key
(`TABLE_KEY`, which the demo prints once for all its tables). Where
Dynamo ended the graph at a graph break, the report says where in the
user's code (file:line and the line itself), Dynamo's reason, explanation
and hints, and which graph runs what follows (`graph_break_lines`); a block
left in the backward as ``last_block``, or as ``not_scalar_tangent`` (its loss
is computed after the break), names that break too.
`format_reports` renders the reports of one forward, in order, under one
line that counts its graph breaks. `format_table` lays out any rows in
left-aligned columns.
"""
from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from erase_fx.report import BlockReport, GraphBreakReport, GraphReport, RejectedReport

#: How many parameter names a table row shows before "...".
PARAM_NAMES_SHOWN = 2


def format_reports(reports: Sequence[GraphReport]) -> str:
    """`format_report` of each graph, in the order Dynamo compiled them (the order they run in
    on the first call), each graph break pointing at the graph that follows it."""
    breaks = sum(1 for report in reports if report.graph_break is not None)
    preamble = ([f"Dynamo split this forward into {_count(len(reports), 'graph')} at "
                 f"{_count(breaks, 'graph break')} (each said under the graph it ends)"]
                if breaks else [])
    following = [report.graph_id for report in reports[1:]] + [None]
    return "\n\n".join(preamble + [format_report(report, next_graph=next_graph)
                                    for report, next_graph in zip(reports, following)])


def format_report(report: GraphReport, *, number: int | None = None, key: bool = True,
                  next_graph: int | None = None) -> str:
    """A readable table of one graph's early blocks and rejected components.

    ``number``: the graph's number in the heading (default: its ``graph_id``,
    which counts graphs across the process); ``key``: end with `TABLE_KEY`;
    ``next_graph``: the number of the graph that runs what comes after this
    graph's graph break, if it has one (None: not known).
    """
    number = report.graph_id if number is None else number
    lines = [_heading(report, number)]
    if report.fallback_reason:
        lines.append(f"  stock path: {report.fallback_reason}")
    if report.blocks:
        rows = [
            (b.id, b.stream, _count_params(b),
             first_names(b.params),
             ready_point(b) + (f" ({b.pieces} pieces)" if b.pieces else ""), b.num_nodes,
             _si(b.flops), _share(b.flops, report.backward_flops))
            for b in report.blocks
        ]
        headers = ("block", "stream", "#params", "params", "ready after", "nodes", "bwd FLOPs",
                   "share of bwd")
        lines += format_table(headers, rows, indent="  ")
        for b in report.blocks:
            if b.other_outputs:
                lines += _wrapped(
                    f"block {b.id} also reads the gradients of: " + "; ".join(b.other_outputs)
                    + " (their part of its gradients runs in the backward, only when they get "
                    "a gradient)", indent="    ")
    if report.rejected:
        lines.append("  left in the backward:")
        rows = [
            (r.reason, len(r.params), first_names(r.params), r.num_nodes, _si(r.flops),
             _share(r.flops, report.backward_flops))
            for r in report.rejected
        ]
        headers = ("reason", "#params", "params", "nodes", "bwd FLOPs", "share of bwd")
        table = format_table(headers, rows, indent="    ")
        lines.append(table[0])
        for row, rejected in zip(table[1:], report.rejected):
            lines.append(row)
            lines += _wrapped(rejected.detail + _at_node(rejected)
                              + _separated_by_break(rejected, report), indent="      ")
    if report.graph_break is not None:
        lines += graph_break_lines(report.graph_break, number, next_graph)
    if key and (report.blocks or report.rejected):
        lines.append(TABLE_KEY)
    return "\n".join(lines)


def ready_point(block: BlockReport) -> str:
    """The "ready after" cell: where in the model, else the joint graph node's name; for a
    block at the graph's end, that; for one that reads other outputs' gradients, how many."""
    text = "the graph's end" if block.at_graph_end else (
        block.ready_after_origin or block.ready_after)
    count = len(block.other_outputs)
    if count:
        text += f" (+{count} output{'s' if count > 1 else ''})"
    return text


def _at_node(rejected: RejectedReport) -> str:
    if rejected.node is None:
        return ""
    if rejected.node_origin is None:
        return f" (node {rejected.node})"
    return f" (at {rejected.node_origin}, node {rejected.node})"


def graph_break_lines(graph_break: GraphBreakReport, number: int,
                      next_graph: int | None) -> list[str]:
    """Where graph ``number`` ends at a graph break, why (Dynamo's words), what to change, and
    the graph that runs what follows (``next_graph``; None: not known)."""
    inside = f", inside {graph_break.inside_torch}" if graph_break.inside_torch else ""
    after = (f"what follows is graph {next_graph}" if next_graph is not None
             else "what follows runs in a later graph, or eagerly")
    lines = _wrapped(f"graph {number} ends at a graph break at {graph_break.where}{inside} "
                     f"({graph_break.reason}): {after}", indent="  ")
    if graph_break.code:
        lines.append(f"      {graph_break.code}")
    if graph_break.explanation:
        lines += _wrapped(f"Dynamo: {graph_break.explanation}", indent="    ")
    for hint in (*graph_break.hints, *_advice(graph_break)):
        lines += _wrapped(f"hint: {hint}", indent="    ")
    return lines


#: Where a break is in torch's own code, what erase_fx knows the user can change.
_ADVICE_INSIDE_TORCH = {
    "torch.autograd.function.apply": (
        "Dynamo could not trace this autograd.Function's apply; if it is called on an "
        "instance kept as an attribute (self.fn = MyFunction(); self.fn.apply(x)), call it on "
        "the class: MyFunction.apply(x)"),
}


def _advice(graph_break: GraphBreakReport) -> tuple[str, ...]:
    advice = _ADVICE_INSIDE_TORCH.get(graph_break.inside_torch)
    return (advice,) if advice else ()


def _separated_by_break(rejected: RejectedReport, report: GraphReport) -> str:
    """For a component left in the backward of a graph that ends at a graph break, the
    break: it ends a block ready only when the forward ends, or it separates a component
    from the loss its gradient comes from, computed after it."""
    if report.graph_break is None:
        return ""
    where = report.graph_break.where
    if rejected.reason == "last_block":
        return f"; the graph break at {where} (below) separates it from what follows"
    if rejected.reason == "not_scalar_tangent":
        return (f"; its gradient comes from after the graph break at {where} (below): a "
                "block runs early with its loss in its own graph, so compute the loss "
                "before the break")
    return ""


#: What the table's columns mean, printed under each graph's table.
TABLE_KEY = textwrap.fill(
    "#params: parameter tensors whose gradients the component computes, +N parts: values it "
    "adds to gradients that other loss terms share, summed by a joins_blocks row; ready after: "
    "the module and op after which an early block's backward can start (for code outside "
    "modules, the nearest module upstream; the graph node's name is ready_after in --json; "
    "N pieces: it starts there and runs in N pieces, each when ready; the graph's end: it "
    "runs when the forward ends, while what follows the graph runs; +N outputs: it reads the "
    "gradients of N outputs besides the loss, their part runs in the backward when they get "
    "one); stream: the side "
    "stream it runs on; bwd FLOPs: estimated FLOPs of its backward; share of bwd: of the "
    "whole backward's FLOPs)",
    width=100, initial_indent="  (", subsequent_indent="   ", break_on_hyphens=False,
)


#: The width a reason in words wraps at.
DETAIL_WIDTH = 100


def _wrapped(text: str, indent: str) -> list[str]:
    """``text`` in lines of at most `DETAIL_WIDTH` characters, each starting with ``indent``."""
    return textwrap.wrap(text, width=DETAIL_WIDTH, initial_indent=indent,
                         subsequent_indent=indent, break_on_hyphens=False)


def _count_params(block: BlockReport) -> str:
    """``8``, or ``4 +1 part`` for a block that also adds parts to shared gradients."""
    if not block.partials:
        return str(len(block.params))
    return f"{len(block.params)} +{block.partials} part{'s' if block.partials > 1 else ''}"


def _share(flops: int, total: int) -> str:
    return f"{flops / total:.0%}" if total else "-"


def _heading(report: GraphReport, number: int) -> str:
    return (
        f"graph {number}: {_count(len(report.blocks), 'early block')}, "
        f"{_count(len(report.rejected), 'component')} left in the backward\n  "
        f"{report.early_share:.0%} of the backward FLOPs run early "
        f"({_si(report.early_flops)} of {_si(report.backward_flops)}); "
        f"inner {report.inner or '?'}, "
        + (_count(report.streams, "side stream") if report.streams
           else "no side stream (the forward in one graph)")
        + (", each block's stage on its side stream" if report.stages_on_side else "")
        + ("\n  float16: the blocks run at the loss gradient of the last backward (aot_eager "
           "runs the graph until the first)" if report.learned_seed else "")
        + (f"\n  each block makes its own copy of {_count(report.input_copies, 'value')} made "
           f"from the inputs alone ({report.input_copy_bytes / 2**20:.1f} MiB; "
           "copy_input_values)" if report.input_copies else "")
        + (f"\n  the block segments recompute {_count(report.recomputed_values, 'value')} "
           "instead of reading them across their boundaries:\n  "
           f"{report.boundary_bytes_before / 2**20:.2f} -> "
           f"{report.boundary_bytes_after / 2**20:.2f} MiB read (recompute_boundary_values)"
           if report.recomputed_values else "")
        + (f"\n  an optimizer may update {report.early_updatable} of the "
           f"{_count(report.whole_early_grads, 'parameter')} with a whole early gradient "
           "during the forward (compile_step's early_optimizer)"
           if report.whole_early_grads else "")
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def first_names(names: Sequence[str], shown: int = PARAM_NAMES_SHOWN) -> str:
    text = ", ".join(names[:shown])
    return text + (", ..." if len(names) > shown else "")


def _si(value: float) -> str:
    """1234567 -> '1.23M'."""
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:g}"


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = ""
) -> list[str]:
    """Left-aligned columns; the last column is not padded."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return [
        indent + "  ".join(
            cell.ljust(width) if i < len(row) - 1 else cell
            for i, (cell, width) in enumerate(zip(row, widths))
        )
        for row in cells
    ]
