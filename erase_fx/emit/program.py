"""The driver: runs the compiled segments of a forward in order, on their streams.

`StreamProgram` is built once per compiled forward from the split module's
top-level graph: each ``call_module`` becomes a `Step` that reads and writes
numbered slots, and each slot is cleared after its last reader, so tensors
die as early as in the unsplit graph. Calling it runs the steps in launch
order; `streams.StreamOps` decides what a step on a side stream means:

- on CUDA (`CudaStreams`), the side streams first wait for the main stream
  (the fork: the inputs are ready); a step that reads outputs of steps on
  other streams waits for the event each recorded right after it was
  launched (the latest one per stream: a stream's events fire in order),
  outside capture marks every input tensor as used by its stream
  (``record_stream``: the caching allocator will not hand the memory out
  again before that stream is done with it), and a side step runs under
  ``torch.cuda.stream(side)``; at the end the main stream waits for every
  side stream used (the join) and marks the side-stream outputs as used by
  the main stream;
- on CPU (`VirtualStreams`), streams are virtual and the same steps simply
  run in order.

A call runs on `StreamOps.folded` streams when ``side_cuda_streams`` folds
the side streams onto fewer CUDA streams; the steps, their order and their
events stay as they are, but for where the forward's end leaves graph-end
work running (`GraphEndJoin`: on the CUDA streams it runs on). A program
built with ``"auto"`` for it or for ``release_lag`` says so
(`StreamProgram.tunables`) and runs with what `erase_fx.compile_step` sets
(`StreamProgram.tune`, through the step's
`erase_fx.emit.capture_scope.StepScope`, which each call meets), the
defaults otherwise.

No stream or event op is ever inside a compiled segment: Inductor may reorder
side-effect ops against compute, so syncs live here, between segments.

Under ``torch.profiler`` each step runs inside ``record_function(<segment
name>)`` (``erase_fx/seg_1_block_0_stream_1``: the segment, its block and
stream), so traces show which segment launched which kernels; with no
profiler active the steps run bare, at no cost. CUDA graph replay runs no
steps, so its traces hold no such labels.

Completion hooks (`StreamProgram.add_completion_hooks`) let a caller act on
some results as soon as the steps that make them have been launched, in the
middle of the forward: `erase_fx.ddp` all-reduces each early block's
gradients there, on the communication stream (`StreamOps.run_comm`), while
the rest of the forward runs; `erase_fx.early_update` records there when each
block's gradients are made, for the optimizer update `compile_step` may run
early. Each caller adds its own hooks; they run in the order they were added.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from erase_fx.config import AUTO, RECORD_STREAM
from erase_fx.emit.capture_scope import DEFAULT_CHOICE, CaptureChoice, Tunables, meet
from erase_fx.emit.graph_end import GraphEnd
from erase_fx.emit.inner import Boxed, BoxedCallable, stream_capturing
from erase_fx.emit.memory_plan import (
    MemoryPlan, SlotMemory, plan_memory, segment_temporaries, slot_memory,
)
from erase_fx.emit.release import CapturePlan, StepIO, plan_captured_releases
from erase_fx.emit.streams import StreamOps, fold, record_stream_reuse_on
from erase_fx.errors import GraphInvariantError
from erase_fx.passes import MAIN_STREAM, SegmentedForward

WHERE = "emit"
log = logging.getLogger(__name__)
#: ``record_function`` label of a step under a profiler: the prefix, then the segment name.
PROFILE_LABEL_PREFIX = "erase_fx/"


@dataclasses.dataclass(frozen=True)
class Step:
    """One compiled segment call.

    Attributes:
        name: the segment's name.
        stream: the stream it runs on (0 = main).
        fn: the compiled segment (boxed: takes a list).
        inputs: slots of its arguments.
        outputs: for each output of the segment, the slot it goes to (-1: unused).
        frees: slots whose last reader is this step, cleared after it runs.
        waits: the earlier steps on other streams whose outputs it reads: its
            stream waits for the event each recorded before it runs.
        records_event: a later step on another stream reads its outputs: an
            event is recorded on its stream right after it is launched.
        at_graph_end: it runs a block at the graph's end (`erase_fx.emit.graph_end`):
            the main stream does not wait for it at the forward's end, and a disarmed
            program leaves it to the backward.
    """

    name: str
    stream: int
    fn: BoxedCallable
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    frees: tuple[int, ...]
    waits: tuple[int, ...] = ()
    records_event: bool = False
    at_graph_end: bool = False


#: ``begin(inputs)``: called with a forward's inputs before any step runs;
#: what it returns is that call's context (``None``: no completion hook runs).
BeginHook = Callable[[Sequence[Any]], Any]
#: ``fn(context, values, streams, stream_ops)``: the hooked results' values,
#: once every step that makes them has been launched on ``streams``.
CompletionFn = Callable[[Any, list[Any], tuple[int, ...], StreamOps], None]


@dataclasses.dataclass(frozen=True)
class GraphEndJoin:
    """How a forward's end joins the side streams, folded onto one number of CUDA streams,
    when steps of blocks at the graph's end run there (`erase_fx.emit.graph_end`).

    Attributes:
        joined: the side streams the main stream waits for whole: no graph-end step runs
            on their CUDA stream.
        deferred: the CUDA streams graph-end steps run on (side streams as folded): the
            events after their work are left for the backward to wait for.
        waits_after: the last step on each deferred stream that is not graph-end work: the
            main stream waits for the event recorded after it.
    """

    joined: tuple[int, ...]
    deferred: tuple[int, ...]
    waits_after: tuple[int, ...]

    @classmethod
    def of(cls, steps: Sequence[Step], width: int | None) -> GraphEndJoin:
        """The join of ``steps`` with the side streams folded onto ``width`` CUDA streams."""
        on = [fold(step.stream, width) for step in steps]
        deferred = sorted({on[k] for k, step in enumerate(steps) if step.at_graph_end})
        last = {stream: max((k for k, step in enumerate(steps)
                             if on[k] == stream and not step.at_graph_end), default=-1)
                for stream in deferred}
        side = sorted({step.stream for step in steps if step.stream != MAIN_STREAM})
        return cls(tuple(s for s in side if fold(s, width) not in deferred), tuple(deferred),
                   tuple(sorted(k for k in last.values() if k >= 0)))


@dataclasses.dataclass(frozen=True)
class CompletionHook:
    """A callback on some results of the forward, run right after the last step that makes one.

    Attributes:
        results: indices of the hooked graph outputs.
        after: the step after which they are all launched (-1: before the first step).
        streams: the streams of the steps that make them (the work to wait for).
        fn: the callback.
    """

    results: tuple[int, ...]
    after: int
    streams: tuple[int, ...]
    fn: CompletionFn


class StreamProgram(Boxed):
    """A compiled multi-stream forward, with AOTAutograd's boxed calling convention."""

    def __init__(
        self,
        steps: tuple[Step, ...],
        num_inputs: int,
        num_slots: int,
        results: tuple[tuple[str, Any], ...],
        streams: StreamOps,
        constants: tuple[tuple[int, Any], ...] = (),
        release_lag: int | str | None = None,
        side_cuda_streams: int | str | None = None,
        measure: Callable[[], tuple[SlotMemory, tuple[int, ...]]] | None = None,
    ):
        super().__init__()
        self.steps = steps
        self.num_inputs = num_inputs
        self.num_slots = num_slots
        self.constants = constants  # (slot, value): tensor constants of the split module
        self.results = results  # ("slot", i) or ("const", value), per graph output
        self.streams = streams
        self.side_streams = tuple(sorted({s.stream for s in steps if s.stream != MAIN_STREAM}))
        #: reads `memory` and `temporaries` from the split module, at the first access of
        #: either (None: built without one); only `memory_plan` reads them
        self._measure = measure
        slot_stream = {slot: s.stream for s in steps for slot in s.outputs if slot >= 0}
        self.side_results = tuple(
            i for i, (kind, slot) in enumerate(results)
            if kind == "slot" and slot_stream.get(slot, MAIN_STREAM) != MAIN_STREAM
        )
        #: the ``release_lag`` and ``side_cuda_streams`` it was built with: with "auto", the
        #: values set by `tune` (`erase_fx.emit.capture_scope`)
        self.release_lag = release_lag
        self.side_cuda_streams = side_cuda_streams
        #: what the "auto" options run with: `DEFAULT_CHOICE` unless compile_step set one
        self.tuned: CaptureChoice = DEFAULT_CHOICE
        self._plans: dict[int | None, CapturePlan] = {}
        self._warned_record_stream = False
        self._folded: dict[int, StreamOps] = {}
        #: whether the release lag changes anything here: some tensor the main stream makes
        #: and only side streams read (with each block's stage on its side stream, none)
        self.lag_matters = any(self.capture_plan_for(1).releases_before)
        #: what `erase_fx.compile_step` may choose for it (`erase_fx.emit.capture_scope`)
        self.tunables = Tunables(
            release_lag=release_lag == AUTO and self.lag_matters,
            side_streams=len(self.side_streams) if side_cuda_streams == AUTO else 0)
        #: per caller of `add_completion_hooks`: its begin hook and its hooks by step
        self.hook_clients: tuple[tuple[BeginHook, dict[int, tuple[CompletionHook, ...]]], ...] = ()
        #: the steps of blocks at the graph's end, and whether they run at the forward's end
        #: (`erase_fx.emit.graph_end`); None without such steps
        self.graph_end_steps = tuple(k for k, s in enumerate(steps) if s.at_graph_end)
        self.graph_end: GraphEnd | None = GraphEnd("a forward") if self.graph_end_steps else None
        produced = {slot for k in self.graph_end_steps for slot in steps[k].outputs if slot >= 0}
        #: the graph outputs the graph-end steps make (their blocks' early gradients)
        self.graph_end_results = tuple(i for i, (kind, slot) in enumerate(results)
                                       if kind == "slot" and slot in produced)
        #: per width of ``side_cuda_streams``, how the forward's end leaves the graph-end work
        self._graph_end_joins: dict[int | None, GraphEndJoin] = {}

    @functools.cached_property
    def _measured(self) -> tuple[SlotMemory, tuple[int, ...]] | None:
        if self._measure is None:
            return None
        measured = self._measure()
        self._measure = None  # NB: lets the split module go
        return measured

    @property
    def memory(self) -> SlotMemory | None:
        """What each slot's value occupies (from the split module's meta, read at the first
        access; None when built without one): what `memory_plan` sizes the buffers by."""
        return None if self._measured is None else self._measured[0]

    @property
    def temporaries(self) -> tuple[int, ...] | None:
        """Per step, the bytes its segment holds inside at its peak, estimated from its FX
        graph (`segment_temporaries`, at the first access; None when built without one)."""
        return None if self._measured is None else self._measured[1]

    def capture_plan_for(self, lag: int | None) -> CapturePlan:
        """How a captured run with release lag ``lag`` frees memory (`erase_fx.emit.release`;
        computed once per lag; `_choice` says which lag a call uses)."""
        if lag not in self._plans:
            self._plans[lag] = plan_captured_releases(
                [StepIO(s.stream, s.inputs, s.outputs) for s in self.steps], self.num_inputs,
                {slot for kind, slot in self.results if kind == "slot"}, lag)
        return self._plans[lag]

    def memory_plan(self, lag: int | None = None, width: int | None = None,
                    temporaries: bool = False) -> MemoryPlan:
        """The lifetimes, predicted peaks and race check of a captured run with release lag
        ``lag`` on ``width`` side CUDA streams (`erase_fx.emit.memory_plan`); with
        ``temporaries``, each segment's own temporaries count too (`self.temporaries`)."""
        if self.memory is None:
            raise GraphInvariantError(WHERE, "a program built without its slots' sizes has no "
                                      "memory plan: build it from a split module")
        return plan_memory([StepIO(s.stream, s.inputs, s.outputs, s.waits) for s in self.steps],
                           self.memory, {slot for kind, slot in self.results if kind == "slot"},
                           self.capture_plan_for(lag), width,
                           self.temporaries if temporaries else None)

    def add_completion_hooks(
        self, begin: BeginHook, hooks: Sequence[tuple[Sequence[int], CompletionFn]]
    ) -> tuple[CompletionHook, ...]:
        """Run ``begin`` at each call, and each ``(results, fn)`` once those results are launched.

        A hooked result must be a graph output; one the program does not make
        (an input, a constant) counts as ready from the start. The hooks only
        read the results (they may write them in place on their own stream):
        slots and lifetimes stay as they are. Each call adds a client with its
        own ``begin`` and context; clients run in the order they were added.
        """
        producer = {slot: (k, step.stream) for k, step in enumerate(self.steps)
                    for slot in step.outputs if slot >= 0}
        placed = []
        for results, fn in hooks:
            results = tuple(results)
            made = [producer[self.results[i][1]] for i in results
                    if self.results[i][0] == "slot" and self.results[i][1] in producer]
            placed.append(CompletionHook(
                results=results,
                after=max((k for k, _ in made), default=-1),
                streams=tuple(sorted({stream for _, stream in made})),
                fn=fn,
            ))
        by_step: dict[int, list[CompletionHook]] = {}
        for hook in placed:
            by_step.setdefault(hook.after, []).append(hook)
        self.hook_clients += ((begin, {k: tuple(v) for k, v in by_step.items()}),)
        return tuple(placed)

    @classmethod
    def build(
        cls,
        segmented: SegmentedForward,
        compiled: Mapping[str, BoxedCallable],
        streams: StreamOps,
        release_lag: int | str | None = None,
        side_cuda_streams: int | str | None = None,
    ) -> StreamProgram:
        graph = segmented.gm.graph
        slot: dict[fx.Node, int] = {}
        placeholders = list(graph.find_nodes(op="placeholder"))
        for i, node in enumerate(placeholders):
            slot[node] = i
        raw_steps = []
        constants = []
        for node in graph.nodes:
            if node.op == "call_module":
                raw_steps.append(node)
            elif node.op == "call_function" and node.target is operator.getitem:
                slot[node] = len(slot)
            elif node.op == "get_attr":
                # NB: a tensor built in the forward (torch.tensor([...])) is a
                # constant of the graph; split_module keeps it at the top level
                # when several segments read it.
                slot[node] = len(slot)
                constants.append((slot[node], _fetch_attr(segmented.gm, node.target)))
            elif node.op not in ("placeholder", "output"):
                raise GraphInvariantError(WHERE, f"unexpected top-level {node.op} in the split "
                                          "module", node=node.name)

        out = graph.find_nodes(op="output")[0]
        out_values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
        results = tuple(
            ("slot", slot[v]) if isinstance(v, fx.Node) else ("const", v) for v in out_values
        )
        kept = {slot[v] for v in out_values if isinstance(v, fx.Node)}
        last_reader: dict[int, int] = {}
        for k, call in enumerate(raw_steps):
            for arg in call.all_input_nodes:
                last_reader[slot[arg]] = k

        step_of = {call.target: k for k, call in enumerate(raw_steps)}
        waits = []
        for call in raw_steps:
            # NB: one stream's events fire in order: the latest one per stream suffices
            latest: dict[int, int] = {}
            for w in segmented.segment(call.target).waits_for:
                stream = segmented.segment(w).stream
                latest[stream] = max(latest.get(stream, -1), step_of[w])
            waits.append(tuple(sorted(latest.values())))
        read_elsewhere = {k for step_waits in waits for k in step_waits}
        steps = []
        for k, call in enumerate(raw_steps):
            segment = segmented.segment(call.target)
            outputs: dict[int, int] = {}
            for user in call.users:
                outputs[user.args[1]] = slot[user]
            width = max(outputs, default=-1) + 1
            steps.append(Step(
                name=segment.name,
                stream=segment.stream,
                fn=compiled[segment.name],
                inputs=tuple(slot[a] for a in call.args),
                outputs=tuple(outputs.get(i, -1) for i in range(width)),
                frees=tuple(s for s, last in last_reader.items() if last == k and s not in kept),
                waits=waits[k],
                records_event=k in read_elsewhere,
                at_graph_end=segment.at_graph_end,
            ))
        # NB: measured only where a memory plan is asked for (the bench, tests): compiling
        # pays nothing for it
        measure = functools.partial(
            _measure, segmented.gm, slot, (*range(len(placeholders)), *(s for s, _ in constants)),
            tuple(call.target for call in raw_steps))
        return cls(tuple(steps), len(placeholders), len(slot), results, streams,
                   tuple(constants), release_lag, side_cuda_streams, measure)

    def __call__(self, args: list[Any]) -> list[Any]:
        if len(args) != self.num_inputs:
            raise GraphInvariantError(WHERE, f"expected {self.num_inputs} inputs, got {len(args)}")
        env: list[Any] = list(args) + [None] * (self.num_slots - len(args))
        for slot, value in self.constants:
            env[slot] = value
        contexts = None
        if self.hook_clients:
            began = [(begin(args), hooks) for begin, hooks in self.hook_clients]
            contexts = [(c, hooks) for c, hooks in began if c is not None] or None
        args.clear()  # NB: boxed convention: we own the inputs now and free them early
        meet(self)  # a compile_step warming up or capturing sets what "auto" runs with
        plan, streams, width = self._choice()
        join = self._graph_end_join(width)
        if contexts is not None:
            self._complete(-1, env, contexts, streams)
        # NB: the side streams start from the main stream's state: the inputs are ready
        streams.fork(self.side_streams)
        capturing = bool(self.side_streams) and stream_capturing()
        stash: dict[int, Any] | None = None
        if not capturing:
            if self.graph_end is not None and not self.graph_end.armed:
                stash = {}
            events = self._run(env, streams, contexts, stash, join.waits_after)
        elif plan is None:  # release_lag="record_stream": the allocator orders the reuse
            self._check_record_stream_reuse()
            events = self._run(env, streams.marking_uses(), contexts, None, join.waits_after)
        else:
            events = self._run_captured(env, plan, streams, contexts)
        results = [env[value] if kind == "slot" else value for kind, value in self.results]
        if stash is not None:
            marker = self.graph_end.stash(stash, _device_of(results))
            for i in self.graph_end_results:
                results[i] = marker
        if self.graph_end is None or capturing or stash is not None:
            streams.join(self.side_streams, [results[i] for i in self.side_results])
        else:
            self._join_leaving_graph_end(streams, events, results, join)
        return results

    def _join_leaving_graph_end(self, streams: StreamOps, events: dict[int, Any],
                                results: list[Any], join: GraphEndJoin) -> None:
        """The join, but for the graph-end work: the main stream waits for everything else; an
        event after the graph-end work is left for the backward to wait for. NB: ``join`` is
        of the CUDA streams ``streams`` runs on: a side stream folded onto the CUDA stream
        of graph-end work is waited for up to its last step, not joined, else the join
        would wait for the graph-end work too."""
        streams.join(join.joined, [results[i] for i in self.side_results])
        if join.waits_after:
            streams.wait_events(MAIN_STREAM, [events[k] for k in join.waits_after])
        # NB: deferred names CUDA streams, which folding leaves as they are
        self.graph_end.pending += streams.defer(join.deferred,
                                                [results[i] for i in self.graph_end_results])

    def _graph_end_join(self, width: int | None) -> GraphEndJoin:
        """How the forward's end joins the side streams folded onto ``width`` CUDA streams
        (computed once per width)."""
        if width not in self._graph_end_joins:
            self._graph_end_joins[width] = GraphEndJoin.of(self.steps, width)
        return self._graph_end_joins[width]

    def tune(self, choice: CaptureChoice) -> None:
        """Run the options built with "auto" with ``choice`` from the next call on (set by
        `erase_fx.compile_step` through its `erase_fx.emit.capture_scope.StepScope`)."""
        self.tuned = choice

    def _choice(self) -> tuple[CapturePlan | None, StreamOps, int | None]:
        """This call's release plan (used under capture; None with ``release_lag=
        "record_stream"``), streams and their width (``side_cuda_streams``): the options',
        or, for those set to "auto", the values `tune` set."""
        lag, width = self.release_lag, self.side_cuda_streams
        if lag == AUTO:
            lag = self.tuned.lag
        if width == AUTO:
            width = self.tuned.width
        plan = None if lag == RECORD_STREAM else self.capture_plan_for(lag)
        if width is None:
            return plan, self.streams, None
        if width not in self._folded:
            self._folded[width] = self.streams.folded(width)
        return plan, self._folded[width], width

    def _check_record_stream_reuse(self) -> None:
        """Say once why ``release_lag="record_stream"`` would hold memory to the end of the
        capture: the allocator's reuse of marked memory during capture is off."""
        if not self._warned_record_stream and not record_stream_reuse_on():
            self._warned_record_stream = True
            log.warning("erase_fx: release_lag='record_stream' without PYTORCH_ALLOC_CONF="
                        "graph_capture_record_stream_reuse:True: under capture the caching "
                        "allocator keeps every value marked with record_stream to the end of "
                        "the capture")

    def _run(self, env: list[Any], streams: StreamOps, contexts: Any = None,
             stash: dict[int, Any] | None = None,
             record_after: Sequence[int] = ()) -> dict[int, Any]:
        """Each slot dropped after its last reader; ``record_stream`` guards cross-stream
        reuse. With a ``stash``, the graph-end steps do not run: their inputs go into it.
        An event is recorded after each step another stream reads, and after each step in
        ``record_after`` (`GraphEndJoin.waits_after`). Returns the events recorded, by step."""
        events: dict[int, Any] = {}
        for k, step in enumerate(self.steps):
            skipped = stash is not None and step.at_graph_end
            if skipped:
                stash.update((slot, env[slot]) for slot in step.inputs if env[slot] is not None)
            else:
                self._launch(k, step, env, events, streams, record=k in record_after)
            for slot in step.frees:
                env[slot] = None
            # NB: a hook after a step left to the backward reads values not made yet
            if contexts is not None and not skipped:
                self._complete(k, env, contexts, streams)
        return events

    def wait_graph_end(self, events: Sequence[Any]) -> None:
        """The main stream waits for graph-end work left running by earlier forwards."""
        self.streams.wait_events(MAIN_STREAM, events)

    def run_graph_end(self, stash: Any) -> dict[int, Any]:
        """The graph-end steps, now, on the current stream, from a disarmed forward's kept
        inputs (`erase_fx.emit.graph_end`): their graph outputs, by result index."""
        env: dict[int, Any] = dict(stash.values)
        for k in self.graph_end_steps:
            step = self.steps[k]
            outputs = step.fn([env[slot] for slot in step.inputs])
            env.update((slot, value) for slot, value in zip(step.outputs, outputs) if slot >= 0)
        return {i: env[self.results[i][1]] for i in self.graph_end_results}

    def _complete(self, k: int, env: list[Any],
                  contexts: list[tuple[Any, dict[int, tuple[CompletionHook, ...]]]],
                  streams: StreamOps) -> None:
        """The completion hooks due after step ``k`` (-1: before the first), of each client
        whose ``begin`` gave a context this call."""
        for context, hooks in contexts:
            for hook in hooks.get(k, ()):
                values = [env[self.results[i][1]] if self.results[i][0] == "slot"
                          else self.results[i][1] for i in hook.results]
                hook.fn(context, values, hook.streams, streams)

    def _run_captured(self, env: list[Any], plan: CapturePlan, streams: StreamOps,
                      contexts: Any = None) -> dict[int, Any]:
        """Under CUDA graph capture: slots dropped as ``plan`` (`plan_captured_releases`) orders.

        NB: a step output that lives in memory a value alive before the step
        already has (a view of an input or of another stream's tensor) is
        held to the join: the plan reasons about the stream a tensor was made
        on, and a view was not made where its memory was. Memory that was
        freed and handed out again is not such a case (that reuse is the point
        of freeing), and neither are several outputs of one step that share
        memory the step allocated (an attention's q, k and v, views of one
        projection): they were made on the step's stream, and their memory is
        freed when the last of them is dropped, each by its own rule.
        """
        pinned: set[int] = set()
        events: dict[int, Any] = {}
        for k, step in enumerate(self.steps):  # NB: graph-end steps too: a capture joins all
            if plan.waits_before[k]:
                streams.wait_events(MAIN_STREAM, [events[r] for r in plan.waits_before[k]])
            for slot in plan.releases_before[k]:
                if slot not in pinned:
                    env[slot] = None
            live = {_storage_key(v) for v in env if isinstance(v, torch.Tensor)}
            self._launch(k, step, env, events, streams, plan.records_event[k])
            for slot in step.outputs:
                if (slot >= 0 and isinstance(env[slot], torch.Tensor)
                        and _storage_key(env[slot]) in live):
                    pinned.add(slot)
            for slot in plan.drops_after[k]:
                if slot not in pinned:
                    env[slot] = None
            if contexts is not None:
                self._complete(k, env, contexts, streams)
        return events

    def _launch(self, k: int, step: Step, env: list[Any], events: dict[int, Any],
                streams: StreamOps, record: bool = False) -> None:
        """Run step ``k`` once the events of the steps it reads on other streams have fired;
        record its own event when another stream reads it (or ``record``)."""
        inputs = [env[i] for i in step.inputs]
        waits = [events[w] for w in step.waits]
        # NB: read the flag at each call: profilers start and stop between calls.
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(PROFILE_LABEL_PREFIX + step.name):
                outputs = streams.run(step.stream, step.fn, inputs, waits)
        else:
            outputs = streams.run(step.stream, step.fn, inputs, waits)
        if step.records_event or record:
            events[k] = streams.record_event(step.stream)
        for slot, value in zip(step.outputs, outputs):
            if slot >= 0:
                env[slot] = value


def _measure(gm: fx.GraphModule, slot: dict[fx.Node, int], external: Sequence[int],
             segments: Sequence[str]) -> tuple[SlotMemory, tuple[int, ...]]:
    """What each slot's value occupies (``external``: the inputs' and constants' slots), and
    the temporaries of each step's segment (``segments``: their names), from the split module."""
    return (slot_memory(_slot_values(gm, slot), external),
            tuple(segment_temporaries(getattr(gm, name)) for name in segments))


def _slot_values(gm: fx.GraphModule, slot: dict[fx.Node, int]) -> list[Any]:
    """Each slot's example value (fake tensors of the forward's trace, by slot): a
    placeholder's own, a constant itself, a segment's output that of the node it returns."""
    values: list[Any] = [None] * len(slot)
    for node, i in slot.items():
        if node.op == "call_function":  # a getitem of a segment's outputs
            call, index = node.args
            returned = getattr(gm, call.target).graph.find_nodes(op="output")[0].args[0]
            value = returned[index]
            values[i] = value.meta.get("val") if isinstance(value, fx.Node) else value
        elif node.op == "get_attr":
            values[i] = _fetch_attr(gm, node.target)
        else:
            values[i] = node.meta.get("val")
    return values


def _device_of(values: Sequence[Any]) -> torch.device | None:
    """The device of the first tensor among ``values``."""
    return next((v.device for v in values if isinstance(v, torch.Tensor)), None)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value

