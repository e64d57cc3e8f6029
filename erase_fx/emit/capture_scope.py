"""A scope in which erase's own CUDA graphs step aside for a whole-step capture.

`erase_fx.compile_step` captures the whole training step in one CUDA graph.
While it warms the step up (uncaptured calls that compile, create optimizer
state and initialise libraries) and while it captures, erase's own
`GraphedForward` / `GraphedBackward` must run the compiled program as is:
under the capture they already notice it (the current stream is capturing),
but during the uncaptured warm-up they would capture graphs of their own,
which the whole-step graph never replays (memory for nothing).

NB: process-wide, not thread-local or a contextvar: the autograd engine runs
a CUDA backward on its own device threads, where a thread-local flag set by
the caller is not visible, and `GraphedBackward` must see the scope there
too. A depth counter lets scopes nest (a step that calls another step).
While any scope is open, erase's graphs in every thread run as is (exact,
only not replayed).

The same module carries the choice of `capture_trial`: while
`erase_fx.compile_step` tunes a step, each capture is a trial of one
``release_lag`` and ``side_cuda_streams`` for the programs built with
``"auto"`` for them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def whole_step_scope() -> Iterator[None]:
    """Inside: erase's own CUDA graphs run the compiled program without capturing or replaying."""
    global _depth
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1


def in_whole_step_scope() -> bool:
    """Whether a whole-step warm-up or capture is under way (see `whole_step_scope`)."""
    return _depth > 0


# -- the choices of programs built with release_lag="auto" or side_cuda_streams="auto" ------

#: The option value that lets `erase_fx.compile_step` choose by timing.
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class CaptureChoice:
    """How a captured run of a program releases memory and on how many CUDA streams it runs.

    Attributes:
        lag: `EraseConfig.release_lag` (None: held to the join).
        width: `EraseConfig.side_cuda_streams` (None: one CUDA stream per side stream).
    """

    lag: int | None = None
    width: int | None = None

    def describe(self) -> str:
        return f"release_lag={self.lag}, side_cuda_streams={self.width}"


@dataclasses.dataclass
class CaptureTrial:
    """One whole-step capture's choice for the programs built with ``"auto"`` options.

    Attributes:
        choice: what those programs use.
        lag_asked: calls of programs whose ``release_lag`` is ``"auto"`` and matters.
        width_asked: calls of programs whose ``side_cuda_streams`` is ``"auto"`` and that
            have more than one side stream.
        widest: the most side streams of those programs.
    """

    choice: CaptureChoice
    lag_asked: int = 0
    width_asked: int = 0
    widest: int = 0


_trial: CaptureTrial | None = None


@contextlib.contextmanager
def capture_trial(choice: CaptureChoice) -> Iterator[CaptureTrial]:
    """Inside: programs built with ``"auto"`` options run with ``choice``; the trial counts
    which of them asked (none: the step has no such program and nothing is worth timing).
    Process-wide like the scope above. Inside another trial (a step captured inside a step)
    it changes nothing and counts nothing: the outer trial decides.
    """
    global _trial
    trial = CaptureTrial(choice)
    with _lock:
        outer, _trial = _trial, _trial or trial
    try:
        yield trial
    finally:
        with _lock:
            _trial = outer


def auto_choice(lag: bool, width: int) -> CaptureChoice:
    """The choice a program with ``"auto"`` options uses now: the open trial's, else the
    defaults (held to the join, every side stream its own). ``lag``: its ``release_lag`` is
    ``"auto"`` and changes its plan; ``width``: how many side streams it has, when its
    ``side_cuda_streams`` is ``"auto"`` (0 otherwise). The trial notes what was asked."""
    with _lock:
        if _trial is None:
            return CaptureChoice()
        _trial.lag_asked += lag
        if width > 1:
            _trial.width_asked += 1
            _trial.widest = max(_trial.widest, width)
        return _trial.choice
