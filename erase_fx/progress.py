"""Progress lines while erase_fx compiles: a first compile takes seconds to minutes.

Each compiled graph says what it compiles and, when done, how long it took::

    erase_fx: graph 0: 3 early blocks; compiling the forward with Inductor in 7 segments
    erase_fx: graph 0: forward compiled in 21.4 s

The lines go to the ``erase_fx.progress`` logger at INFO. So that they show
with no logging set up, erase_fx gives that logger a handler that prints to
stderr (and does not pass the lines on to the root logger, which would print
them twice), unless ``ERASE_FX_PROGRESS=0`` or the logger already has a
handler of the user's. ``logging.getLogger("erase_fx.progress").setLevel(logging.WARNING)``
silences them too.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

log = logging.getLogger("erase_fx.progress")


def install_default_handler() -> None:
    """Print progress lines to stderr unless the user chose otherwise (see the module doc)."""
    if os.environ.get("ERASE_FX_PROGRESS", "1") == "0" or log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("erase_fx: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


@contextlib.contextmanager
def compiling(graph_id: int, what: str, detail: str = "") -> Iterator[None]:
    """``graph N: <detail>compiling <what>`` now, ``graph N: <what> compiled in X s`` after."""
    log.info("graph %d: %scompiling the %s", graph_id, detail, what)
    start = time.perf_counter()
    yield
    log.info("graph %d: %s compiled in %.1f s", graph_id, what, time.perf_counter() - start)
