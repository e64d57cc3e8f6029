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

The same module carries the lag of `release_lag_trial`: while
`erase_fx.compile_step` tunes a step, each capture is a trial of one
``release_lag`` for the programs built with ``release_lag="auto"``.
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


# -- the release lag of programs built with release_lag="auto" --------------------------------

#: `EraseConfig.release_lag`'s value that lets `erase_fx.compile_step` choose it by timing.
AUTO = "auto"


@dataclasses.dataclass
class LagTrial:
    """One whole-step capture's choice of lag for ``release_lag="auto"`` programs.

    Attributes:
        lag: the lag those programs plan their captured frees with.
        asked: how many calls of such programs ran inside the trial.
    """

    lag: int | None
    asked: int = 0


_trial: LagTrial | None = None


@contextlib.contextmanager
def release_lag_trial(lag: int | None) -> Iterator[LagTrial]:
    """Inside: programs built with ``release_lag="auto"`` free memory under capture as with
    ``release_lag=lag``; the trial counts how many of their calls asked (none: the step has no
    such program and nothing is worth timing). Process-wide like the scope above. Inside
    another trial (a step captured inside a step) it changes nothing and counts nothing: the
    outer trial decides.
    """
    global _trial
    trial = LagTrial(lag)
    with _lock:
        outer, _trial = _trial, _trial or trial
    try:
        yield trial
    finally:
        with _lock:
            _trial = outer


def auto_release_lag() -> int | None:
    """The lag a ``release_lag="auto"`` program uses now: the open trial's, else ``None``
    (memory held to the join, as by default), and the trial notes that it was asked."""
    with _lock:
        if _trial is None:
            return None
        _trial.asked += 1
        return _trial.lag
