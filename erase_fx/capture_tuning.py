"""`compile_step` picks ``release_lag`` and ``side_cuda_streams`` by timing captures.

Why: under CUDA graph capture memory goes back to a stream only for its own
reuse, so two choices decide a captured step's memory and neither is free:

- ``Tuning.release_lag``: a block's activations that the main stream
  made and its early backward read on a side stream are held to the join at
  the end of the forward, unless the main stream waits for the side stream
  and frees them N main segments later (`erase_fx.emit.release`). The wait
  costs time where the side stream is still busy, and saves memory only
  where those activations set the pool's peak (what it did on the measured
  models: ``docs/performance.md``, "Tuning settings");
- ``Tuning.side_cuda_streams``: each CUDA stream keeps its own memory
  pool and cuBLAS workspace, and the pools add up; folding the side streams
  onto fewer CUDA streams (`erase_fx.emit.streams`) makes blocks share them,
  and costs time where those blocks would have overlapped.

Neither changes a kernel, so `erase_fx.compile_step` can try each candidate
without compiling anything: for a step whose programs were built with
``"auto"`` for either (the defaults), it captures the step once per candidate
`CaptureChoice`, times a few replays of each (every replay is one of the
caller's real training steps: nothing is run for nothing), and keeps the
choice whose graph holds the least memory among those within
`TIME_TOLERANCE` of the fastest.

With ``Tuning.stock_candidate``, a graph compiled with early blocks inside
compile_step was also compiled by the stock backend, and can run that
instead (`erase_fx.emit.stock_switch`): the stock program is one more
candidate, last (``CaptureChoice(stock=True)``), chosen by the same rule, so
the step is never slower than stock's by more than the tolerance. Its
compiled code has not run before its capture: compile_step warms the step up
with it first (`erase_fx.step.tuning`).

The protocol (one `CaptureTuner` per argument signature):

1. the first capture, with the defaults, says what its programs can tune
   (`erase_fx.emit.capture_scope.Tunables`; `candidates_for`); its pool's
   size is reported (`captured`);
2. its replays after the first are timed with CUDA events (`replay`);
3. after `TIMED_REPLAYS` of them `next_capture` says what to capture next:
   the next candidate, or, once all are measured, the chosen one (``KEEP``
   when it is the graph in hand). A candidate that frees no sooner and folds
   no less than one already measured too slow is skipped: it makes the
   streams wait no less, so it is assumed no faster (never the stock
   candidate: a slow erase schedule says nothing of stock's);
4. a candidate whose capture raises (out of memory: while it is captured
   the last graph's gradients are still alive) ends the tuning with what
   was measured (`capture_failed`), and the choice is captured next.

`choose` and `next_candidate` are pure; the tests check them, and the
state machine through a fake CUDA.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from erase_fx.emit.capture_scope import CaptureChoice, Tunables

#: the release lags tried, in order (None: held to the join, the default)
LAGS: tuple[int | None, ...] = (None, 2, 1)
#: the CUDA streams the side streams are folded onto, tried in order (None: one each)
WIDTHS: tuple[int | None, ...] = (None, 2)
#: replays timed per candidate, after the capture's own replay
TIMED_REPLAYS = 6
#: a candidate whose median replay is within this share of the fastest one's counts as fast
TIME_TOLERANCE = 0.02
#: `CaptureTuner.next_capture`: the graph in hand is the chosen one
KEEP = "keep"
#: The caching allocator's own pool in a memory snapshot (``segment_pool_id``): no graph's
DEFAULT_POOL = (0, 0)
#: The candidate that runs each switchable graph's stock compilation (``Tuning.stock_candidate``)
STOCK_CHOICE = CaptureChoice(stock=True)


@dataclasses.dataclass(frozen=True)
class CaptureMeasurement:
    """One candidate's capture: its replays' times (ms: median, min, max) and its pool's bytes."""

    choice: CaptureChoice
    ms: float
    ms_min: float
    ms_max: float
    pool_bytes: int

    def describe(self) -> str:
        return (f"{self.choice.describe()}: {self.ms:.3f} ms ({self.ms_min:.3f}-"
                f"{self.ms_max:.3f}), {self.pool_bytes / 2**20:.0f} MiB")


def candidates_for(met: Sequence[Tunables]) -> tuple[CaptureChoice, ...]:
    """The choices worth trying for what the first capture's programs can tune (``met``: one
    entry per program call): the lags if one can tune ``release_lag``, the widths below its
    side streams if one can fold more than one side stream; the default first; the stock
    programs last if one can switch to its stock compilation."""
    lags = LAGS if any(t.release_lag for t in met) else (None,)
    widest = max((t.side_streams for t in met if t.side_streams > 1), default=0)
    widths = tuple(w for w in WIDTHS if w is None or w < widest) if widest else (None,)
    erase = tuple(CaptureChoice(lag, width) for width in widths for lag in lags)
    return erase + ((STOCK_CHOICE,) if any(t.stock for t in met) else ())


def _order(value: int | None) -> float:
    return float("inf") if value is None else value


def _no_freer(a: CaptureChoice, b: CaptureChoice) -> bool:
    """``a`` frees no later and folds no less than ``b``: its streams wait no less (erase's
    schedules only: the stock program has no side streams to wait on)."""
    if a.stock or b.stock:
        return False
    return _order(a.lag) <= _order(b.lag) and _order(a.width) <= _order(b.width)


def choose(measured: Sequence[CaptureMeasurement], tolerance: float = TIME_TOLERANCE
           ) -> CaptureChoice:
    """The choice with the least pool memory among those within ``tolerance`` of the fastest
    median; on a tie, the one measured first."""
    if not measured:
        raise ValueError("choose needs at least one measurement")
    fastest = min(m.ms for m in measured)
    fast = [m for m in measured if m.ms <= fastest * (1 + tolerance)]
    return min(fast, key=lambda m: m.pool_bytes).choice


def next_candidate(measured: Sequence[CaptureMeasurement],
                   candidates: Sequence[CaptureChoice],
                   tolerance: float = TIME_TOLERANCE) -> CaptureChoice | None:
    """The next candidate to measure, or None: the first not measured yet that waits no
    less than none measured too slow (the stock program is never skipped: `_no_freer`)."""
    tried = {m.choice for m in measured}
    fastest = min((m.ms for m in measured), default=0.0)
    slow = [m.choice for m in measured if m.ms > fastest * (1 + tolerance)]
    for choice in candidates:
        if choice not in tried and not any(_no_freer(choice, s) for s in slow):
            return choice
    return None


def erase_over_stock(measured: Sequence[CaptureMeasurement]) -> float | None:
    """The median time of erase's fastest candidate over the stock program's, or None when
    either is not measured."""
    stock = [m.ms for m in measured if m.choice.stock]
    erase = [m.ms for m in measured if not m.choice.stock]
    if not stock or not erase or stock[0] <= 0:
        return None
    return min(erase) / stock[0]


class CaptureTuner:
    """One signature's tuning; see the module docstring.

    Attributes:
        candidates: the choices worth trying (`candidates_for`).
        choice: the choice of the graph in hand (or of the next capture).
        measured: the candidates measured so far, in order.
        chosen: the choice kept, once `done`.
    """

    def __init__(self, candidates: Sequence[CaptureChoice]):
        self.candidates = tuple(candidates)
        self.choice = self.candidates[0]
        self.measured: list[CaptureMeasurement] = []
        self.chosen: CaptureChoice | None = None
        self.done = False
        self._pool_bytes = 0
        self._pairs: list[tuple[Any, Any]] = []
        self._untimed = 0

    def captured(self, pool_bytes: int) -> None:
        """A capture with `choice` is in hand; its first replay (the capture's) is not timed."""
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

    def next_capture(self) -> CaptureChoice | str:
        """After a replay: ``KEEP`` (go on with the graph in hand), or the choice to capture.

        Once `TIMED_REPLAYS` replays are timed, the candidate is measured;
        then the next candidate, or the choice (``KEEP`` when it is the
        graph in hand; `done` from then on).
        """
        if len(self._pairs) < TIMED_REPLAYS:
            return KEEP
        times = median_and_range(self._pairs)
        self._pairs = []
        self.measured.append(CaptureMeasurement(self.choice, *times, self._pool_bytes))
        choice = next_candidate(self.measured, self.candidates)
        if choice is None:
            self.done = True
            self.chosen = choice = choose(self.measured)
            if choice == self.choice:
                return KEEP
        self.choice = choice
        return choice

    def describe(self) -> str:
        """What was chosen (or is under way), then each candidate measured: its choice, times
        and pool."""
        head = (f"{self.chosen.describe()} chosen" if self.done and self.chosen is not None
                else f"tuning, capturing {self.choice.describe()}")
        return "; ".join([head, *(m.describe() for m in self.measured)])

    def __repr__(self) -> str:
        return f"CaptureTuner({self.describe()})"

    def capture_failed(self) -> CaptureChoice:
        """The capture with `choice` raised (out of memory, say, while the last graph still
        held its gradients): the tuning ends with what is measured (the first candidate if
        nothing is), and the choice is captured next."""
        self.done = True
        self._pairs = []
        self.chosen = self.choice = (choose(self.measured) if self.measured
                                     else self.candidates[0])
        return self.chosen


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


def in_graph_pool(segment: dict[str, Any]) -> bool:
    """Whether a segment of the native allocator's snapshot belongs to a CUDA graph pool (not
    the default pool, id ``DEFAULT_POOL``)."""
    return tuple(segment.get("segment_pool_id", DEFAULT_POOL)) != DEFAULT_POOL


def graph_pools() -> dict[tuple[int, ...], int]:
    """Bytes of the segments the caching allocator holds per CUDA graph pool (the native
    allocator's snapshot)."""
    pools: dict[tuple[int, ...], int] = {}
    for segment in torch.cuda.memory_snapshot():
        if in_graph_pool(segment):
            pool = tuple(segment["segment_pool_id"])
            pools[pool] = pools.get(pool, 0) + segment["total_size"]
    return pools


def pool_bytes(pool: Any) -> int:
    """Bytes of the segments the caching allocator holds for the graph pool ``pool``: what a
    captured graph keeps (`graph_pools`)."""
    return graph_pools().get(tuple(pool), 0)
