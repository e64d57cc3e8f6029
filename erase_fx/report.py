"""What erase_fx decided about each compiled graph, as data.

A `GraphReport` is made for every graph the backend compiles. `explain`
returns them, the dump writes them as ``report.json``, the CLI prints them,
and the ``erase_fx`` logger sums each up in one INFO line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.passes import (
    Block,
    BlockAnalysis,
    RejectReason,
    stages_go_to_side_streams,
    stream_of_block,
)
from erase_fx.passes.split_at_sums import module_path


@dataclasses.dataclass(frozen=True)
class BlockReport:
    """An early block: its backward runs during the forward.

    Attributes:
        id: the block's index, in ready-point order.
        params: qualified names of the parameters (graph inputs) whose
            gradients it computes.
        ready_after: the forward node after which it can run (its last
            forward producer; its first piece's, for a block in pieces), by
            its name in the joint graph.
        tangent: the output gradient its result is scaled by.
        stream: the side stream it runs on.
        num_nodes: how many graph nodes its backward has.
        flops: estimated FLOPs of its backward.
        partials: how many values it hands to sums in the backward: its
            parts of gradients that other loss terms add to (a shared
            parameter's, or a value read without detach); 0 for a block
            whose backward shares nothing.
        pieces: how many pieces it launches in, each at its own ready point
            on its stream (its loss terms' parts, then their sums and what
            follows); 0 for a block launched whole.
        ready_after_origin: where in the model ``ready_after`` is, for
            people: the module and the op (`node_origin`), e.g.
            ``stages.0.head (cross_entropy)``; None when the report was made
            without the joint graph.
        other_outputs: the outputs besides the loss it reads the gradients of
            (tensors kept for logging, captured by hooks), each named with where
            the user's code makes it (`erase_fx.names.output_names`): their part
            of its gradients runs in the backward, only when they get a gradient.
        at_graph_end: it is ready only when the graph's forward ends, and runs
            there while what follows the graph runs (`erase_fx.emit.graph_end`).
    """

    id: int
    params: tuple[str, ...]
    ready_after: str
    tangent: str
    stream: int
    num_nodes: int
    flops: int
    partials: int = 0
    pieces: int = 0
    ready_after_origin: str | None = None
    other_outputs: tuple[str, ...] = ()
    at_graph_end: bool = False


@dataclasses.dataclass(frozen=True)
class RejectedReport:
    """A backward component that stays in the backward.

    Attributes:
        params: the parameters whose gradients it computes.
        reason: a `RejectReason` value, e.g. ``"last_block"`` or ``"not_linear"``.
        detail: the reason in words.
        node: the graph node the reason is about, if any.
        num_nodes: how many graph nodes it has.
        flops: estimated FLOPs.
        node_origin: where in the model ``node`` is (`node_origin`); None
            without a node, or when the report was made without the joint graph.
    """

    params: tuple[str, ...]
    reason: str
    detail: str
    node: str | None
    num_nodes: int
    flops: int
    node_origin: str | None = None


@dataclasses.dataclass(frozen=True)
class GraphBreakReport:
    """Where and why Dynamo ended a graph before the end of the user's function: a graph break.

    The code after it runs in the next graph Dynamo compiles (or eagerly), so
    no backward in this graph can overlap that code's forward from inside it.
    Made by `erase_fx.graph_breaks.graph_break_of` from Dynamo's own record.

    Attributes:
        reason: Dynamo's name for the break, one line, e.g. ``Unsupported
            Tensor.item() call with capture_scalar_outputs=False`` or
            ``Dynamic shape operator``.
        explanation: Dynamo's explanation ("" where it gives none).
        hints: Dynamo's hints: what to change.
        file: the file of the user's code the break is in: the innermost
            frame of the break's stack outside torch's own sources.
        line: the line number there.
        function: the function there (Dynamo names the code after an
            earlier break ``torch_dynamo_resume_in_<function>_at_<line>``).
        code: that line of source, stripped ("" when unknown).
        inside_torch: the torch function the break happened in, called from
            that line (``torch.autograd.function.apply``), or "" when the
            break is in the user's code itself.
        documentation: Dynamo's page about this kind of break, or "".
    """

    reason: str
    explanation: str = ""
    hints: tuple[str, ...] = ()
    file: str = ""
    line: int = 0
    function: str = ""
    code: str = ""
    inside_torch: str = ""
    documentation: str = ""

    @property
    def where(self) -> str:
        """``file:line``, the file relative to the working folder when inside it."""
        return f"{short_path(self.file)}:{self.line}" if self.file else "an unknown place"


def short_path(path: str) -> str:
    """``path`` relative to the working folder if it is inside it, else as it is."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith(os.pardir) else relative


@dataclasses.dataclass(frozen=True)
class Whereabouts:
    """Where the nodes an analysis names are, for people, read from its joint graph while
    the graph is at hand (a report is built once the compilation is done, without it).

    Attributes:
        origins: each ready point and rejected node, by name: where in the model it is
            (`node_origin`).
        outputs: each tangent a block (its loss's, and the others it reads) or a rejected
            component reads, by name: the output it is the gradient of, named with where the
            user's code makes it (`erase_fx.names.output_names`), where AOT's descriptor
            says which.
    """

    origins: Mapping[str, str] = dataclasses.field(default_factory=dict)
    outputs: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, analysis: BlockAnalysis, joint: fx.GraphModule,
           output_names: Sequence[str] = ()) -> Whereabouts:
        by_name = {node.name: node for node in joint.graph.nodes}
        named = [ready_point(b) for b in analysis.blocks] + [r.node for r in analysis.rejected]
        tangents = ([t for b in analysis.blocks for t in (b.tangent, *b.other_tangents)]
                    + [t for r in analysis.rejected for t in r.component.tangents])
        outputs = {}
        for tangent in tangents:
            index = getattr(getattr(by_name.get(tangent), "meta", {}).get("desc"), "output",
                            None)
            index = getattr(index, "idx", None)
            if isinstance(index, int) and index < len(output_names):
                outputs[tangent] = output_names[index]
        return cls({name: node_origin(by_name[name]) for name in named if name in by_name},
                   outputs)

    def origin(self, name: str | None) -> str | None:
        """Where node ``name`` is in the model, or None when unknown."""
        return self.origins.get(name) if name is not None else None

    def output(self, tangent: str) -> str:
        """The output ``tangent`` is the gradient of."""
        return self.outputs.get(tangent, f"the output whose gradient is {tangent}")


@dataclasses.dataclass(frozen=True)
class GraphReport:
    """erase_fx's decisions about one compiled graph.

    Attributes:
        graph_id: the backend's sequence number for the graph (0, 1, ...).
        blocks: the early blocks.
        rejected: the components left in the backward, with reasons.
        fallback_reason: why the graph took the stock path, or None.
        backward_flops: estimated FLOPs of the whole backward.
        early_flops: estimated FLOPs of the backward that runs early.
        streams: how many side streams the config allows.
        inner: the inner compiler.
        stages_on_side: the blocks' stages run on their side streams
            (`Tuning.stages_on_side`; blocks in pieces keep theirs on the
            main stream).
        input_copies: how many values made from the inputs alone (a
            cross-entropy's mask of the labels) each block that reads them
            makes itself instead of sharing one (`Tuning.copy_input_values`);
            set once the forward is compiled.
        input_copy_bytes: the bytes of those values, summed (the values
            early nodes read; large values their copies are made through, a
            mask the row sums are taken of, are not counted again).
        recomputed_values: how many values the block segments recompute
            instead of reading them across their segment boundaries
            (`Tuning.recompute_boundary_values`); set once the forward is
            compiled.
        boundary_bytes_before: the bytes the block segments read across their
            boundaries before that recomputation, summed over the segments
            that recompute something ...
        boundary_bytes_after: ... and after it.
        early_updatable: how many parameters an optimizer inside
            ``compile_step(..., early_optimizer=True)`` may update during the
            forward: those whose whole gradient is early and that nothing reads
            once their block is done (`erase_fx.early_update.plan_early_updates`;
            the step's own conditions are checked at capture); set once the
            forward is compiled.
        whole_early_grads: how many parameters have a whole early gradient (the
            candidates for the above).
        graph_break: where and why Dynamo ended this graph at a graph break
            (`GraphBreakReport`), or None where the graph ends where the
            user's function returns; set by `erase_fx.explain`.
        learned_seed: the early blocks run at the loss gradient of the graph's
            last backward, not at ``seed``: a graph that computes in float16
            (`erase_fx.emit.loss_seed`); until its first backward it runs as
            ``aot_eager``.
    """

    graph_id: int
    blocks: tuple[BlockReport, ...] = ()
    rejected: tuple[RejectedReport, ...] = ()
    fallback_reason: str | None = None
    backward_flops: int = 0
    early_flops: int = 0
    streams: int = 0
    inner: str = ""
    stages_on_side: bool = False
    input_copies: int = 0
    input_copy_bytes: int = 0
    recomputed_values: int = 0
    boundary_bytes_before: int = 0
    boundary_bytes_after: int = 0
    early_updatable: int = 0
    whole_early_grads: int = 0
    graph_break: GraphBreakReport | None = None
    learned_seed: bool = False

    @property
    def early_share(self) -> float:
        """Fraction of backward FLOPs that run early (0 when there is no backward)."""
        return self.early_flops / self.backward_flops if self.backward_flops else 0.0

    @classmethod
    def from_analysis(cls, graph_id: int, analysis: BlockAnalysis, cfg: EraseConfig,
                      where: Whereabouts | None = None) -> GraphReport:
        """The report of ``analysis``; with the `Whereabouts` of its joint graph, each ready
        point and rejected node also says where in the model it is, and each tangent which
        output it is the gradient of."""
        where = where if where is not None else Whereabouts()
        origin, output = where.origin, where.output
        return cls(
            graph_id=graph_id,
            blocks=tuple(
                BlockReport(
                    id=b.id,
                    params=b.params,
                    ready_after=ready_point(b),
                    tangent=b.tangent,
                    stream=stream_of_block(b.id, cfg),
                    num_nodes=b.component.num_nodes,
                    flops=b.component.flops,
                    partials=len(b.component.partials),
                    pieces=len(b.component.pieces),
                    ready_after_origin=origin(ready_point(b)),
                    other_outputs=tuple(output(t) for t in b.other_tangents),
                    at_graph_end=b.at_graph_end,
                )
                for b in analysis.blocks
            ),
            rejected=tuple(
                RejectedReport(
                    params=r.params,
                    reason=r.reason.value,
                    detail=r.detail + (
                        "; the outputs it reads the gradients of: "
                        + "; ".join(output(t) for t in r.component.tangents)
                        if r.reason is RejectReason.NOT_SCALAR_TANGENT else ""),
                    node=r.node,
                    num_nodes=r.component.num_nodes,
                    flops=r.component.flops,
                    node_origin=origin(r.node),
                )
                for r in analysis.rejected
            ),
            backward_flops=analysis.backward_flops,
            early_flops=analysis.early_flops,
            streams=cfg.streams,
            inner=cfg.inner,
            stages_on_side=bool(analysis.blocks)
            and stages_go_to_side_streams(cfg, len(analysis.blocks)),
        )

    def with_fallback(self, reason: str) -> GraphReport:
        """The report of a graph that took the stock path: no early block."""
        return dataclasses.replace(self, blocks=(), early_flops=0, stages_on_side=False,
                                   input_copies=0, input_copy_bytes=0, recomputed_values=0,
                                   boundary_bytes_before=0, boundary_bytes_after=0,
                                   early_updatable=0, whole_early_grads=0,
                                   learned_seed=False, fallback_reason=reason)

    def summary(self) -> str:
        """One line: what the logger prints per compiled graph."""
        text = (
            f"graph {self.graph_id}: {len(self.blocks)} early block(s), "
            f"{len(self.rejected)} component(s) left in the backward, "
            f"early share of backward FLOPs {self.early_share:.0%}"
        )
        if self.fallback_reason:
            text += f"; stock path: {self.fallback_reason}"
        if self.graph_break is not None:
            text += (f"; ends at a graph break at {self.graph_break.where} "
                     f"({self.graph_break.reason})")
        return text

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GraphReport:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown GraphReport fields: {sorted(unknown)}")
        data = dict(data)
        data["blocks"] = tuple(
            BlockReport(**{**b, "params": tuple(b["params"]),
                           "other_outputs": tuple(b.get("other_outputs", ()))})
            for b in data.get("blocks", ())
        )
        data["rejected"] = tuple(
            RejectedReport(**{**r, "params": tuple(r["params"])}) for r in data.get("rejected", ())
        )
        if data.get("graph_break") is not None:
            brk = data["graph_break"]
            data["graph_break"] = GraphBreakReport(**{**brk, "hints": tuple(brk.get("hints", ()))})
        return cls(**data)


def ready_point(block: Block) -> str:
    """The forward node after which ``block`` can run: its first piece's, for a block in
    pieces."""
    return (block.component.piece_ready or (block.component.ready_after,))[0]


def node_origin(node: fx.Node) -> str:
    """Where in the model a joint-graph node is, for people: ``tower_heads.0 (squeeze)``.

    The module is the one whose forward made the node (`module_path`), or,
    for code of a forward that calls no module (a loss computed in the
    model's own ``forward``), the nearest module upstream whose output it
    reads. The op is the function or module class Dynamo recorded
    (``source_fn_stack``: ``cross_entropy``, ``Linear``), else the aten op.
    Only the op when no module is found.
    """
    module = module_path(node) or _nearest_module_upstream(node)
    return f"{module} ({_op_name(node)})" if module else _op_name(node)


def _op_name(node: fx.Node) -> str:
    for key in ("source_fn_stack", "fwd_source_fn_stack"):
        if node.meta.get(key):
            source = node.meta[key][-1][-1]
            return source if isinstance(source, str) else getattr(source, "__name__", node.name)
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or node.name


def _nearest_module_upstream(node: fx.Node) -> str | None:
    """The `module_path` of the closest input (breadth first, inputs in order) that has one."""
    seen = {node}
    frontier = [node]
    while frontier:
        inputs = []
        for current in frontier:
            for source in current.all_input_nodes:
                if source not in seen:
                    seen.add(source)
                    inputs.append(source)
        for source in inputs:
            path = module_path(source)
            if path:
                return path
        frontier = inputs
    return None


# Reports are published to every open `collect_reports()` of this thread.
_sinks = threading.local()


@contextlib.contextmanager
def collect_reports() -> Iterator[list[GraphReport]]:
    """Collect the reports of every graph the erase backend compiles in this block."""
    stack = _sinks.__dict__.setdefault("stack", [])
    reports: list[GraphReport] = []
    stack.append(reports)
    try:
        yield reports
    finally:
        stack.remove(reports)


def publish(report: GraphReport) -> None:
    for reports in _sinks.__dict__.get("stack", []):
        reports.append(report)


def revise(old: GraphReport, new: GraphReport) -> None:
    """Replace a published report (the backward, compiled at the first ``.backward()``, fell back)."""
    for reports in _sinks.__dict__.get("stack", []):
        for i, report in enumerate(reports):
            if report is old:
                reports[i] = new
