"""One backend call: the pipeline from AOTAutograd's joint graph to a multi-stream program.

AOTAutograd calls back into `GraphCompilation` in this order: ``partition``
(the joint graph), then ``compile_forward``, then, lazily at the first
``.backward()``, ``compile_backward``; or only ``compile_inference`` when no
gradient is needed. Each callback runs its pass list, declared once in
`erase_fx.passes.pipeline` (`JOINT_PASSES`, `FORWARD_PASSES`,
`BACKWARD_PASSES`), with `run_passes`, through a `PassRunner` whose
instruments time and dump each pass; then it does what is not a pass::

    partition         JOINT_PASSES; no early block: the stock partitioner. Records a
                      JointPlan: the blocks found, and what their gradients do besides
                      the backward (early all-reduce under DDP, else early updates)
    compile_forward   FORWARD_PASSES, then each segment compiled, and the StreamProgram
                      driving them (CUDA graphs where allowed), the early all-reduce or
                      updates hooked to it; with ``streams=0`` the forward compiled
                      whole, on the main stream. Records a ForwardPlan
    compile_backward  BACKWARD_PASSES, then compiled, as a ScaledBackward (scales early
                      grads in place), wrapped by the forward's early hooks

With Inductor inside, these callbacks plug into stock Inductor's own
``compile_fx`` (`erase_fx.backend`): ``partition`` is its custom partitioner
(called after Inductor's pre-grad and joint-graph passes, in its fake mode)
and ``inner_compile`` its inner compiler, so a graph with no early block is
compiled exactly as ``torch.compile(model)`` compiles it.

Failure policy (``cfg.on_error``): under ``"fallback"`` any error in
erase_fx's own work is logged with its reason and the graph takes the stock
path (stock partitioner; the forward compiled whole, on the current stream).
Gradients are exact either way. Under ``"raise"`` the error propagates.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.ddp import EarlyAllReduce, NoEarlyBlocks, early_allreduce_for
from erase_fx.early_grads import plan_early_grads
from erase_fx.early_update import EarlyUpdates, plan_early_updates, unprovable_loss_gradient
from erase_fx.emit import CudaStreams, StreamProgram, VirtualStreams, compile_graph, compile_segment
from erase_fx.emit.cudagraphs import (
    GraphedForward,
    data_dependent_refusal,
    graph_backward,
    graph_forward,
)
from erase_fx.emit.inductor_segments import (
    compile_inductor_segments,
    keep_early_values_at_fx_strides,
)
from erase_fx.emit.inner import cuda_device_of, example_inputs_of, mark_outputs_user_visible
from erase_fx.emit.graph_end import GraphEndBackward
from erase_fx.emit.loss_seed import SEED_INPUT
from erase_fx.emit.live_tangents import LiveTangents, SelectedBackward, WatchedLoss, plain_outputs
from erase_fx.emit.scale_grads import ScaledBackward
from erase_fx.errors import GraphInvariantError, UnsupportedBlockError
from erase_fx.guards import BackwardGuard
from erase_fx.instruments import PassRunner, TimingInstrument, dump_instrument_for
from erase_fx.passes import (
    BACKWARD_PASSES,
    FORWARD_PASSES,
    JOINT_PASSES,
    UNUSED_TANGENT_BACKWARD_PASSES,
    BlockAnalysis,
    PassResult,
    module_given_to,
    run_passes,
    stock_partition,
)
from erase_fx.passes.graph import is_tangent, primals
from erase_fx.passes.node_meta import is_early
from erase_fx.plan import (
    CompileRequest,
    EarlyHook,
    Fallback,
    ForwardPlan,
    FoundBlocks,
    JointPlan,
    UpdatePlan,
    report_of,
)
from erase_fx.progress import compiling
from erase_fx.report import GraphReport, Whereabouts, revise

log = logging.getLogger("erase_fx")

T = TypeVar("T")
#: What a graph goes without when planning its early optimizer updates fails.
NO_EARLY_UPDATE = "no early optimizer update (the optimizer updates after the backward)"


class GraphCompilation:
    """AOTAutograd's callbacks for one compiled graph, and what each decided.

    What the backend gave is one frozen `CompileRequest`, fixed for the compilation's life.
    Each callback records what it decided once, as a frozen plan (`erase_fx.plan`):
    ``partition`` a `JointPlan`, ``compile_forward`` a `ForwardPlan`; a failure the graph
    survives is a `Fallback`, in order. The report is built from those when asked for
    (`report_of`): at `finish`, and again when the backward, compiled later, falls back.
    """

    def __init__(self, request: CompileRequest):
        #: what the backend gave: the settings, the graph's names, DDP
        self.request = request
        cfg, graph_id = request.cfg, request.graph_id
        self.timing = TimingInstrument()
        self.dump = dump_instrument_for(cfg.dump_dir, graph_id)
        self.runner = PassRunner([self.timing] + ([self.dump] if self.dump else []))
        #: raises clear errors on backward uses erase_fx cannot run (erase_fx.guards)
        self.backward_guard = BackwardGuard()
        #: what ``partition`` decided (None before it, and for an inference graph)
        self.joint: JointPlan | None = None
        #: what ``compile_forward`` decided (None before it)
        self.forward: ForwardPlan | None = None
        #: the failures the graph survived, in order
        self.fallbacks: tuple[Fallback, ...] = ()
        #: the report `finish` returned (the backend publishes it), revised when the
        #: backward, compiled at the first ``.backward()``, falls back; None before
        self.finished: GraphReport | None = None

    @property
    def cfg(self) -> EraseConfig:
        return self.request.cfg

    @property
    def graph_id(self) -> int:
        return self.request.graph_id

    @property
    def has_early_blocks(self) -> bool:
        """Whether the graph runs early blocks: the partition scheduled some, and no failure
        since dropped them (one in the forward or the backward keeps them, on one stream)."""
        return (self.joint is not None and self.joint.early_blocks
                and all(fallback.keeps_schedule for fallback in self.fallbacks))

    @property
    def report(self) -> GraphReport:
        """What erase_fx decided about this graph, so far (`report_of`)."""
        return report_of(self.request, self.joint, self.forward, self.fallbacks)

    # -- AOTAutograd callbacks ------------------------------------------------

    def partition(
        self, joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """AOT's partition function (with Inductor: stock Inductor's custom partitioner).

        With Inductor inside, stock ``compile_fx`` has already run its
        joint-graph passes on ``joint``, in its own fake mode, as for
        ``torch.compile(model)``.
        """
        if isinstance(joint_inputs, (list, tuple)) and not joint_inputs:
            # NB: AOT also partitions nested-region (invoke_subgraph) joint
            # graphs, with no inputs: those keep the stock partitioner.
            return stock_partition(joint, joint_inputs, self.cfg,
                                   num_fwd_outputs=num_fwd_outputs, **kwargs)
        found: list[FoundBlocks] = []  # the analysis, kept when a later joint pass fails
        try:
            split = self._partition(joint, joint_inputs, num_fwd_outputs, kwargs, found.append)
        except Exception as error:  # noqa: BLE001 - the documented fallback
            self._fall_back("partition", error)
            split = None
        if split is None:  # no early block, or the partition failed: the stock partition
            self.joint = JointPlan(num_fwd_outputs, found[0] if found else None)
            fw, bw = stock_partition(joint, joint_inputs, self.cfg,
                                     num_fwd_outputs=num_fwd_outputs, **kwargs)
            if self.request.require_early_blocks:
                raise NoEarlyBlocks(self.graph_id)
        else:
            fw, bw = split
            self.joint = self._plan_early_gradients(JointPlan(num_fwd_outputs, found[0], True),
                                                    fw, bw)
        return fw, bw

    def inner_compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                      **inductor_kwargs: Any) -> Any:
        """Stock Inductor's inner compiler, for the forward, the backward and inference graphs."""
        if inductor_kwargs.get("is_backward"):
            return self.compile_backward(gm, example_inputs, **inductor_kwargs)
        if inductor_kwargs.get("is_inference"):
            return self.compile_inference(gm, example_inputs, **inductor_kwargs)
        return self.compile_forward(gm, example_inputs, **inductor_kwargs)

    def compile_forward(self, fw: fx.GraphModule, example_inputs: Sequence[Any],
                        **inductor_kwargs: Any) -> Any:
        fw_metadata = self._note_forward_metadata()
        # NB: before compiling: Inductor takes the module over
        data_dependent = data_dependent_refusal(fw)
        blocks = self.joint.blocks if self.joint is not None else 0
        early = f"{blocks} early block{'s' if blocks != 1 else ''}"
        in_segments = False
        if not any(is_early(n) for n in fw.graph.nodes):
            label = f"no early block; with {self.cfg.inner}: "
        else:
            if self.cfg.inner == "inductor":
                keep_early_values_at_fx_strides(fw)
            in_segments = self.cfg.streams > 0
            label = (f"{early}; with {self.cfg.inner}, in segments: " if in_segments else
                     f"{early}, no side stream; with {self.cfg.inner}, in one graph: ")
        program, hooks = None, ()
        decided: dict[str, Any] = {}  # the ForwardPlan's decisions, kept if a later step fails
        with compiling(self.graph_id, "forward", label):
            if in_segments:
                try:
                    program, hooks = self._compile_segments(fw, example_inputs, inductor_kwargs,
                                                            decided)
                except Exception as error:  # noqa: BLE001 - the documented fallback
                    self._fall_back("compile_forward", error, keep_schedule=True)
            compiled = program if program is not None else compile_graph(
                fw, example_inputs, self.cfg.inner, **inductor_kwargs)
        graphed = self._graph_forward(compiled, example_inputs, fw_metadata, data_dependent,
                                      hooks)
        self.forward = ForwardPlan(program, hooks, graphed, **decided)
        return compiled if graphed is None else graphed

    def compile_backward(self, bw: fx.GraphModule, example_inputs: Sequence[Any],
                         **inductor_kwargs: Any) -> Any:
        with compiling(self.graph_id, "backward"):
            compiled = self._compile_backward(bw, example_inputs, inductor_kwargs)
        if self.forward.graphed is None:
            return compiled
        num_saved = sum(1 for n in bw.graph.find_nodes(op="placeholder") if not is_tangent(n))
        return graph_backward(self.forward.graphed, compiled, num_saved,
                              name=f"graph {self.graph_id} backward")

    def _compile_backward(self, bw: fx.GraphModule, example_inputs: Sequence[Any],
                          inductor_kwargs: dict[str, Any]) -> Any:
        if self.dump is not None:
            self.runner.record("bwd", bw)
        lean = None
        if self.has_early_blocks and self.joint.unused_tangents:
            lean = self._unless_it_fails(
                "the whole backward runs when the outputs besides the loss get no gradient",
                lambda: self._compile_backward_passes(
                    bw, example_inputs, dict(inductor_kwargs), UNUSED_TANGENT_BACKWARD_PASSES,
                    unused_tangents=self.joint.unused_tangents))
        compiled = None
        if self.has_early_blocks:
            try:
                compiled = self._compile_backward_passes(
                    bw, example_inputs, inductor_kwargs, BACKWARD_PASSES)
            except Exception as error:  # noqa: BLE001 - the documented fallback
                self._fall_back("compile_backward", error, keep_schedule=True)
        if compiled is None:
            compiled = compile_graph(bw, example_inputs, self.cfg.inner, **inductor_kwargs)
        if lean is not None:
            compiled = SelectedBackward(lean, compiled, self.joint.live_tangents)
        if self.forward.graph_end is not None and self.has_early_blocks:
            compiled = self._after_graph_end(compiled, bw, self.forward.program)
        return self.forward.wrap_backward(compiled)

    def _after_graph_end(self, compiled: Any, bw: fx.GraphModule,
                         program: StreamProgram) -> GraphEndBackward:
        """The backward waiting for its forward's blocks at the graph's end, or running them
        (`erase_fx.emit.graph_end`). Their values are saved tensors: forward output ``i``
        (after the user's ``num_fwd_outputs``) is backward argument ``i - num_fwd_outputs``
        after the saved SymInts, which come first."""
        num_symints = sum(1 for n in bw.graph.find_nodes(op="placeholder")
                          if not is_tangent(n) and not isinstance(n.meta.get("val"), torch.Tensor))
        gradients = [(num_symints + i - self.joint.num_fwd_outputs, i)
                     for i in program.graph_end_results]
        return GraphEndBackward(compiled, program.graph_end, gradients, program.run_graph_end,
                                program.wait_graph_end)

    def compile_inference(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                          **inductor_kwargs: Any) -> Any:
        if self.request.require_early_blocks:
            raise NoEarlyBlocks(self.graph_id)
        self.fallbacks += (Fallback("inference graph: no backward to run early"),)
        return compile_graph(gm, example_inputs, self.cfg.inner, **inductor_kwargs)

    # -- the pipeline ---------------------------------------------------------

    def _partition(
        self, joint: fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int, kwargs: dict,
        note: Callable[[FoundBlocks], None],
    ) -> tuple[fx.GraphModule, fx.GraphModule] | None:
        """The joint passes: the forward and backward with early blocks, or None where the
        analysis found none; ``note`` is given the analysis as soon as it is made."""
        self.runner.record("joint", joint)
        primal_names = self._primal_names(joint)
        results = run_passes(
            JOINT_PASSES, joint, self.cfg, runner=self.runner,
            after={"find_stop_gradient_blocks": lambda found: note(self._found_blocks(found))},
            num_fwd_outputs=num_fwd_outputs, primal_names=primal_names,
            joint_inputs=joint_inputs, partition_kwargs=kwargs,
            graph_end=self.request.runs_graph_end, seed_input=self._seed_input(joint, primal_names),
        )
        if not results["find_stop_gradient_blocks"].artifact.blocks:
            self.fallbacks += (Fallback("no early block"),)
            return None
        partition = results["partition_joint_graph"].artifact
        return partition.fw, partition.bw

    def _found_blocks(self, found: PassResult[BlockAnalysis]) -> FoundBlocks:
        """Right after the analysis, before the scheduling: unsupported blocks, where the
        report's nodes are, and the outputs whose gradients decide which backward runs."""
        where = Whereabouts.of(found.artifact, found.gm, self.request.output_names)
        self._handle_unsupported(found.artifact)
        blocks = found.artifact.blocks
        other = sorted({t for b in blocks for t in b.other_tangents})
        outputs = plain_outputs(found.gm)
        # NB: the other outputs are watched all or none (one node's pre-hook sees them all)
        watched = (tuple(sorted(outputs[t] for t in other))
                   if other and all(t in outputs for t in other) else None)
        losses = [WatchedLoss(outputs[b.tangent], b.id, where.output(b.tangent))
                  for b in blocks if b.tangent in outputs]
        loss_outputs = tuple(sorted({loss.output for loss in losses}))
        if watched is None and not losses:
            return FoundBlocks(found.artifact, where)
        live = LiveTangents(watched or (), losses, graph=f"graph {self.graph_id}")
        return FoundBlocks(found.artifact, where, tuple(other) if watched else (), live,
                           loss_outputs)

    def _compile_segments(
        self, fw: fx.GraphModule, example_inputs: Sequence[Any], inductor_kwargs: dict[str, Any],
        decided: dict[str, Any],
    ) -> tuple[StreamProgram, tuple[EarlyHook, ...]]:
        """The forward's passes, its segments compiled, the program that drives them, and
        the early work hooked to it; ``decided`` is given each `ForwardPlan` decision as it
        is made (a later step may fail: the report still tells it)."""
        results = run_passes(FORWARD_PASSES, fw, self.cfg, runner=self.runner, after={
            "copy_input_values_per_block": _keep_artifact(decided, "input_copies"),
            "recompute_boundary_values": _keep_artifact(decided, "recomputes")})
        segmented = results["split_segments"]
        # NB: the forward as split_segments cut it: the readers the stream program runs
        updates = decided["updates"] = self._plan_early_updates(
            module_given_to(results, "split_segments"))
        if self.cfg.inner == "inductor":
            compiled = compile_inductor_segments(
                segmented, fw, example_inputs, inductor_kwargs,
                keep_inplace_writes=self.cfg.tuning.keep_inplace_writes)
        else:
            compiled = {
                segment.name: compile_segment(
                    getattr(segmented.gm, segment.name),
                    example_inputs_of(getattr(segmented.gm, segment.name)),
                    self.cfg.inner,
                )
                for segment in segmented.segments
            }
        device = cuda_device_of(example_inputs)
        if device is None or not self.cfg.overlap:
            streams = VirtualStreams()
        else:
            streams = CudaStreams(device, self.cfg.streams)
        program = StreamProgram.build(segmented, compiled, streams, self.cfg.tuning.release_lag,
                                      self.cfg.tuning.side_cuda_streams)
        if program.graph_end is not None:
            if any(i < self.joint.num_fwd_outputs for i in program.graph_end_results):
                raise GraphInvariantError("emit", "a block at the graph's end makes a value the "
                                          "forward returns to the user: it cannot be left to "
                                          "the backward")
            program.graph_end.name = f"graph {self.graph_id}"
        return program, self._attach_early_work(program, updates)

    def _attach_early_work(self, program: StreamProgram,
                           updates: UpdatePlan | None) -> tuple[EarlyHook, ...]:
        """The one place the early gradients' work besides the backward is hooked to the
        program: their all-reduce under DDP (planned by the partition), or the optimizer's
        early updates (``updates``); the backward is wrapped with the same hooks, in this
        order (`ForwardPlan.wrap_backward`)."""
        early_updates = None
        if updates is not None and updates.planned:
            early_updates = EarlyUpdates(self.graph_id, updates.grads, updates.planned,
                                         updates.unprovable)
        hooks = tuple(hook for hook in (self.joint.early_allreduce, early_updates)
                      if hook is not None)
        for hook in hooks:
            hook.attach(program)
        return hooks

    def _compile_backward_passes(self, bw: fx.GraphModule, example_inputs: Sequence[Any],
                                 inductor_kwargs: dict[str, Any], passes: Sequence[Any],
                                 **given: Any) -> Any:
        """``passes`` run on the backward, then compiled: returning early grads unscaled when
        `defer_grad_scaling` could, wrapped to scale them in place (`ScaledBackward`)."""
        results = run_passes(passes, bw, self.cfg, runner=self.runner, **given)
        deferred = results["defer_grad_scaling"]
        if not deferred.modified:
            return compile_graph(deferred.gm, example_inputs, self.cfg.inner, **inductor_kwargs)
        if self.cfg.inner == "inductor":
            from torch._inductor import config as inductor_config

            # NB: as stock compile_fx_backward marks the gradients it returns
            mark_outputs_user_visible(
                deferred.gm, None if inductor_config.bw_outputs_user_visible else [])
        # NB: a whole early gradient's saved tensor owns its memory (plan_early_grads)
        private = {(grad.param, grad.saved) for grad in self.joint.early_grads}
        return ScaledBackward(
            compile_graph(deferred.gm, example_inputs, self.cfg.inner, **inductor_kwargs),
            deferred.artifact.num_grads, deferred.artifact.scaled, private)

    # -- helpers --------------------------------------------------------------

    def _unless_it_fails(self, lost: str, plan: Callable[[], T]) -> T | None:
        """``plan()``; if it raises: raise with ``on_error="raise"``, else log that ``lost`` (the
        feature this graph goes without, the rest as usual) and return None."""
        try:
            return plan()
        except Exception as error:  # noqa: BLE001 - the feature is an optimisation
            if self.cfg.on_error == "raise":
                raise
            log.warning("erase_fx graph %d: %s: %s: %s", self.graph_id, lost,
                        type(error).__name__, error)
            return None

    def _plan_early_gradients(self, plan: JointPlan, fw: fx.GraphModule,
                              bw: fx.GraphModule) -> JointPlan:
        """``plan`` (early blocks scheduled), with what their gradients do besides the
        backward: under DDP, which the forward all-reduces (`erase_fx.ddp`); else the whole
        ones, which an optimizer step may update early (`erase_fx.early_update`)."""
        if self.request.data_parallel is not None:
            if not self.cfg.early_allreduce:
                return plan
            if self.cfg.streams == 0:
                log.info("erase_fx graph %d: streams=0, no early all-reduce: DDP reduces every "
                         "gradient at .backward()", self.graph_id)
                return plan
            return dataclasses.replace(plan, early_allreduce=self._unless_it_fails(
                "no early all-reduce (DDP reduces every gradient at .backward())",
                lambda: early_allreduce_for(self.request.data_parallel, self.graph_id, fw, bw,
                                            plan.num_fwd_outputs, self.cfg.on_error)))
        if self.cfg.streams == 0:
            return plan
        grads = self._unless_it_fails(
            NO_EARLY_UPDATE, lambda: plan_early_grads(fw, bw, plan.num_fwd_outputs)) or ()
        return dataclasses.replace(plan, early_grads=grads, differentiable_outputs=sum(
            1 for n in bw.graph.find_nodes(op="placeholder") if is_tangent(n)))

    def _plan_early_updates(self, fw: fx.GraphModule) -> UpdatePlan | None:
        """Of the early gradients, those whose parameter the final forward reads only before
        them."""
        grads = self.joint.early_grads
        if not grads:
            return None
        planned = self._unless_it_fails(
            NO_EARLY_UPDATE, lambda: plan_early_updates(fw, grads))
        if planned is None:
            return None
        return UpdatePlan(grads, tuple(planned), unprovable_loss_gradient(
            self.joint.differentiable_outputs, self.cfg.early_seed,
            learned=self.request.loss_seed is not None))

    def _handle_unsupported(self, analysis: BlockAnalysis) -> None:
        """A block erase_fx cannot prove safe: raise, or keep it in the backward and say so."""
        for rejected in analysis.rejected:
            if not rejected.reason.is_unsupported:
                continue
            if self.cfg.on_error != "raise":
                log.warning(
                    "erase_fx graph %d: the block with parameters %s stays in the backward: "
                    "%s (node %s)", self.graph_id, list(rejected.params), rejected.detail,
                    rejected.node,
                )
                continue
            raise UnsupportedBlockError(
                    "find_stop_gradient_blocks",
                    f"the backward of the block with parameters {list(rejected.params)} cannot "
                    f"run early: {rejected.detail}",
                    node=rejected.node,
                    fix="remove the non-linear gradient op (e.g. a custom autograd.Function that "
                    "clips its incoming gradient), or pass options={'on_error': 'fallback'} to "
                    "keep that block in the backward",
                )

    def fall_back_whole(self, error: Exception) -> None:
        """The whole graph takes the stock backend (under ``on_error="fallback"``)."""
        self._fall_back("compile", error)

    def _fall_back(self, where: str, error: Exception, keep_schedule: bool = False) -> None:
        if self.cfg.on_error == "raise":
            raise error
        reason = f"{where} failed: {type(error).__name__}: {error}"
        log.warning("erase_fx graph %d takes the stock path: %s", self.graph_id, reason)
        self.fallbacks += (Fallback(reason, keep_schedule),)
        if self.finished is not None:  # the backward compiles at the first .backward()
            report = self.report
            revise(self.finished, report)
            self.finished = report
            if self.dump is not None:
                self.dump.write_report(report)

    def _primal_names(self, joint: fx.GraphModule) -> list[str]:
        input_names = self.request.input_names
        names = []
        for i, node in enumerate(primals(joint.graph)):
            index = getattr(node.meta.get("desc"), "idx", i)
            names.append(input_names[index] if index < len(input_names) else node.name)
        return names

    def _seed_input(self, joint: fx.GraphModule, primal_names: Sequence[str]) -> str | None:
        """The joint graph's placeholder of the learned loss seed (`erase_fx.emit.loss_seed`),
        by name, or None where the graph has none."""
        if self.request.loss_seed is None:
            return None
        found = next((node.name for node, name in zip(primals(joint.graph), primal_names)
                      if name == SEED_INPUT), None)
        if found is None:
            raise GraphInvariantError("partition", f"no joint-graph input is {SEED_INPUT}, the "
                                      "learned seed's placeholder the backend added")
        return found

    def _note_forward_metadata(self) -> Any:
        """AOT's metadata of the forward being compiled (None outside AOT); the backward
        guard learns from it whether the backward donates buffers."""
        from torch._guards import TracingContext

        context = TracingContext.try_get()
        fw_metadata = getattr(context, "fw_metadata", None) if context else None
        self.backward_guard.donates_buffers = bool(getattr(fw_metadata, "bw_donated_idxs", None))
        return fw_metadata

    def _graph_forward(self, compiled: Any, example_inputs: Sequence[Any], fw_metadata: Any,
                       refusal: str | None, hooks: Sequence[EarlyHook]) -> GraphedForward | None:
        """The compiled forward, replayed from a CUDA graph where the config and graph allow
        (``refusal``: why the forward module cannot be, `data_dependent_refusal`), else None."""
        if any(isinstance(hook, EarlyAllReduce) for hook in hooks):
            refusal = ("it all-reduces early gradients in the forward (early_allreduce), which "
                       "replay cannot do step by step")
        return graph_forward(compiled, example_inputs, cudagraphs=self.cfg.cudagraphs,
                             fw_metadata=fw_metadata, name=f"graph {self.graph_id}",
                             refusal=refusal)

    def watch(self, outputs: Any) -> None:
        """What each run of the compiled graph does with its ``outputs``: guards the backward
        uses erase_fx cannot run (`erase_fx.guards`), watches whether the outputs besides the
        loss get a gradient (`erase_fx.emit.live_tangents`), and those its blocks at the
        graph's end are waited for through (`erase_fx.emit.graph_end`)."""
        self.backward_guard.guard(outputs)
        if self.request.loss_seed is not None:
            self.request.loss_seed.watch(outputs)
        # NB: only a graph with early blocks is watched (`erase_fx.backend`), and after its
        # compile only fallbacks that keep them can come
        if self.joint.live_tangents is not None:
            self.joint.live_tangents.watch(outputs)
        if self.forward is not None and self.forward.graph_end is not None:
            self.forward.graph_end.watch(outputs)

    def finish(self) -> GraphReport:
        self.finished = report = self.report
        if self.dump is not None:
            self.dump.write_report(report)
        log.info("erase_fx %s (erase_fx passes took %.0f ms)", report.summary(),
                 1000 * sum(self.timing.seconds.values()))
        return report


def _keep_artifact(decided: dict[str, Any], field: str) -> Callable[[PassResult], None]:
    """An ``after`` callback of `run_passes`: the pass's artifact kept as ``decided[field]``."""

    def keep(result: PassResult) -> None:
        decided[field] = result.artifact

    return keep
