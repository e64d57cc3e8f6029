"""What running a step on a stream means: CUDA streams, or virtual ones on CPU.

`StreamOps.run(stream, fn, inputs, joins)` runs one compiled segment on a
stream (a main-stream segment first waits for the side streams in
``joins``); `StreamOps.join(streams, outputs)` ends a forward: the main
stream waits for the side streams, and outputs made there become safe to use
on the main stream.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from erase_fx.emit.inner import BoxedCallable
from erase_fx.passes import MAIN_STREAM


class StreamOps(Protocol):
    def run(
        self, stream: int, fn: BoxedCallable, inputs: list[Any], joins: Sequence[int] = ()
    ) -> Sequence[Any]: ...

    def join(self, streams: Sequence[int], side_outputs: Sequence[Any]) -> None: ...

    def record_event(self, stream: int) -> Any: ...

    def wait_events(self, events: Sequence[Any]) -> None: ...


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


class CudaStreams:
    """CUDA: side steps run on side streams forked from, and joined to, the current stream."""

    def __init__(self, device: torch.device, num_side_streams: int):
        self.device = device
        self.side = side_streams(device, num_side_streams)

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
