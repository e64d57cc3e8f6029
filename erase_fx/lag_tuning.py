"""`compile_step` picks ``release_lag`` by timing captures: `LagTuner`.

Why: under CUDA graph capture a block's activations that the main stream
made and its early backward read on a side stream are held to the join at
the end of the forward, unless ``EraseConfig.release_lag`` lets the main
stream wait for the side stream and free them N main segments later
(`erase_fx.emit.release`). Whether that wait is free depends on how long
the side stream runs against the main segments after its block, which only
a timed run shows (H200: ``release_lag=2`` took the DGL ViT from 1.34x to
0.88x of stock's step memory for 1% of time, and cost DGL ResNet-18 12% for
nothing). The lag changes only the captured run's frees and waits, never a
kernel, so `erase_fx.compile_step` can try each candidate without compiling
anything: for a step whose programs were built with ``release_lag="auto"``
it captures the step once per candidate lag, times a few replays of each
(every replay is one of the caller's real training steps: nothing is run
for nothing), and keeps the lag whose graph holds the least memory among
those within `TIME_TOLERANCE` of the fastest.

The protocol (one `LagTuner` per argument signature):

1. a capture made with lag ``L`` reports its pool's size (`captured`);
2. its replays after the first are timed with CUDA events (`timed_replay`);
3. after `TIMED_REPLAYS` of them `next_capture` says which lag to capture
   next: the next candidate, or, once all are measured, the chosen one
   (``KEEP`` when it is the graph in hand). A candidate smaller than a lag
   already measured too slow is skipped: a smaller lag makes the main
   stream wait sooner, so it is no faster.

`choose_lag` and `next_candidate` are pure; the tests check them, and the
state machine through a fake CUDA.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import torch

#: the lags tried, in order (None: held to the join, the default's behaviour)
CANDIDATES: tuple[int | None, ...] = (None, 2, 1)
#: replays timed per candidate, after the capture's own replay
TIMED_REPLAYS = 6
#: a candidate whose median replay is within this share of the fastest one's counts as fast
TIME_TOLERANCE = 0.02
#: `LagTuner.next_capture`: the graph in hand is the chosen one
KEEP = "keep"


@dataclasses.dataclass(frozen=True)
class LagMeasurement:
    """One candidate's capture: its replays' times (ms: median, min, max) and its pool's bytes."""

    lag: int | None
    ms: float
    ms_min: float
    ms_max: float
    pool_bytes: int

    def describe(self) -> str:
        return (f"release_lag={self.lag}: {self.ms:.3f} ms ({self.ms_min:.3f}-{self.ms_max:.3f}), "
                f"{self.pool_bytes / 2**20:.0f} MiB")


def _lag_order(lag: int | None) -> float:
    return float("inf") if lag is None else lag


def choose_lag(measured: Sequence[LagMeasurement], tolerance: float = TIME_TOLERANCE
               ) -> int | None:
    """The lag with the least pool memory among those within ``tolerance`` of the fastest
    median; on a tie, the one measured first."""
    if not measured:
        raise ValueError("choose_lag needs at least one measurement")
    fastest = min(m.ms for m in measured)
    fast = [m for m in measured if m.ms <= fastest * (1 + tolerance)]
    return min(fast, key=lambda m: m.pool_bytes).lag


def next_candidate(measured: Sequence[LagMeasurement],
                   candidates: Sequence[int | None] = CANDIDATES,
                   tolerance: float = TIME_TOLERANCE) -> tuple[bool, int | None]:
    """``(True, lag)``: the next candidate to measure; ``(False, None)``: none left.

    A candidate is skipped when a larger lag (or None) was measured too slow.
    """
    tried = {m.lag for m in measured}
    fastest = min((m.ms for m in measured), default=0.0)
    slow = [m.lag for m in measured if m.ms > fastest * (1 + tolerance)]
    for lag in candidates:
        if lag in tried:
            continue
        if any(_lag_order(lag) < _lag_order(s) for s in slow):
            continue
        return True, lag
    return False, None


class LagTuner:
    """One signature's tuning; see the module docstring.

    Attributes:
        lag: the lag of the graph in hand (or of the next capture).
        measured: the candidates measured so far, in order.
        chosen: the lag kept, once `done`.
    """

    def __init__(self, candidates: Sequence[int | None] = CANDIDATES):
        self.candidates = tuple(candidates)
        self.lag: int | None = self.candidates[0]
        self.measured: list[LagMeasurement] = []
        self.chosen: int | None = None
        self.done = False
        self._pool_bytes = 0
        self._pairs: list[tuple[Any, Any]] = []
        self._untimed = 0

    def captured(self, pool_bytes: int) -> None:
        """A capture with `lag` is in hand; its first replay (the capture's) is not timed."""
        self._pool_bytes = pool_bytes
        self._pairs = []
        self._untimed = 1

    def forget_replays(self) -> None:
        """The graph in hand was dropped (a guard failed): its timings go with it."""
        self._pairs = []

    def replay(self, graph: Any) -> None:
        """Replay ``graph``; timed unless it is the capture's own replay."""
        if self._untimed:
            self._untimed -= 1
            graph.replay()
            return
        self._pairs.append(timed_replay(graph))

    def next_capture(self) -> int | None | str:
        """After a replay: ``KEEP`` (go on with the graph in hand), or the lag to capture next.

        Once `TIMED_REPLAYS` replays are timed, the candidate is measured;
        then the next candidate, or the choice (``KEEP`` when it is the
        graph in hand; `done` from then on).
        """
        if len(self._pairs) < TIMED_REPLAYS:
            return KEEP
        times = median_and_range(self._pairs)
        self._pairs = []
        self.measured.append(LagMeasurement(self.lag, *times, self._pool_bytes))
        more, lag = next_candidate(self.measured, self.candidates)
        if not more:
            self.done = True
            self.chosen = lag = choose_lag(self.measured)
            if lag == self.lag:
                return KEEP
        self.lag = lag
        return lag


def timed_replay(graph: Any) -> tuple[Any, Any]:
    """Replay ``graph`` between two timing events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    return start, end


def median_and_range(pairs: Sequence[tuple[Any, Any]]) -> tuple[float, float, float]:
    """Median, min and max milliseconds between each pair's events (waits for the last)."""
    pairs[-1][1].synchronize()
    times = [start.elapsed_time(end) for start, end in pairs]
    return statistics.median(times), min(times), max(times)


def graph_pools() -> dict[tuple[int, ...], int]:
    """Bytes of the segments the caching allocator holds per CUDA graph pool (the native
    allocator's snapshot; the default pool, id (0, 0), left out)."""
    pools: dict[tuple[int, ...], int] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        if pool != (0, 0):
            pools[pool] = pools.get(pool, 0) + segment["total_size"]
    return pools


def pool_bytes(pool: Any) -> int:
    """Bytes of the segments the caching allocator holds for the graph pool ``pool``: what a
    captured graph keeps (`graph_pools`)."""
    return graph_pools().get(tuple(pool), 0)
