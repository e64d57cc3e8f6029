"""What one graph's compilation is given, and what it decides, as frozen data.

AOTAutograd calls `erase_fx.compilation.GraphCompilation` back in stages
(partition, then the forward's compile, then, at the first ``.backward()``,
the backward's), so a compilation decides in stages too; each stage records
what it decided once, here:

    CompileRequest  what the backend gives, before AOTAutograd calls back
    JointPlan       what ``partition`` decided: the blocks found (`FoundBlocks`), whether
                    the partition scheduled them, and what their gradients do besides the
                    backward (all-reduced in the forward under DDP, else the whole early
                    gradients an optimizer may update early)
    ForwardPlan     what ``compile_forward`` decided: the stream program, the early work
                    hooked to it (`EarlyHook`), the CUDA graph it replays from, and what
                    the forward's passes and the early updates' plan decided
    Fallback        a failure the graph survived, on the stock path

The report is built once from them (`report_of`), whenever it is asked for:
at the end of the backend's call, and again when the backward, compiled at
the first ``.backward()``, falls back.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from erase_fx.config import EraseConfig
from erase_fx.ddp import EarlyAllReduce
from erase_fx.early_grads import EarlyGrad
from erase_fx.emit import StreamProgram
from erase_fx.emit.cudagraphs import GraphedForward
from erase_fx.emit.graph_end import GraphEnd
from erase_fx.emit.live_tangents import LiveTangents
from erase_fx.passes import BlockAnalysis, BoundaryRecomputes, InputValueCopies
from erase_fx.report import GraphReport, Whereabouts


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """What the backend gives one graph's compilation: fixed for its life.

    Attributes:
        cfg: the settings.
        graph_id: the backend's sequence number for the graph (0, 1, ...).
        input_names: each input of the Dynamo graph, by the name users know it by
            (`erase_fx.names.input_names`).
        output_names: each output of the Dynamo graph, named with where the user's code
            makes it (`erase_fx.names.output_names`).
        more_forward_follows: more of the user's forward runs after this graph (Dynamo
            ended it at a graph break, or a module's forward calls it uncompiled:
            `erase_fx.backend.more_forward_follows`), which its last block's backward can
            overlap (`erase_fx.emit.graph_end`).
        data_parallel: the DDP module whose forward this graph is part of
            (`erase_fx.ddp`), or None.
        require_early_blocks: a whole graph kept from Dynamo's DDP optimizer: without
            early blocks, it is handed back to be split (`erase_fx.ddp.NoEarlyBlocks`).
        loss_seed: a float16 graph's learned seed (`erase_fx.emit.loss_seed`): the graph
            has its input, last, and its early blocks run at it; None: at ``cfg.early_seed``.
    """

    cfg: EraseConfig
    graph_id: int
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    more_forward_follows: bool = False
    data_parallel: Any = None
    require_early_blocks: bool = False
    loss_seed: Any = None

    @property
    def runs_graph_end(self) -> bool:
        """Whether a block ready only when the forward ends runs there
        (`erase_fx.emit.graph_end`): where more of the forward follows the graph, for the
        program to overlap. NB: the program runs such
        a block or leaves it to the backward, so it needs segments (side streams); under
        DDP the early all-reduce needs every early gradient made in the forward. A graph
        that ends at the forward's return keeps its last block in the backward, as stock
        does (nothing but the backward would follow it), unless
        ``tuning.graph_end_at_return``."""
        follows = self.more_forward_follows or self.cfg.tuning.graph_end_at_return
        return (follows and self.cfg.streams > 0
                and self.data_parallel is None)


@dataclasses.dataclass(frozen=True)
class FoundBlocks:
    """The blocks `find_stop_gradient_blocks` found, with what is read of the joint graph
    they were found in while it is at hand (the plan outlives it).

    Attributes:
        analysis: the pass's artifact: the blocks, and the components left in the backward.
        where: where each node the report names is in the model, and each tangent's output.
        unused_tangents: the tangents early blocks read besides their loss's, when the
            outputs they are the gradients of can be watched: a backward without them runs
            when none gets a gradient (`erase_fx.emit.live_tangents`) ...
        live_tangents: ... and what watches those outputs and the blocks' losses (a
            warning where a loss gets no gradient), or None where there is neither.
        loss_outputs: the indices, among the compiled graph's outputs, of the blocks'
            losses that are plain outputs (a learned seed is read from their gradients).
    """

    analysis: BlockAnalysis
    where: Whereabouts = Whereabouts()
    unused_tangents: tuple[str, ...] = ()
    live_tangents: LiveTangents | None = None
    loss_outputs: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class JointPlan:
    """What ``partition`` decided for the joint graph.

    Attributes:
        num_fwd_outputs: how many of the forward's outputs are the user's (the rest are
            saved for the backward).
        found: the analysis, kept when a later joint pass failed; None where it did not
            run or failed itself.
        early_blocks: the partition scheduled early blocks (else: the stock partition).
        early_allreduce: under DDP, the early gradients the forward all-reduces
            (`erase_fx.ddp`), or None.
        early_grads: without DDP, the whole early gradients, those an optimizer may update
            early (`erase_fx.early_grads.plan_early_grads`), narrowed once the forward's
            passes have run (`erase_fx.early_update.plan_early_updates`).
        differentiable_outputs: how many outputs the backward takes a gradient for.
    """

    num_fwd_outputs: int
    found: FoundBlocks | None = None
    early_blocks: bool = False
    early_allreduce: EarlyAllReduce | None = None
    early_grads: tuple[EarlyGrad, ...] = ()
    differentiable_outputs: int = 0

    @property
    def blocks(self) -> int:
        """How many early blocks the partition scheduled."""
        return len(self.found.analysis.blocks) if self.early_blocks and self.found else 0

    @property
    def live_tangents(self) -> LiveTangents | None:
        """What watches the early blocks' losses and the outputs besides them that the
        blocks read the gradients of, where the partition scheduled blocks; else None."""
        return self.found.live_tangents if self.early_blocks and self.found else None

    @property
    def unused_tangents(self) -> tuple[str, ...]:
        """The tangents the backward without those outputs' gradients takes as zero."""
        return self.found.unused_tangents if self.early_blocks and self.found else ()


class EarlyHook(Protocol):
    """Work on the early gradients besides the backward's: one completion hook per block on
    the forward's program, and the backward wrapped to match (`erase_fx.ddp.EarlyAllReduce`,
    `erase_fx.early_update.EarlyUpdates`)."""

    def attach(self, program: StreamProgram) -> None: ...

    def wrap_backward(self, compiled: Any) -> Any: ...


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """Which whole early gradients an optimizer may update during the forward
    (`erase_fx.early_update.plan_early_updates`).

    Attributes:
        grads: the whole early gradients (`JointPlan.early_grads`).
        planned: of them, those whose parameter the forward reads only before them.
        unprovable: why none may be updated early, decided at compile time
            (`erase_fx.early_update.unprovable_loss_gradient`), or None.
    """

    grads: tuple[EarlyGrad, ...]
    planned: tuple[EarlyGrad, ...]
    unprovable: str | None = None


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """What ``compile_forward`` decided.

    Attributes:
        program: the forward in segments, on streams; None where it was compiled whole
            (no early block, no side stream, or the segments failed).
        early_hooks: the early work hooked to ``program``, in order; the backward is
            wrapped with the same (`wrap_backward`).
        graphed: the CUDA graph the forward replays from, or None.
        input_copies: what `copy_input_values_per_block` decided, or None where it did
            not run ...
        recomputes: ... `recompute_boundary_values` ...
        updates: ... and the early updates' plan. NB: each is kept once made, also when
            a later step failed and the forward was compiled whole.
    """

    program: StreamProgram | None = None
    early_hooks: tuple[EarlyHook, ...] = ()
    graphed: GraphedForward | None = None
    input_copies: InputValueCopies | None = None
    recomputes: BoundaryRecomputes | None = None
    updates: UpdatePlan | None = None

    @property
    def graph_end(self) -> GraphEnd | None:
        """The program's blocks at the graph's end (`erase_fx.emit.graph_end`), or None."""
        return self.program.graph_end if self.program is not None else None

    def wrap_backward(self, compiled: Any) -> Any:
        """The compiled backward wrapped by each early hook, in order."""
        for hook in self.early_hooks:
            compiled = hook.wrap_backward(compiled)
        return compiled

    def report_fields(self) -> dict[str, int]:
        """The `GraphReport` fields these decisions set."""
        fields = {}
        if self.input_copies is not None:
            sizes = self.input_copies.sizes
            fields.update(input_copies=len(sizes), input_copy_bytes=sum(sizes.values()))
        if self.recomputes is not None:
            found = self.recomputes
            fields.update(
                recomputed_values=sum(map(len, found.recomputed.values())),
                boundary_bytes_before=sum(found.bytes_before.get(k, 0) for k in found.recomputed),
                boundary_bytes_after=sum(found.bytes_after.get(k, 0) for k in found.recomputed))
        if self.updates is not None:
            updates = self.updates
            fields.update(early_updatable=0 if updates.unprovable else len(updates.planned),
                          whole_early_grads=len(updates.grads))
        return fields


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A failure the graph survived, on the stock path.

    Attributes:
        reason: what failed, or why the graph has no early block, in words.
        keeps_schedule: the early blocks still run in the forward, on one stream (the
            forward's segments or the backward's passes failed); else the graph runs none.
    """

    reason: str
    keeps_schedule: bool = False


def report_of(request: CompileRequest, joint: JointPlan | None, forward: ForwardPlan | None,
              fallbacks: Sequence[Fallback]) -> GraphReport:
    """The report of one graph, from what its compilation decided: the analysis (its blocks,
    the components left in the backward), what the forward decided, and the fallbacks: the
    last one's reason is the report's; if any dropped the schedule, the report has no early
    block (`GraphReport.with_fallback`)."""
    cfg = request.cfg
    found = joint.found if joint is not None else None
    if found is None:
        report = GraphReport(graph_id=request.graph_id, streams=cfg.streams, inner=cfg.inner)
    else:
        report = GraphReport.from_analysis(request.graph_id, found.analysis, cfg, found.where)
    if forward is not None:
        report = dataclasses.replace(report, **forward.report_fields())
    if request.loss_seed is not None and report.blocks:
        report = dataclasses.replace(report, learned_seed=True)
    if not fallbacks:
        return report
    if all(fallback.keeps_schedule for fallback in fallbacks):
        return dataclasses.replace(report, fallback_reason=fallbacks[-1].reason)
    return report.with_fallback(fallbacks[-1].reason)
