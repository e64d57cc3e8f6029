"""What running a step on a stream means: CUDA streams, or virtual ones on CPU.

The protocol of one forward (`erase_fx.emit.program.StreamProgram`):
`StreamOps.fork(streams)` first makes the side streams start from the main
stream's state (the forward's inputs are ready); `StreamOps.run(stream, fn,
inputs, waits)` runs one compiled segment on a stream once the events in
``waits`` have fired (the steps on other streams whose outputs it reads);
`StreamOps.record_event(stream)` records an event after the work launched on
a stream so far (a step another stream reads); `StreamOps.wait_events(stream,
events)` makes a stream wait without running anything (the release of
memory under capture); `StreamOps.join(streams, outputs)` ends a forward:
the main stream waits for the side streams, and outputs made there become
safe to use on the main stream; `StreamOps.defer(streams, outputs)` leaves
that wait to the backward, for the blocks at the graph's end
(`erase_fx.emit.graph_end`): it returns the events to wait for. `StreamOps.run_comm(after, tensors, fn)`
runs collective work (`erase_fx.ddp`'s early all-reduce) on a communication
stream once the streams in ``after`` have done the work launched on them so
far; `StreamOps.wait_comm()` makes the current stream wait for it (the
backward does, before it reads what was reduced). `StreamOps.run_update(lane,
events, fn)` runs an early optimizer update (`erase_fx.early_update`) on the
update stream of side stream ``lane`` once ``events`` fired;
`StreamOps.join_update()` makes the current stream wait for the updates
launched so far.

`StreamOps.folded(width)` is the same object for a run on fewer streams: side
stream ``s`` runs on ``1 + (s - 1) % width``
(`Tuning.side_cuda_streams`). Folding only adds order: every event a
step waits for was recorded by an earlier step, and one stream runs its work
in launch order, so a wait on an event of the same stream is one it has
already passed. Under CUDA graph capture the blocks that share a stream share
its memory (the caching allocator reuses memory on the stream that freed it)
and its cuBLAS workspace.

`StreamOps.marking_uses()` is the same object for a captured run that marks
every input of a step as used by the step's stream (``record_stream``) under
capture too, as outside it: under
``PYTORCH_ALLOC_CONF=graph_capture_record_stream_reuse:True`` the caching
allocator then reuses a freed block during capture once the graph orders
every marked use before the new allocation (``release_lag="record_stream"``,
`erase_fx.emit.release`); without that setting it keeps such blocks to the
end of the capture (`record_stream_reuse_on` says which).
"""
from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from erase_fx.emit.inner import BoxedCallable
from erase_fx.passes import MAIN_STREAM

T = TypeVar("T")


class StreamOps(Protocol):
    def folded(self, width: int | None) -> StreamOps: ...

    def marking_uses(self) -> StreamOps: ...

    def fork(self, streams: Sequence[int]) -> None: ...

    def run(
        self, stream: int, fn: BoxedCallable, inputs: list[Any], waits: Sequence[Any] = ()
    ) -> Sequence[Any]: ...

    def join(self, streams: Sequence[int], side_outputs: Sequence[Any]) -> None: ...

    def defer(self, streams: Sequence[int], side_outputs: Sequence[Any]) -> list[Any]: ...

    def record_event(self, stream: int) -> Any: ...

    def wait_events(self, stream: int, events: Sequence[Any]) -> None: ...

    def run_comm(self, after: Sequence[int], tensors: Sequence[Any],
                 fn: Callable[[], T]) -> T: ...

    def wait_comm(self) -> None: ...

    def run_update(self, lane: int, events: Sequence[Any], fn: Callable[[], T]) -> T: ...

    def join_update(self) -> None: ...


class _Folding:
    """`StreamOps.folded` and `StreamOps.marking_uses` for both kinds of streams: a shallow
    copy (what its streams hold is shared) that runs side stream ``s`` on ``fold(s, width)``,
    or that marks a step's inputs as used by its stream under capture too."""

    width: int | None = None
    #: under capture, mark each step's inputs as used by its stream (``record_stream``)
    marks_under_capture: bool = False

    def folded(self, width: int | None) -> Any:
        view = copy.copy(self)
        view.width = width
        return view

    def marking_uses(self) -> Any:
        view = copy.copy(self)
        view.marks_under_capture = True
        return view

    def _on(self, stream: int) -> int:
        """The stream ``stream``'s work runs on here (`fold`)."""
        return fold(stream, self.width)


class VirtualStreams(_Folding):
    """CPU: streams are labels; steps run in program order.

    With ``trace=True`` it records what a CUDA run would do, as
    ``("fork", streams)`` / ``("wait", stream, event streams)`` / ``("run",
    stream)`` / ``("record", stream)`` / ``("join", streams)`` tuples (an
    event is named by the stream it was recorded on), so tests on CPU can
    check the sync protocol.
    """

    def __init__(self, trace: bool = False):
        # NB: folded views share the trace, which names the stream each step would run on
        self.trace: list[tuple[Any, ...]] | None = [] if trace else None

    def fork(self, streams: Sequence[int]) -> None:
        if self.trace is not None and streams:
            self.trace.append(("fork", tuple(streams)))

    def run(
        self, stream: int, fn: BoxedCallable, inputs: list[Any], waits: Sequence[Any] = ()
    ) -> Sequence[Any]:
        if self.trace is not None:
            if waits:
                self.trace.append(("wait", self._on(stream), tuple(waits)))
            if self.marks_under_capture:
                self.trace.append(("mark", self._on(stream)))
            self.trace.append(("run", self._on(stream)))
        return fn(inputs)

    def join(self, streams: Sequence[int], side_outputs: Sequence[Any]) -> None:
        if self.trace is not None:
            self.trace.append(("join", tuple(streams)))

    def defer(self, streams: Sequence[int], side_outputs: Sequence[Any]) -> list[Any]:
        if self.trace is not None and streams:
            self.trace.append(("defer", tuple(self._on(s) for s in streams)))
        return [self._on(s) for s in streams]

    def record_event(self, stream: int) -> Any:
        if self.trace is not None:
            self.trace.append(("record", self._on(stream)))
        return self._on(stream)

    def wait_events(self, stream: int, events: Sequence[Any]) -> None:
        if self.trace is not None:
            self.trace.append(("wait_events", self._on(stream), tuple(events)))

    def run_comm(self, after: Sequence[int], tensors: Sequence[Any], fn: Callable[[], T]) -> T:
        """In program order: the collective runs now (on CPU, gloo's blocking call)."""
        if self.trace is not None:
            self.trace.append(("comm", tuple(after)))
        return fn()

    def wait_comm(self) -> None:
        if self.trace is not None:
            self.trace.append(("wait_comm",))

    def run_update(self, lane: int, events: Sequence[Any], fn: Callable[[], T]) -> T:
        """In program order: the update runs now."""
        if self.trace is not None:
            self.trace.append(("update", lane, tuple(events)))
        return fn()

    def join_update(self) -> None:
        if self.trace is not None:
            self.trace.append(("join_update",))


class CudaStreams(_Folding):
    """CUDA: side steps run on side streams forked from, and joined to, the current stream."""

    def __init__(self, device: torch.device, num_side_streams: int):
        self.device = device
        self.side = side_streams(device, num_side_streams)
        # NB: containers, shared with the folded views (copies) of these streams
        self._comm: list[torch.cuda.Stream] = []  # the communication stream, once used
        self._updates: dict[int, torch.cuda.Stream] = {}

    def _stream(self, stream: int) -> torch.cuda.Stream:
        if stream == MAIN_STREAM:
            return torch.cuda.current_stream(self.device)
        return self.side[self._on(stream) - 1]

    def fork(self, streams: Sequence[int]) -> None:
        """The side streams wait for the work launched on the main stream so far."""
        main = torch.cuda.current_stream(self.device)
        for stream in sorted({self._on(s) for s in streams}):
            self.side[stream - 1].wait_stream(main)

    def run(
        self, stream: int, fn: BoxedCallable, inputs: list[Any],
        waits: Sequence[torch.cuda.Event] = (),
    ) -> Sequence[Any]:
        if stream == MAIN_STREAM and not waits:
            return fn(inputs)
        target = self._stream(stream)
        for event in waits:
            target.wait_event(event)
        # NB: the caching allocator must not hand an input's memory to work on
        # another stream while this stream may still read it. Outside capture,
        # record_stream says so. Under CUDA graph capture memory freed is not
        # guarded by stream uses (seen as a race on an H200, torch 2.11):
        # there `StreamProgram` orders every reuse itself (erase_fx.emit.release),
        # unless it marks uses under capture too (`marking_uses`).
        if self.marks_under_capture or not torch.cuda.is_current_stream_capturing():
            for value in inputs:
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(target)
        if stream == MAIN_STREAM:
            return fn(inputs)
        with torch.cuda.stream(target):
            return fn(inputs)

    def join(self, streams: Sequence[int], side_outputs: Sequence[Any]) -> None:
        """The main stream waits for the side streams before it uses values made there."""
        main = torch.cuda.current_stream(self.device)
        for stream in sorted({self._on(s) for s in streams}):
            main.wait_stream(self.side[stream - 1])
        if torch.cuda.is_current_stream_capturing():
            return  # values of a captured forward live in the graph's own memory
        for value in side_outputs:
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(main)

    def defer(self, streams: Sequence[int], side_outputs: Sequence[Any]) -> list[Any]:
        """The join left for later (`erase_fx.emit.graph_end`): an event on each stream after
        the work launched there so far, for the main stream to wait for before it reads
        ``side_outputs``, which are marked as used by the main stream now (their memory is
        not handed out again before the main stream's work queued when they are freed)."""
        events = [self.record_event(s) for s in streams]
        main = torch.cuda.current_stream(self.device)
        for value in side_outputs:
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(main)
        return events

    def record_event(self, stream: int) -> torch.cuda.Event:
        """An event on a stream after the work launched there so far."""
        event = torch.cuda.Event()
        event.record(self._stream(stream))
        return event

    def wait_events(self, stream: int, events: Sequence[torch.cuda.Event]) -> None:
        """A stream waits for events (the main stream, before it reuses memory side streams
        read)."""
        target = self._stream(stream)
        for event in events:
            target.wait_event(event)

    @property
    def comm(self) -> torch.cuda.Stream:
        """The device's communication stream (made on first use, shared by every graph)."""
        if not self._comm:
            self._comm.append(comm_stream(self.device))
        return self._comm[0]

    def run_comm(self, after: Sequence[int], tensors: Sequence[Any], fn: Callable[[], T]) -> T:
        """``fn`` on the communication stream, after the work launched so far on ``after``.

        ``tensors`` (made on those streams) are marked as used by the
        communication stream, so their memory is not handed out again before
        it is done with them. NCCL runs the collective itself on its own
        stream, ordered after the communication stream's work and before its
        later work (``Work.wait()``).
        """
        comm = self.comm
        for stream in after:
            comm.wait_stream(self._stream(stream))
        if not torch.cuda.is_current_stream_capturing():
            for value in tensors:
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(comm)
        with torch.cuda.stream(comm):
            return fn()

    def wait_comm(self) -> None:
        """The current stream waits for the communication stream's work so far."""
        if self._comm:
            torch.cuda.current_stream(self.device).wait_stream(self._comm[0])

    def run_update(self, lane: int, events: Sequence[torch.cuda.Event],
                   fn: Callable[[], T]) -> T:
        """``fn`` on the update stream of side stream ``lane`` once ``events`` fired.

        NB: not on the block's side stream: under capture the caching
        allocator hands a stream the memory freed on it, and a block's side
        stream made values the main stream reads after the join and frees
        while the backward runs; an update on that stream could be given
        such memory while the main stream still reads it. An update stream
        makes and frees only the updates' own temporaries. One per side
        stream, not one per device: the blocks' updates overlap each other as
        their backwards do (on the H200, one shared update stream made Adam's
        early updates a serial chain longer than the step's other work).
        Only under capture (`erase_fx.early_update`): what an update reads
        (parameters, gradients, optimizer state) is not freed during the
        captured step.
        """
        stream = self._updates.get(lane)
        if stream is None:
            stream = self._updates[lane] = update_streams(self.device, lane + 1)[lane]
        for event in events:
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            return fn()

    def join_update(self) -> None:
        """The current stream waits for the updates launched so far."""
        current = torch.cuda.current_stream(self.device)
        for stream in self._updates.values():
            current.wait_stream(stream)


#: The allocator setting under which memory marked with ``record_stream`` is reused during a
#: CUDA graph capture (pytorch #158352, #162186).
RECORD_STREAM_REUSE = "graph_capture_record_stream_reuse"


def record_stream_reuse_on() -> bool:
    """Whether the caching allocator reuses ``record_stream``-marked memory during capture:
    ``graph_capture_record_stream_reuse:True`` in its settings (torch's own record of them
    where it keeps one, else ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF``)."""
    read = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    settings = (read() if read is not None else "") or (
        os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    for item in settings.replace(" ", "").split(","):
        key, _, value = item.partition(":")
        if key == RECORD_STREAM_REUSE:
            return value.lower() == "true"
    return False


def fold(stream: int, width: int | None) -> int:
    """The stream side stream ``stream`` runs on when side streams are folded onto ``width``."""
    if stream == MAIN_STREAM or width is None:
        return stream
    return 1 + (stream - 1) % width


_pool_lock = threading.Lock()
_pool: dict[int, list[torch.cuda.Stream]] = {}


def side_streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    """``count`` side streams of a device, shared by every compiled graph."""
    return _first(_pool, device, count)


def update_streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    """``count`` early-update streams of a device (one per side stream), shared by every
    compiled graph."""
    return _first(_update_pool, device, count)


def _first(pool: dict[int, list[torch.cuda.Stream]], device: torch.device,
           count: int) -> list[torch.cuda.Stream]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _pool_lock:
        streams = pool.setdefault(index, [])
        while len(streams) < count:
            streams.append(torch.cuda.Stream(device=index))
        return streams[:count]


_comm_pool: dict[int, list[torch.cuda.Stream]] = {}
_update_pool: dict[int, list[torch.cuda.Stream]] = {}


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The communication stream of a device, shared by every compiled graph."""
    return _first(_comm_pool, device, 1)[0]
