"""The scope of one `erase_fx.compile_step`: what its step's programs can tune, and what it sets.

`erase_fx.compile_step` captures the whole training step in one CUDA graph.
Two things flow between it and the programs erase compiled (`StreamProgram`,
the CUDA graphs around them), both at run time:

- while it warms the step up (uncaptured calls that compile, create optimizer
  state and initialise libraries) and while it captures, erase's own
  `GraphedForward` / `GraphedBackward` must run the compiled program as is:
  under the capture they notice it (the current stream is capturing), but
  during the uncaptured warm-up they would capture graphs of their own, which
  the whole-step graph never replays (memory for nothing);
- a program built with ``release_lag="auto"`` or ``side_cuda_streams="auto"``
  says what it can tune (`Tunables`), and compile_step sets, for each of its
  captures, the values it runs with (`CaptureChoice`): it tries candidates
  and keeps one (`erase_fx.capture_tuning`); a graph compiled with
  ``Tuning.stock_candidate`` can also run its stock compilation instead
  (`erase_fx.emit.stock_switch.StockSwitch`), which compile_step warms up
  before its capture, that warm-up running with the choice too.

Both go through the `StepScope` that compile_step owns. The user's step
function sits between compile_step and the programs (compile_step calls it;
it calls the compiled model; Dynamo's code calls the program), so nothing can
be handed down as an argument: compile_step makes its scope the current one
around each warm-up and capture call (`StepScope.entered`, a context variable
set and reset around the call, never left set), and each program that runs
meets the current scope (`meet`): the scope keeps the programs of its step and
sets on each the choice of the warm-up or capture under way
(`StepScope.trying`), the defaults at any other time.

"auto" outside compile_step's captures: the defaults, deliberately
(``release_lag`` None: what the main stream made and side streams read is
held to the join; ``side_cuda_streams`` None: one CUDA stream per side
stream). Both trade time for memory, and only timing captures of the whole
step tells which pays; erase's own CUDA graphs of a program, and a capture
written by hand, have no such timing, so they run with the defaults (a
value other than "auto" fixes either everywhere).

NB: a context variable is seen by the thread that set it (and the contexts
copied from it), not by the autograd engine's device threads, where a CUDA
backward runs: what the backward needs, it reads from its forward, which ran
in the caller's thread (`GraphedForward.inside_step`, the early-update
session an `EarlyUpdates` keeps per forward). A scope entered while another
is current (a step that calls another step) changes nothing: the outer
step's scope stays current and decides.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class CaptureChoice:
    """How a captured run of a program releases memory and on how many CUDA streams it runs,
    or whether its graph runs its stock compilation instead.

    Attributes:
        lag: ``release_lag`` (None: held to the join).
        width: ``side_cuda_streams`` (None: one CUDA stream per side stream).
        stock: the graphs that can (`Tunables.stock`) run their stock compilation, with no
            early block; the others run as with the defaults.
    """

    lag: int | None = None
    width: int | None = None
    stock: bool = False

    def describe(self) -> str:
        if self.stock:
            return "stock (no early blocks)"
        return f"release_lag={self.lag}, side_cuda_streams={self.width}"


#: What a program built with "auto" runs with when no capture of compile_step is under way.
DEFAULT_CHOICE = CaptureChoice()


@dataclasses.dataclass(frozen=True)
class Tunables:
    """What compile_step may choose for one program.

    Attributes:
        release_lag: its ``release_lag`` is ``"auto"`` and changes how its captured run
            frees memory (some tensor the main stream makes is read only on side streams).
        side_streams: with ``side_cuda_streams="auto"``, how many side streams it has, which
            could fold onto fewer CUDA streams; 0 with a fixed value.
        stock: it can run its graph's stock compilation instead (``Tuning.stock_candidate``:
            `erase_fx.emit.stock_switch.StockSwitch`).
    """

    release_lag: bool = False
    side_streams: int = 0
    stock: bool = False


class Tunable(Protocol):
    """A program compile_step can tune: it says what (`tunables`), and takes the values."""

    tunables: Tunables

    def tune(self, choice: CaptureChoice) -> None:
        """Run with ``choice`` for the options built with ``"auto"``, from the next call on."""


_CURRENT: contextvars.ContextVar[StepScope | None] = contextvars.ContextVar(
    "erase_fx_step_scope", default=None)


class StepScope:
    """One `erase_fx.compile_step`'s: the programs its step runs, and what it sets on them.

    Attributes:
        choice: what the programs run with: the warm-up's or capture's under way
            (`trying`), else `DEFAULT_CHOICE`.
        session: the early-update session of the capture under way
            (`erase_fx.early_update.open_session`), or None.
        early_optimizer: the step's captures update early blocks' parameters during the
            forward (``compile_step(early_optimizer=True)``): a graph with early updates
            planned then gets no stock candidate (`erase_fx.emit.stock_switch`).
    """

    def __init__(self, early_optimizer: bool = False) -> None:
        self.choice = DEFAULT_CHOICE
        self.session: Any = None
        self.early_optimizer = early_optimizer
        # NB: held weakly: a recompiled graph's old program goes with its compiled code
        self._programs: weakref.WeakSet[Any] = weakref.WeakSet()
        self._met: list[Tunables] | None = None

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Inside: this is the current scope (`current_scope`): the programs that run meet it,
        and erase's own CUDA graphs run them as they are. Inside another step's scope,
        nothing changes: that one stays current."""
        if _CURRENT.get() is not None:
            yield
            return
        token = _CURRENT.set(self)
        try:
            yield
        finally:
            _CURRENT.reset(token)

    def meet(self, program: Tunable) -> None:
        """``program`` runs in this scope's step: keep it, set the current choice on it, and
        note what it can tune for the capture under way."""
        self._programs.add(program)
        program.tune(self.choice)
        if self._met is not None:
            self._met.append(program.tunables)

    @contextlib.contextmanager
    def trying(self, choice: CaptureChoice) -> Iterator[list[Tunables]]:
        """Inside (one capture of the step, or a warm-up before one): every program of the
        step runs with ``choice``, those met before set now, the others as they run; yields
        what each program that runs can tune, one entry per call (none: nothing to try).
        After: the defaults again.
        A scope that is not the current one (a step inside a step) sets and notes nothing."""
        if _CURRENT.get() is not self:
            yield []
            return
        met: list[Tunables] = []
        self._met = met
        self._set(choice)
        try:
            yield met
        finally:
            self._met = None
            self._set(DEFAULT_CHOICE)

    def _set(self, choice: CaptureChoice) -> None:
        self.choice = choice
        for program in list(self._programs):
            program.tune(choice)


def current_scope() -> StepScope | None:
    """The scope of the `erase_fx.compile_step` warming up or capturing a step in this thread,
    if any (see the module docstring)."""
    return _CURRENT.get()


def meet(program: Tunable) -> None:
    """``program`` runs: the current scope, if any, meets it (`StepScope.meet`)."""
    scope = _CURRENT.get()
    if scope is not None:
        scope.meet(program)
