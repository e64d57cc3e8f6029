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
"""
from __future__ import annotations

import contextlib
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
