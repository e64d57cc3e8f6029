"""What running a step on a stream means: CUDA streams, or virtual ones on CPU.

`StreamOps.run(stream, fn, inputs, joins)` runs one compiled segment on a
stream (a main-stream segment first waits for the side streams in
``joins``); `StreamOps.join(streams, outputs)` ends a forward: the main
stream waits for the side streams, and outputs made there become safe to use
on the main stream. `StreamOps.run_comm(after, tensors, fn)` runs collective
work (`erase_fx.ddp`'s early all-reduce) on a communication stream once the
streams in ``after`` have done the work launched on them so far;
`StreamOps.wait_comm()` makes the current stream wait for it (the backward
does, before it reads what was reduced).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from erase_fx.emit.inner import BoxedCallable
from erase_fx.passes import MAIN_STREAM

T = TypeVar("T")


class StreamOps(Protocol):
    def run(
        self, stream: int, fn: BoxedCallable, inputs: list[Any], joins: Sequence[int] = ()
    ) -> Sequence[Any]: ...

    def join(self, streams: Sequence[int], side_outputs: Sequence[Any]) -> None: ...

    def record_event(self, stream: int) -> Any: ...

    def wait_events(self, events: Sequence[Any]) -> None: ...

    def run_comm(self, after: Sequence[int], tensors: Sequence[Any],
                 fn: Callable[[], T]) -> T: ...

    def wait_comm(self) -> None: ...


class VirtualStreams:
    """CPU: streams are labels; steps run in program order.

    With ``trace=True`` it records what a CUDA run would do, as
    ``("run", stream)`` / ``("fork", stream)`` / ``("wait", streams)`` /
    ``("join", streams)`` tuples, so tests on CPU can check the sync protocol.
    """

    def __init__(self, trace: bool = False):
        self.trace: list[tuple[Any, ...]] | None = [] if trace else None

    def run(
        self, stream: int, fn: BoxedCallable, inputs: list[Any], joins: Sequence[int] = ()
    ) -> Sequence[Any]:
        if self.trace is not None:
            if stream != MAIN_STREAM:
                self.trace.append(("fork", stream))
            elif joins:
                self.trace.append(("wait", tuple(joins)))
            self.trace.append(("run", stream))
        return fn(inputs)

    def join(self, streams: Sequence[int], side_outputs: Sequence[Any]) -> None:
        if self.trace is not None:
            self.trace.append(("join", tuple(streams)))

    def record_event(self, stream: int) -> Any:
        if self.trace is not None:
            self.trace.append(("record", stream))
        return stream

    def wait_events(self, events: Sequence[Any]) -> None:
        if self.trace is not None:
            self.trace.append(("wait_events", tuple(events)))

    def run_comm(self, after: Sequence[int], tensors: Sequence[Any], fn: Callable[[], T]) -> T:
        """In program order: the collective runs now (on CPU, gloo's blocking call)."""
        if self.trace is not None:
            self.trace.append(("comm", tuple(after)))
        return fn()

    def wait_comm(self) -> None:
        if self.trace is not None:
            self.trace.append(("wait_comm",))


class CudaStreams:
    """CUDA: side steps run on side streams forked from, and joined to, the current stream."""

    def __init__(self, device: torch.device, num_side_streams: int):
        self.device = device
        self.side = side_streams(device, num_side_streams)
        self._comm: torch.cuda.Stream | None = None

    def run(
        self, stream: int, fn: BoxedCallable, inputs: list[Any], joins: Sequence[int] = ()
    ) -> Sequence[Any]:
        main = torch.cuda.current_stream(self.device)
        if stream == MAIN_STREAM:
            if joins:
                self._wait_for(main, joins, inputs)
            return fn(inputs)
        side = self.side[stream - 1]
        side.wait_stream(main)
        # NB: the caching allocator must not hand an input's memory to main-stream
        # work while this side stream may still read it. Outside capture,
        # record_stream says so. Under CUDA graph capture memory freed is not
        # guarded by stream uses (seen as a race on an H200, torch 2.11):
        # there `StreamProgram` orders every reuse itself (erase_fx.emit.release).
        if not torch.cuda.is_current_stream_capturing():
            for value in inputs:
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(side)
        with torch.cuda.stream(side):
            return fn(inputs)

    def join(self, streams: Sequence[int], side_outputs: Sequence[Any]) -> None:
        main = torch.cuda.current_stream(self.device)
        self._wait_for(main, streams, side_outputs)

    def record_event(self, stream: int) -> torch.cuda.Event:
        """An event on a side stream after the work launched there so far."""
        event = torch.cuda.Event()
        event.record(self.side[stream - 1])
        return event

    def wait_events(self, events: Sequence[torch.cuda.Event]) -> None:
        """The main stream waits for side-stream events (before it reuses their inputs' memory)."""
        main = torch.cuda.current_stream(self.device)
        for event in events:
            main.wait_event(event)

    @property
    def comm(self) -> torch.cuda.Stream:
        """The device's communication stream (made on first use, shared by every graph)."""
        if self._comm is None:
            self._comm = comm_stream(self.device)
        return self._comm

    def run_comm(self, after: Sequence[int], tensors: Sequence[Any], fn: Callable[[], T]) -> T:
        """``fn`` on the communication stream, after the work launched so far on ``after``.

        ``tensors`` (made on those streams) are marked as used by the
        communication stream, so their memory is not handed out again before
        it is done with them. NCCL runs the collective itself on its own
        stream, ordered after the communication stream's work and before its
        later work (``Work.wait()``).
        """
        comm = self.comm
        main = torch.cuda.current_stream(self.device)
        for stream in after:
            comm.wait_stream(main if stream == MAIN_STREAM else self.side[stream - 1])
        if not torch.cuda.is_current_stream_capturing():
            for value in tensors:
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(comm)
        with torch.cuda.stream(comm):
            return fn()

    def wait_comm(self) -> None:
        """The current stream waits for the communication stream's work so far."""
        if self._comm is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._comm)

    def _wait_for(self, main: torch.cuda.Stream, streams: Sequence[int],
                  side_values: Sequence[Any]) -> None:
        """The main stream waits for side streams before it uses values made there."""
        for stream in streams:
            main.wait_stream(self.side[stream - 1])
        if torch.cuda.is_current_stream_capturing():
            return  # values of a captured forward live in the graph's own memory
        for value in side_values:
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(main)


_pool_lock = threading.Lock()
_pool: dict[int, list[torch.cuda.Stream]] = {}


def side_streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    """``count`` side streams of a device, shared by every compiled graph."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _pool_lock:
        streams = _pool.setdefault(index, [])
        while len(streams) < count:
            streams.append(torch.cuda.Stream(device=index))
        return streams[:count]


_comm_pool: dict[int, torch.cuda.Stream] = {}


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The communication stream of a device, shared by every compiled graph."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _pool_lock:
        if index not in _comm_pool:
            _comm_pool[index] = torch.cuda.Stream(device=index)
        return _comm_pool[index]
