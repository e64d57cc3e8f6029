"""Running the step off the caller's stream: a warm-up call, or a capture into a CUDA graph.

Both run on a side stream of the step's own (`Capturer`), inside the step's
`erase_fx.emit.capture_scope.StepScope` (erase's programs meet it: their own
CUDA graphs step aside, and a capture sets what their ``"auto"`` options run
with), recording the optimizers that step and, while it is installed, the
modules that run (`erase_fx.step.uses.StepUses.recording`). A capture goes
into a private memory pool, from static copies of the tensor arguments;
with ``early_optimizer`` an `erase_fx.early_update.UpdateSession` is open
around it. `Entry` is one signature's state, its graph once captured.
A capture that raises is described for the user (`describe_failure`: what
failed, where in the step, the fix).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from erase_fx.capture_tuning import CaptureTuner
from erase_fx.early_update import open_session
from erase_fx.graph_breaks import TORCH_ROOT
from erase_fx.emit.capture_scope import DEFAULT_CHOICE, CaptureChoice, StepScope, Tunables
from erase_fx.step.arguments import unflatten
from erase_fx.step.guards import Guards
from erase_fx.step.uses import StepUses


@dataclasses.dataclass(eq=False)
class Entry:
    """One signature's state: warm-ups done, and its graph once captured."""

    warmups: int = 0
    hooked: bool = False
    reason: str | None = None
    mutated: set[int] = dataclasses.field(default_factory=set)
    graph: Any = None
    input_indices: list[int] = dataclasses.field(default_factory=list)
    static_inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    copy_back: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)
    outputs: list[Any] = dataclasses.field(default_factory=list)
    out_spec: Any = None
    single: bool = False
    guards: Guards | None = None
    #: with programs built with ``"auto"`` options: their tuning (`erase_fx.capture_tuning`)
    tuner: CaptureTuner | None = None
    #: the next capture is one of the tuning's (not counted toward ``max_captures``)
    tuning_capture: bool = False

    def keep(self, captured: Captured, guards: Guards) -> None:
        """The capture in hand becomes this signature's graph (its outputs kept detached)."""
        static, indices = captured.static, captured.input_indices
        self.single = isinstance(captured.out, torch.Tensor)
        out_leaves, self.out_spec = pytree.tree_flatten(captured.out)
        captured.out = None
        self.graph = captured.graph
        self.input_indices = indices
        self.static_inputs = [static[i] for i in indices]
        self.mutated.update(i for i, v in zip(indices, captured.static_versions)
                            if static[i]._version != v)
        self.copy_back = [(i, static[i]) for i in sorted(self.mutated)]
        self.outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves]
        self.guards = guards

    def drop(self, warm_up_again: bool = True) -> None:
        """Forget the graph (its memory goes once nothing holds its tensors) and, unless only
        the capture's choice changes (a tuning), warm up again."""
        self.graph = None
        self.guards = None
        self.static_inputs = []
        self.copy_back = []
        self.outputs = []
        if warm_up_again:
            self.warmups = 0
            self.tuning_capture = False


@dataclasses.dataclass(eq=False)
class Captured:
    """One capture of the step, not yet kept.

    Attributes:
        graph: the CUDA graph; pool: its memory pool.
        out: what the step returned (graph memory).
        static: the arguments' leaves, tensors replaced by their static copies.
        input_indices: which leaves are tensors; static_versions: their versions before.
        met: what the programs that ran can tune (`StepScope.trying`).
        session: the early-update session, closed (its counts kept), or None.
    """

    graph: Any
    pool: Any
    out: Any
    static: list[Any]
    input_indices: list[int]
    static_versions: list[int]
    met: list[Tunables]
    session: Any


class Capturer:
    """Runs the step as written (a warm-up) or captures it, on a side stream, in its scope.

    Attributes:
        scope: the step's `StepScope`: how its warm-ups and captures reach erase's programs.
    """

    def __init__(self, fn: Any, uses: StepUses, early_optimizer: bool):
        self.fn = fn
        self.uses = uses
        self.early_optimizer = early_optimizer
        self.scope = StepScope(early_optimizer)
        self._side: Any = None

    def side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream()
        return self._side

    def warm_up(self, args: tuple, kwargs: dict, leaves: list[Any],
                choice: CaptureChoice = DEFAULT_CHOICE) -> tuple[Any, set[int]]:
        """One call as written, on the side stream, erase's programs running with ``choice``
        (the next capture's): what it returned, and the indices of the tensor arguments it
        changed in place."""
        tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        versions = [t._version for _, t in tensors]
        current = torch.cuda.current_stream()
        side = self.side_stream()
        side.wait_stream(current)
        try:
            with self.uses.recording(), self.scope.entered(), self.scope.trying(choice), \
                    torch.cuda.stream(side):
                out = self.fn(*args, **kwargs)
        finally:
            current.wait_stream(side)
            self.uses.stepped = []
        return out, {i for (i, t), v in zip(tensors, versions) if t._version != v}

    def capture(self, leaves: list[Any], spec: Any, choice: CaptureChoice) -> Captured:
        """Capture one call into a CUDA graph in a private pool, from static copies of the tensor
        arguments, erase's ``"auto"`` programs running with ``choice``. Raises what the
        capture raised (the caller restores the Python state and describes it)."""
        input_indices = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        static = list(leaves)
        for i in input_indices:
            static[i] = leaves[i].detach().clone()
        static_versions = [static[i]._version for i in input_indices]
        static_args, static_kwargs = unflatten(static, spec)
        current = torch.cuda.current_stream()
        side = self.side_stream()
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        try:
            # NB: our own stream context outside the capture's: if capture_end raises,
            # torch.cuda.graph leaves its stream set; ours puts the caller's back.
            with self.uses.recording(), self.scope.entered(), torch.cuda.stream(side):
                with self._early_updates() as session, self.scope.trying(choice) as met, \
                        torch.cuda.graph(graph, pool=pool, stream=side,
                                         capture_error_mode="thread_local"):
                    out = self.fn(*static_args, **static_kwargs)
        except Exception:
            graph = None  # NB: dropped now: its destructor releases the generators' capture state
            self.uses.stepped = []
            current.wait_stream(side)
            raise
        current.wait_stream(side)
        return Captured(graph, pool, out, static, input_indices, static_versions, met, session)

    @contextlib.contextmanager
    def _early_updates(self) -> Iterator[Any]:
        """With ``early_optimizer``, an `erase_fx.early_update.UpdateSession` around the capture."""
        if not self.early_optimizer:
            yield None
            return
        with open_session(self.scope, self.uses.live(self.uses.optimizers),
                          own_hooks=[self.uses.on_optimizer_step]) as session:
            yield session


# -- capture failures -------------------------------------------------------------

#: erase_fx's own folder: its frames are not the user's line that failed
_ERASE_FX_DIR = os.path.dirname(os.path.dirname(__file__))


_SYNC_FIX = ("move host syncs out of the step (.item(), .tolist(), printing a tensor, `if "
             "tensor:`, GradScaler's inf check, torch.cuda.synchronize()): return the tensor "
             "and read it after the call")
_CAPTURABLE_FIX = ("construct the optimizer with capturable=True, e.g. "
                   "torch.optim.Adam(params, capturable=True) (AdamW likewise)")
_OTHER_FIX = ("remove that operation from the step, or run the step uncaptured "
              "(compile_step(..., max_captures=0)) to debug it")


def _root_error(error: BaseException) -> BaseException:
    """The first error of a chain (torch.cuda.graph's exit raises a second one on top)."""
    seen = {id(error)}
    while True:
        inner = error.__cause__ or error.__context__
        if inner is None or id(inner) in seen:
            return error
        seen.add(id(inner))
        error = inner


def describe_failure(error: BaseException) -> tuple[str, str]:
    """(what failed and where in the step, the fix) for a failed capture."""
    root = _root_error(error)
    first_line = (str(root).strip().splitlines() or [""])[0][:300].rstrip(".")
    text = f"{str(root)} {str(error)}"
    where = _user_frame(root)
    what = f"CUDA graph capture of the step failed{where}: {type(root).__name__}: {first_line}"
    if "capturable" in text:
        return what, _CAPTURABLE_FIX
    if "capturing" in text.lower() or "StreamCapture" in text or "synchroniz" in text.lower():
        return what, _SYNC_FIX
    return what, _OTHER_FIX


def _user_frame(error: BaseException) -> str:
    """`` at file:line `code` ``: the innermost frame of the traceback outside torch and erase_fx.

    Frames of torch function and dispatch modes count as torch's: they run under the op.
    """
    skip = (TORCH_ROOT, _ERASE_FX_DIR + os.sep)
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        filename = frame.filename
        if (filename.startswith(skip) or filename.startswith("<") or "contextlib" in filename
                or frame.name in ("__torch_dispatch__", "__torch_function__")):
            continue
        code = f" `{frame.line.strip()}`" if frame.line else ""
        return f" at {os.path.basename(filename)}:{frame.lineno}{code}"
    return ""


def clear_frames(error: BaseException) -> None:
    """Drop the locals of the failed capture's frames (they hold the graph and its memory)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
