"""The whole training step in one CUDA graph: `compile_step`.

Why: erase_fx runs the backward of detached blocks early, on side streams,
overlapping the forward. That pays only once the CPU is out of the way: on
small and medium models every kernel launch, stream switch and Python line
of a step costs more than the GPU work it starts, unless the whole step
(forward, early and late backward, optimizer update) replays from one CUDA
graph. Writing that capture by hand is easy to get subtly wrong (warm-up
that advances BatchNorm statistics twice, optimizer state created under
capture and re-zeroed at each replay, a moved parameter read at its old
address, a learning rate frozen into the graph). `compile_step` does it,
with a guard for each of those:

```python
@erase_fx.compile_step
def train_step(x, y):
    opt.zero_grad(set_to_none=True)
    loss = compiled_model(x, y)
    loss.backward()
    opt.step()
    return loss

loss = train_step(x, y)
```

How one call runs (per *signature* of the arguments: tensor shapes, dtypes,
devices and ``requires_grad``, the values of the other arguments, grad mode):

```
no CUDA, or the cudaMallocAsync allocator ───────────► run as written, always (the allocator:
      with its reason, or `StepCaptureError` with ``on_unsupported="raise"``)
signature new, or its graph invalidated by a guard ──► WARM-UP (``warmup`` calls): run as written
      on a side stream; lazy init, compiles and optimizer state happen here; each is a real step
warmed up ─► CAPTURE into a private memory pool (executes nothing), record the guards, replay
      once: that is this call's step
captured, guards hold ─► REPLAY: copy tensor arguments into the static buffers, replay, copy
      back arguments the step mutates, return clones of the outputs
captured with an erase program whose ``release_lag`` or ``side_cuda_streams`` is ``"auto"``
      (the defaults) ─► TUNE: the replays after the first are timed; after a few, the graph is
      dropped and the next call captures the next candidate (not counted toward
      ``max_captures``), until the chosen one is in hand (`erase_fx.capture_tuning`); every
      call is still one real step; a candidate whose capture fails ends the tuning with what
      was measured
``max_captures`` reached, argument not capturable ─► UNCAPTURED (run as written; reason logged once)
capture failed (a host sync, a non-capturable optimizer) ─► restore the Python state the capture
      touched, then UNCAPTURED from then on (``on_unsupported="fallback"``) or raise
      `StepCaptureError` (``"raise"``)
```

Guards, checked before every replay (a failed one means warm-up, then a new
capture, counted toward ``max_captures``): what the graph reads or writes
that Python could change:

- the modules the step ran (found during the first warm-up with a forward
  pre-hook of torch's for every module) and the modules, optimizers, gradient scalers,
  tensors and plain values the step's code names (its globals, closure
  cells, ``self`` attributes, and those of the functions of its module it
  calls): each still the same object (a new optimizer, a swapped model, a
  changed global);
- every parameter, buffer and submodule of those modules, every parameter,
  state tensor and tensor hyperparameter of the optimizers that stepped
  (found with torch's global optimizer step pre-hook): the same tensor at
  the same address (``model.to``, ``load_state_dict(assign=True)``,
  ``p.data = ...``, a reassigned parameter all recapture;
  ``load_state_dict`` that copies in place needs nothing);
- ``module.training`` and ``p.requires_grad`` as at capture;
- the optimizers' non-tensor hyperparameters (a float ``lr`` that changes
  recaptures; a tensor ``lr``, ``lr=torch.tensor(0.1, device="cuda")`` with
  ``capturable=True``, changed with ``fill_``, does not);
- ``.grad``: a gradient the step itself replaced at capture (the usual
  ``zero_grad(set_to_none=True)`` at the top of the step, so the replay
  rewrites it without reading it) is put back if it was changed outside
  the step between calls (set to None, replaced): exact, because the step
  never reads the old value. A gradient the step accumulates into across
  calls (no zeroing inside the step) that is changed outside it means a
  recapture.

A capture is also refused (restore, then uncaptured with the reason) when
the step, during the capture itself, changes a hyperparameter in Python (an
LR scheduler inside the step would be frozen at one value), creates or
replaces optimizer state, reassigns a parameter or buffer (out-of-place
updates would read stale memory at replay), or assigns a name its code
reads (``self.steps += 1``: a replay would not count). Arguments that are
neither tensors nor plain values (an object holding tensors), and tensor
arguments that require grad, run uncaptured with the reason.

The guards cost Python time before each replay, about one identity check
per watched value: 53-77 us for two small models with 58 parameters and
Adam on the H200 machine's CPU (``bench/check_step.py``), while the GPU runs
the previous replay.

Dynamo and the module hook: Dynamo can guard on torch's global module hooks
(their number and keys: registering a new hook around each call recompiled
a compiled ``nn.Sequential`` at every call, on torch 2.13). The hook is
therefore installed once, from the first warm-up to the end of the first
capture attempt (of the tuning of the ``"auto"`` options, when the first
capture starts one), and then removed for good; later warm-ups find modules
through the step's code and the optimizers' parameters. A signature warmed
up while the hook was installed gets one more warm-up after it is gone, so
that a recompile this may cause never happens under capture; the first
uncaptured call after that (a fallback) may compile once more.

Limits: the native CUDA allocator only (under ``PYTORCH_CUDA_ALLOC_CONF=
backend:cudaMallocAsync`` a tensor made during capture and freed before the
first replay aborts the process, stock ``torch.compile`` too, so no step is
captured there); one CUDA device per step (the current one); Python side effects of
the step the guards do not see (logging, state kept in other objects,
branches on Python values read elsewhere) run once, at capture; outputs
that are not tensors are those of the capture; random
numbers come fresh at each replay from the default CUDA generator only;
gradients live in the graph's memory and each replay overwrites them (a
``.grad`` kept from an earlier step changes); not thread-safe. Stock
``torch.compile`` (default mode), ``backend="erase"`` (its own graphs step
aside, and it sets the ``"auto"`` options of its programs, through the
step's `erase_fx.emit.capture_scope.StepScope`) and eager models all work
inside.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import operator
import os
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from erase_fx.capture_tuning import KEEP, TIME_TOLERANCE, CaptureTuner, candidates_for, pool_bytes
from erase_fx.early_update import describe_refusals, open_session
from erase_fx.emit.capture_scope import CaptureChoice, StepScope
from erase_fx.emit.cudagraphs import ASYNC_ALLOCATOR_FIX, allocator_refusal, data_ptrs_equal
from erase_fx.errors import EraseOptionError, StepCaptureError

log = logging.getLogger(__name__)

#: Where a step's compiled graphs have no parameter an early update could move.
NONE_EARLY = ("early updates need graphs compiled with backend='erase' that have early blocks "
              "and parameters only those blocks read; none under DistributedDataParallel; "
              "erase_fx.explain says how many each graph has")

#: Allowed values of ``on_unsupported``.
ON_UNSUPPORTED = ("fallback", "raise")

NO_CUDA = "CUDA is not available: the step runs as written"

_MISSING = object()
_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_TRAINING = operator.attrgetter("training")
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.layout, torch.memory_format, enum.Enum)
_LEAF = (torch.Tensor,) + _PLAIN


def compile_step(
    fn: Callable[..., Any] | None = None,
    *,
    warmup: int = 2,
    max_captures: int = 8,
    on_unsupported: str = "fallback",
    early_optimizer: bool = False,
) -> Any:
    """Run a whole training step as one CUDA graph; ``@compile_step`` or ``compile_step(fn, ...)``.

    Args:
        fn: the step: any function doing one training step (zero_grad,
            forward with a model compiled by ``backend="erase"``, stock
            ``torch.compile`` or eager, ``backward``, ``optimizer.step()``)
            and returning any pytree of tensors and plain values.
        warmup: uncaptured calls before each capture (at least 1): they
            compile, initialise libraries and create optimizer state; each
            is one real training step.
        max_captures: captures at most (one per signature of the arguments,
            plus recaptures after a guard failed); beyond, calls run
            uncaptured with a logged reason. 0 never captures.
        on_unsupported: what to do when the step cannot be captured (a
            ``.item()`` or another host sync inside, Adam without
            ``capturable=True``): ``"fallback"`` logs the reason and runs
            the step as written from then on; ``"raise"`` raises
            `erase_fx.errors.StepCaptureError`.
        early_optimizer: in the captured graph, update the parameters of
            erase's early blocks on streams of their own as soon as their
            gradients are made, overlapping the rest of the forward and the
            backward, instead of after the backward (SGD, Adam, AdamW; the
            same values, bit for bit: checked against eager with aot_eager
            inside, and against the same step without it with Inductor
            inside, on an H200). Each parameter's conditions are checked
            (`erase_fx.early_update`); one that fails one is updated as
            usual. It asks one thing of the step that cannot be checked:
            between the model's forward and ``optimizer.step()`` nothing
            outside the compiled graphs reads those parameters.

    Without CUDA the step always runs as written. See `CompiledStep` and
    the module docstring for the state machine and the guards.
    """
    if fn is None:
        return functools.partial(compile_step, warmup=warmup, max_captures=max_captures,
                                 on_unsupported=on_unsupported, early_optimizer=early_optimizer)
    return CompiledStep(fn, warmup=warmup, max_captures=max_captures,
                        on_unsupported=on_unsupported, early_optimizer=early_optimizer)


class CompiledStep:
    """A training step replayed from a CUDA graph per argument signature (see `compile_step`).

    Calling it runs one training step and returns the step's outputs: fresh
    tensors (clones of the graph's outputs when replayed), safe to keep.
    Without CUDA it runs ``fn`` as written, always.

    Attributes:
        fn: the step as written.
        captures: successful captures so far (each counts toward ``max_captures``).
        replays: replays so far (the call that captures replays once too).
        warmups: warm-up calls so far.
        uncaptured_reason: why the last call ran as written outside a warm-up
            (``None`` when it replayed or warmed up).
        early_updated: with ``early_optimizer``, the parameters the last
            capture updates early, on the update streams.
        early_refused: with ``early_optimizer``, why the last capture did not
            update the other parameters of early blocks early, with how many.
        tuning_captures: captures made to time a candidate of the ``"auto"``
            options or to keep the chosen one (see `erase_fx.capture_tuning`);
            not counted in ``captures`` nor toward ``max_captures``.
        capture_tunings: per signature tuned, in order, its
            `erase_fx.capture_tuning.CaptureTuner` (``measured``: each
            candidate's times and pool size; ``chosen``).
    """

    def __init__(self, fn: Callable[..., Any], *, warmup: int = 2, max_captures: int = 8,
                 on_unsupported: str = "fallback", early_optimizer: bool = False):
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise EraseOptionError("warmup", warmup,
                                   "an int >= 1 (lazy state must be created before capture)")
        if not isinstance(max_captures, int) or isinstance(max_captures, bool) or max_captures < 0:
            raise EraseOptionError("max_captures", max_captures, "an int >= 0")
        if on_unsupported not in ON_UNSUPPORTED:
            raise EraseOptionError("on_unsupported", on_unsupported,
                                   " or ".join(repr(v) for v in ON_UNSUPPORTED)
                                   + " (the default is 'fallback')")
        if not isinstance(early_optimizer, bool):
            raise EraseOptionError("early_optimizer", early_optimizer,
                                   "True or False (the default is False)")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.warmup = warmup
        self.max_captures = max_captures
        self.on_unsupported = on_unsupported
        self.early_optimizer = early_optimizer
        self.early_updated = 0
        self.early_refused: dict[str, int] = {}
        self.captures = 0
        self.tuning_captures = 0
        self.capture_tunings: list[CaptureTuner] = []
        self.replays = 0
        self.warmups = 0
        self.uncaptured_reason: str | None = None
        self._entries: dict[Any, _Entry] = {}
        self._disabled: str | None = None
        self._allocator_refusal: Any = _MISSING
        self._logged: set[str] = set()
        self._known = _Known()
        self._module_hook: Any = None
        self._module_hook_done = False
        self._side: Any = None
        #: how the warm-ups and captures reach the compiled programs the step runs
        self._scope = StepScope()

    @property
    def tuning(self) -> bool:
        """Whether a signature's ``"auto"`` options are still being chosen (its next calls
        time a candidate or capture the choice; `erase_fx.capture_tuning`)."""
        return any(e.tuning_capture or (e.tuner is not None and not e.tuner.done)
                   for e in self._entries.values())

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return (f"CompiledStep({name}, captures={self.captures}, replays={self.replays}, "
                f"uncaptured_reason={self.uncaptured_reason!r})")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _cuda_available():
            return self._run_uncaptured(NO_CUDA, args, kwargs, level=logging.INFO)
        if self._disabled is not None:
            return self._run_uncaptured(self._disabled, args, kwargs)
        if self._allocator_refusal is _MISSING:
            # NB: once: the allocator is chosen for the process when CUDA starts
            self._allocator_refusal = allocator_refusal()
        if self._allocator_refusal is not None:
            return self._unsupported(self._allocator_refusal, ASYNC_ALLOCATOR_FIX, args, kwargs,
                                     None)
        leaves, spec = _flatten(args, kwargs)
        key, why = _signature(leaves, spec)
        if why is not None:
            return self._run_uncaptured(why, args, kwargs)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        if entry.reason is not None:
            return self._run_uncaptured(entry.reason, args, kwargs)
        if entry.graph is not None:
            why = entry.record.check()
            if why is None:
                return self._replay(entry, leaves)
            self._log_once(logging.WARNING, f"recapturing, after {self.warmup} warm-up calls",
                           why)
            entry.drop()
            if entry.tuner is not None:
                entry.tuner.forget_replays()
        if entry.warmups < self.warmup or entry.hooked != (self._module_hook is not None):
            # NB: a change of the module hook since the last warm-up changes Dynamo's guards:
            # one more warm-up compiles for it, so that the capture never compiles.
            if self.captures >= self.max_captures and not entry.tuning_capture:
                return self._over_bound(entry, args, kwargs)
            return self._warm_up(entry, args, kwargs, leaves)
        if self.captures >= self.max_captures and not entry.tuning_capture:
            return self._over_bound(entry, args, kwargs)
        return self._capture(entry, args, kwargs, leaves, spec)

    # -- the states ---------------------------------------------------------

    def _warm_up(self, entry: _Entry, args: tuple, kwargs: dict, leaves: list[Any]) -> Any:
        if self._module_hook is None and not self._module_hook_done:
            self._install_module_hook()
        tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        versions = [t._version for _, t in tensors]
        current = torch.cuda.current_stream()
        side = self._side_stream()
        side.wait_stream(current)
        try:
            with self._recording(), self._scope.entered(), torch.cuda.stream(side):
                out = self.fn(*args, **kwargs)
        finally:
            current.wait_stream(side)
            self._known.stepped = []
        entry.mutated.update(i for (i, t), v in zip(tensors, versions) if t._version != v)
        entry.warmups += 1
        entry.hooked = self._module_hook is not None
        self.warmups += 1
        self.uncaptured_reason = None
        return out

    def _capture(self, entry: _Entry, args: tuple, kwargs: dict, leaves: list[Any],
                 spec: Any) -> Any:
        self._known.scan(self.fn)
        before = _PythonState(self._known)
        why = _device_problem(leaves, before)
        if why is not None:
            self._end_module_discovery()
            entry.reason = why
            return self._run_uncaptured(why, args, kwargs)
        input_indices = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        static = list(leaves)
        for i in input_indices:
            static[i] = leaves[i].detach().clone()
        static_versions = [static[i]._version for i in input_indices]
        static_args, static_kwargs = _unflatten(static, spec)
        current = torch.cuda.current_stream()
        side = self._side_stream()
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        choice = entry.tuner.choice if entry.tuner is not None else CaptureChoice()
        tuning, entry.tuning_capture = entry.tuning_capture, False
        try:
            # NB: our own stream context outside the capture's: if capture_end raises,
            # torch.cuda.graph leaves its stream set; ours puts the caller's back.
            with self._recording(), self._scope.entered(), torch.cuda.stream(side):
                with self._early_updates() as session, self._scope.trying(choice) as met, \
                        torch.cuda.graph(graph, pool=pool, stream=side,
                                         capture_error_mode="thread_local"):
                    out = self.fn(*static_args, **static_kwargs)
        except Exception as error:  # noqa: BLE001 - every capture failure is reported below
            graph = None  # NB: dropped now: its destructor releases the generators' capture state
            self._known.stepped = []
            current.wait_stream(side)
            before.restore()
            self._end_module_discovery()
            reason, fix = _describe_failure(error)
            _clear_frames(error)
            if tuning and not entry.tuner.done:
                return self._tuning_capture_failed(entry, choice, reason, args, kwargs)
            return self._unsupported(reason, fix, args, kwargs, error)
        current.wait_stream(side)
        candidates = candidates_for(met) if entry.tuner is None else ()
        tuning_open = len(candidates) > 1 or (entry.tuner is not None and not entry.tuner.done)
        if not tuning_open:
            # NB: a tuning keeps the module hook to its end: removing it changes Dynamo's
            # guards, and the next candidate's capture would need a warm-up that recompiles
            self._end_module_discovery()
        problem = before.changed_by_capture(self._known)
        self._known.stepped = []
        rebound = [b for b in self._known.bindings if not b.holds()]
        if problem is None and rebound:
            problem = (f"the step assigns {rebound[0].key!r} (a global, closure variable or "
                       "attribute it reads) in Python: a replay would not",
                       "keep such state out of the step, or in a tensor updated in place")
        if problem is not None:
            self._end_module_discovery()
            graph = out = None
            before.restore()
            for binding in rebound:
                binding.restore()
            return self._unsupported(problem[0], problem[1], args, kwargs, None)
        entry.single = isinstance(out, torch.Tensor)
        out_leaves, out_spec = pytree.tree_flatten(out)
        del out
        entry.graph = graph
        entry.input_indices = input_indices
        entry.static_inputs = [static[i] for i in input_indices]
        entry.mutated.update(i for i, v in zip(input_indices, static_versions)
                             if static[i]._version != v)
        entry.copy_back = [(i, static[i]) for i in sorted(entry.mutated)]
        entry.outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves]
        entry.out_spec = out_spec
        entry.record = _Record(self._known, before)
        # NB: the state before the capture holds the last graph's .grad tensors: gone now,
        # so that a tuning's dropped graphs can give their pools back (_release_dropped_pools)
        del before
        self._note_early_updates(session)
        if len(candidates) > 1:
            entry.tuner = CaptureTuner(candidates)
            self.capture_tunings.append(entry.tuner)
        if tuning:
            self.tuning_captures += 1
            log.info("erase_fx compile_step %s: captured with %s", self._name,
                     choice.describe())
        else:
            self.captures += 1
            log.info("erase_fx compile_step %s: captured (%d of at most %d)", self._name,
                     self.captures, self.max_captures)
        if tuning_open:
            entry.tuner.captured(pool_bytes(pool))
        elif tuning:
            self._end_tuning()  # the choice captured again: the candidates' graphs are gone
        return self._replay(entry, leaves, copy_inputs=False)

    def _replay(self, entry: _Entry, leaves: list[Any], copy_inputs: bool = True) -> Any:
        if copy_inputs and entry.input_indices:
            torch._foreach_copy_(entry.static_inputs, [leaves[i] for i in entry.input_indices])
        tuner = entry.tuner
        if tuner is None or tuner.done:
            entry.graph.replay()
        else:
            tuner.replay(entry.graph)
        self.replays += 1
        for i, static in entry.copy_back:
            leaves[i].copy_(static)
        self.uncaptured_reason = None
        if entry.single:
            result = entry.outputs[0].clone()
        else:
            outputs = [o.clone() if isinstance(o, torch.Tensor) else o for o in entry.outputs]
            result = pytree.tree_unflatten(outputs, entry.out_spec)
        if tuner is not None and not tuner.done:
            self._after_timed_replay(entry, tuner)
        return result

    def _after_timed_replay(self, entry: _Entry, tuner: CaptureTuner) -> None:
        """Go on timing, or drop the graph so that the next call captures the next candidate."""
        verdict = tuner.next_capture()
        if tuner.done:
            log.info("erase_fx compile_step %s: %s chosen (least memory within %.0f%% of the "
                     "fastest): %s", self._name, tuner.chosen.describe(),
                     100 * TIME_TOLERANCE, "; ".join(m.describe() for m in tuner.measured))
        if verdict == KEEP:
            if tuner.done:
                self._end_tuning()
            return
        entry.drop(warm_up_again=False)
        entry.tuning_capture = True

    def _end_tuning(self) -> None:
        """The chosen graph is in hand: the module hook goes (`_end_module_discovery`), and so
        does the memory of the candidates' dropped graphs (`_release_dropped_pools`)."""
        self._end_module_discovery()
        _release_dropped_pools()

    def _tuning_capture_failed(self, entry: _Entry, choice: CaptureChoice, reason: str,
                               args: tuple, kwargs: dict) -> Any:
        """A candidate's capture raised: the tuning ends with what it measured, this call runs
        uncaptured, and the next one captures the choice (a failure then is the step's own)."""
        chosen = entry.tuner.capture_failed()
        log.warning("erase_fx compile_step %s: capturing with %s failed (%s); the tuning keeps "
                    "%s", self._name, choice.describe(), reason, chosen.describe())
        entry.tuning_capture = True
        self.uncaptured_reason = reason
        return self.fn(*args, **kwargs)

    def _over_bound(self, entry: _Entry, args: tuple, kwargs: dict) -> Any:
        self._end_module_discovery()
        entry.reason = (f"max_captures={self.max_captures} reached (one capture per signature of "
                        "the arguments, and one per recapture): this signature runs as written; "
                        "keep shapes and Python arguments fixed, use a tensor lr, or raise "
                        "max_captures")
        return self._run_uncaptured(entry.reason, args, kwargs)

    def _unsupported(self, reason: str, fix: str, args: tuple, kwargs: dict,
                     error: BaseException | None) -> Any:
        if self.on_unsupported == "raise":
            raise StepCaptureError("compile_step", reason, fix=fix) from error
        self._disabled = f"{reason}. Fix: {fix}"
        return self._run_uncaptured(self._disabled, args, kwargs)

    def _run_uncaptured(self, reason: str, args: tuple, kwargs: dict,
                        level: int = logging.WARNING) -> Any:
        self._log_once(level, "running uncaptured", reason)
        self.uncaptured_reason = reason
        return self.fn(*args, **kwargs)

    # -- helpers ------------------------------------------------------------

    @property
    def _name(self) -> str:
        return getattr(self.fn, "__qualname__", type(self.fn).__name__)

    def _log_once(self, level: int, what: str, reason: str) -> None:
        """Log ``what: reason`` the first time this reason comes up for this step."""
        if reason in self._logged:
            return
        self._logged.add(reason)
        log.log(level, "erase_fx compile_step %s: %s: %s", self._name, what, reason)

    def _side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream()
        return self._side

    @contextmanager
    def _early_updates(self) -> Iterator[Any]:
        """With ``early_optimizer``, an `erase_fx.early_update.UpdateSession` around the capture."""
        if not self.early_optimizer:
            yield None
            return
        with open_session(self._scope, self._known.live(self._known.optimizers),
                          own_hooks=[self._known.on_optimizer_step]) as session:
            yield session

    def _note_early_updates(self, session: Any) -> None:
        """What the capture's `UpdateSession` did (it keeps its counts once closed)."""
        if session is None:
            return
        self.early_updated, self.early_refused = session.updated, dict(session.refused)
        reasons = describe_refusals(self.early_refused)
        if not self.early_updated and not reasons:
            reasons = ("no compiled graph of the step has a parameter to update early "
                       f"({NONE_EARLY})")
        level = logging.INFO if self.early_updated else logging.WARNING
        log.log(level, "erase_fx compile_step %s: %d parameters updated early%s", self._name,
                self.early_updated, f"; not early: {reasons}" if reasons else "")

    @contextmanager
    def _recording(self) -> Iterator[None]:
        """Record the optimizers that step (and, while installed, the modules that run)."""
        handle = register_optimizer_step_pre_hook(self._known.on_optimizer_step)
        self._known.active = True
        self._known.stepped = []
        try:
            with warnings.catch_warnings():
                # NB: torch warns that a global hook also fires for the OptimizedModule
                # of torch.compile(module): that is what finds it.
                warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` "
                                        r"when there are global hooks")
                yield
        finally:
            self._known.active = False
            handle.remove()

    def _install_module_hook(self) -> None:
        self._module_hook = register_module_forward_pre_hook(self._known.on_module)
        weakref.finalize(self, self._module_hook.remove)

    def _end_module_discovery(self) -> None:
        """The module hook goes for good after the first capture attempt (see the module doc)."""
        if self._module_hook is not None:
            self._module_hook.remove()
            self._module_hook = None
        self._module_hook_done = True


@dataclasses.dataclass(eq=False)
class _Entry:
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
    record: _Record | None = None
    #: with programs built with ``"auto"`` options: their tuning (`erase_fx.capture_tuning`)
    tuner: CaptureTuner | None = None
    #: the next capture is one of the tuning's (not counted toward ``max_captures``)
    tuning_capture: bool = False

    def drop(self, warm_up_again: bool = True) -> None:
        """Forget the graph (its memory goes once nothing holds its tensors) and, unless only
        the capture's choice changes (a tuning), warm up again."""
        self.graph = None
        self.record = None
        self.static_inputs = []
        self.copy_back = []
        self.outputs = []
        if warm_up_again:
            self.warmups = 0
            self.tuning_capture = False


def _release_dropped_pools() -> None:
    """Once a tuning has chosen, give the caching allocator's free memory back to the driver:
    the pools of the candidates' dropped graphs (once, when the tuning ends). A pool's segment
    goes back only once every block in it is free: call it when nothing references a tensor
    of those graphs (their ``.grad`` tensors included)."""
    torch.cuda.empty_cache()


# -- signature ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Flat:
    """The spec of positional arguments that are all tensors or plain values (no pytree)."""

    count: int


def _flatten(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """The arguments' leaves and structure; plain positional arguments skip pytree (it is slow)."""
    if not kwargs and all(isinstance(a, _LEAF) for a in args):
        return list(args), _Flat(len(args))
    return pytree.tree_flatten((args, kwargs))


def _unflatten(leaves: list[Any], spec: Any) -> tuple[tuple, dict]:
    if isinstance(spec, _Flat):
        return tuple(leaves), {}
    return pytree.tree_unflatten(leaves, spec)


def _signature(leaves: list[Any], spec: Any) -> tuple[Any, str | None]:
    """The key of one capture, or the reason these arguments cannot be captured."""
    parts: list[Any] = [torch.is_grad_enabled()]
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                return None, (f"tensor argument {i} requires grad: a replay would write its .grad "
                              "on a static copy; pass it with requires_grad=False and compute "
                              "gradients of inputs inside the step")
            parts.append((torch.Tensor, tuple(leaf.shape), leaf.dtype, leaf.device))
        elif isinstance(leaf, _PLAIN):
            parts.append((type(leaf), leaf))
        else:
            return None, (f"argument {i} of type {type(leaf).__name__} is neither a tensor nor a "
                          "plain value (tensors inside it would be read at their capture-time "
                          "address): pass its tensors, or register the type as a pytree node "
                          "(torch.utils._pytree.register_pytree_node)")
    try:
        hash(spec)
        parts.append(spec)
    except TypeError:
        parts.append(repr(spec))
    return tuple(parts), None


def _cuda_available() -> bool:
    """Whether CUDA can be used (a seam the CPU tests replace)."""
    return torch.cuda.is_available()


def _on_cuda(tensor: torch.Tensor) -> bool:
    """Whether a tensor lives on a CUDA device (a seam the CPU tests replace)."""
    return tensor.is_cuda


def _device_problem(leaves: list[Any], state: _PythonState) -> str | None:
    """Why the step cannot be captured on the current CUDA device, if it cannot."""
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)] + state.tensors()
    cuda = [t for t in tensors if _on_cuda(t)]
    if not cuda:
        return ("no tensor of the step (arguments, parameters, buffers, optimizer state) is on "
                "CUDA: it runs as written")
    devices = {t.device for t in cuda if t.device.type == "cuda"}
    if devices and devices != {torch.device("cuda", torch.cuda.current_device())}:
        names = ", ".join(sorted(str(d) for d in devices))
        return (f"the step's tensors are on {names} but the current device is "
                f"cuda:{torch.cuda.current_device()}: one device per step; call "
                "torch.cuda.set_device(...) before the step")
    return None


# -- what the step uses ---------------------------------------------------------


class _Known:
    """The modules, optimizers and scalers a step was seen to use (held weakly), and its names."""

    def __init__(self) -> None:
        self.active = False
        self.modules: dict[int, weakref.ref] = {}
        self.optimizers: dict[int, weakref.ref] = {}
        self.scalers: dict[int, weakref.ref] = {}
        self.bindings: list[_Binding] = []
        # NB: held strongly during one call: an optimizer made inside the step dies with it
        self.stepped: list[torch.optim.Optimizer] = []

    def on_module(self, module: torch.nn.Module, args: Any) -> None:
        """Global forward pre-hook: remember a module that ran in the step."""
        # NB: under Dynamo the hook is traced: do nothing there, or Dynamo guards on what
        # it touched; the OptimizedModule of torch.compile(module) runs it in Python.
        if torch.compiler.is_compiling() or not self.active:
            return None
        _remember(self.modules, module)
        return None

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step pre-hook: remember an optimizer that stepped in the step."""
        if self.active:
            _remember(self.optimizers, optimizer)
            if all(o is not optimizer for o in self.stepped):
                self.stepped.append(optimizer)
        return None

    def scan(self, fn: Callable[..., Any]) -> None:
        """Find what the step's code names directly; those names become guards."""
        self.bindings = _bindings_of(fn)
        for binding in self.bindings:
            value = binding.value
            if isinstance(value, torch.nn.Module):
                _remember(self.modules, value)
            elif isinstance(value, torch.optim.Optimizer):
                _remember(self.optimizers, value)
            elif isinstance(value, torch.amp.GradScaler):
                _remember(self.scalers, value)

    def live(self, kind: dict[int, weakref.ref]) -> list[Any]:
        return [obj for obj in (ref() for ref in kind.values()) if obj is not None]

    def all_modules(self) -> list[torch.nn.Module]:
        """Every module known, with all its submodules, once each, in a stable order."""
        seen: dict[int, torch.nn.Module] = {}
        for top in self.live(self.modules):
            for module in top.modules():
                seen.setdefault(id(module), module)
        return list(seen.values())


def _remember(kind: dict[int, weakref.ref], obj: Any) -> None:
    ref = kind.get(id(obj))
    if ref is None or ref() is not obj:
        kind[id(obj)] = weakref.ref(obj)


@dataclasses.dataclass(eq=False)
class _Binding:
    """A name the step's code reads: a global, a closure cell or an attribute of ``self``."""

    container: Any  # a dict (module globals, an object's __dict__) or a closure cell
    key: str
    value: Any
    plain: bool  # a plain value, compared by equality (else the same object)

    def current(self) -> Any:
        if isinstance(self.container, dict):
            return self.container.get(self.key, _MISSING)
        try:
            return self.container.cell_contents
        except ValueError:
            return _MISSING

    def holds(self) -> bool:
        now = self.current()
        return now is self.value or (self.plain and type(now) is type(self.value)
                                     and now == self.value)

    def restore(self) -> None:
        """Put the capture-time value back (the step assigned it during a refused capture)."""
        if isinstance(self.container, dict):
            self.container[self.key] = self.value
        else:
            self.container.cell_contents = self.value

    def describe(self) -> str:
        now = self.current()
        if self.plain:
            return (f"{self.key!r}, which the step reads, changed from {self.value!r} to "
                    f"{now!r} (Python values are frozen into the graph)")
        return f"{self.key!r}, which the step reads, now names another {type(now).__name__}"


def _guarded(value: Any) -> bool | None:
    """True: compare by equality; False: by identity; None: not a guard."""
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler,
                          torch.Tensor)):
        return False
    if isinstance(value, _PLAIN) and not isinstance(value, type):
        return True
    return None


def _names_in(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_in(const)
    return names


def _bindings_of(fn: Callable[..., Any]) -> list[_Binding]:
    """The guarded names the step's code reads: its globals, closure cells, ``self`` attributes.

    Functions of the step's own module that it calls are followed (two levels), so a
    helper's globals count too; torch's and other libraries' functions are not.
    """
    bindings: list[_Binding] = []
    seen: set[int] = set()
    home = getattr(_unwrap(fn), "__module__", None)

    def add(container: Any, key: str, value: Any) -> None:
        plain = _guarded(value)
        if plain is not None:
            bindings.append(_Binding(container, key, value, plain))

    def visit(f: Any, depth: int) -> None:
        if id(f) in seen or depth > 2:
            return
        seen.add(id(f))
        if isinstance(f, functools.partial):
            visit(f.func, depth)
            return
        if isinstance(f, types.MethodType):
            code = getattr(f.__func__, "__code__", None)
            names = _names_in(code) if code is not None else set()
            owner = f.__self__
            spaces = [getattr(owner, "__dict__", None)]
            if isinstance(owner, torch.nn.Module):  # self.model of a step that is a module's
                spaces += [owner._modules, owner._parameters, owner._buffers]
            for attrs in spaces:
                if isinstance(attrs, dict):
                    for name in sorted(names & attrs.keys()):
                        add(attrs, name, attrs[name])
            for name in sorted(names):  # the owner's own methods it calls: self.helper()
                method = getattr(type(owner), name, None)
                if isinstance(method, types.FunctionType) and method.__module__ == home:
                    visit(getattr(owner, name), depth + 1)
            visit(f.__func__, depth)
            return
        wrapped = getattr(f, "__wrapped__", None)
        if wrapped is not None:
            visit(wrapped, depth)
        code = getattr(f, "__code__", None)
        if code is None:
            return
        for name, cell in zip(code.co_freevars, getattr(f, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            add(cell, name, value)
            if isinstance(value, types.FunctionType) and value.__module__ == home:
                visit(value, depth + 1)
        module_globals = getattr(f, "__globals__", {})
        for name in sorted(_names_in(code)):
            if name not in module_globals:
                continue
            value = module_globals[name]
            add(module_globals, name, value)
            if isinstance(value, types.FunctionType) and value.__module__ == home:
                visit(value, depth + 1)

    visit(fn, 0)
    return bindings


def _unwrap(fn: Any) -> Any:
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__
        else:
            return fn


# -- Python state around a capture ----------------------------------------------


def _parameters_of(modules: list[torch.nn.Module],
                   optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        for p in module._parameters.values():
            if p is not None:
                seen.setdefault(id(p), p)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
    return list(seen.values())


def _same(a: Any, b: Any) -> bool:
    """Equal hyperparameters: tensors by identity, tuples item by item, the rest by ``==``."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(_same, a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an odd value: treat it as changed
        return False


class _PythonState:
    """The Python-visible references a capture may touch, taken just before it.

    A capture executes no kernel, but it runs the step's Python: ``zero_grad``
    sets ``.grad`` to None and the backward points it at graph memory, an
    optimizer may add state, a GradScaler marks its optimizers unscaled. After
    a failed capture `restore` puts the references back, so the uncaptured
    call that follows starts from the state before the capture;
    `changed_by_capture` finds the changes a replay could not reproduce.
    """

    def __init__(self, known: _Known):
        self.modules = known.all_modules()
        self.optimizers = known.live(known.optimizers)
        self.scalers = known.live(known.scalers)
        self.params = _parameters_of(self.modules, self.optimizers)
        self.grads = [p.grad for p in self.params]
        self.module_dicts = [(d, dict(d)) for m in self.modules
                             for d in (m._parameters, m._buffers, m._modules)]
        self.opt_states = [(o.state, {p: (s, dict(s)) for p, s in o.state.items()})
                           for o in self.optimizers]
        self.groups = [(o.param_groups, list(o.param_groups),
                        [(g, dict(g)) for g in o.param_groups]) for o in self.optimizers]
        self.scaler_states = []
        for scaler in self.scalers:
            states = getattr(scaler, "_per_optimizer_states", None)
            if isinstance(states, dict):
                self.scaler_states.append(
                    (scaler, states, {k: dict(v) for k, v in states.items()}))

    def tensors(self) -> list[torch.Tensor]:
        """Parameters, buffers and optimizer state tensors (to find the step's device)."""
        out = list(self.params)
        out += [b for m in self.modules for b in m._buffers.values() if b is not None]
        for _, saved in self.opt_states:
            out += [v for _, content in saved.values() for v in content.values()
                    if isinstance(v, torch.Tensor)]
        return out

    def restore(self) -> None:
        """Put back every reference taken here (a failed or refused capture)."""
        for p, grad in zip(self.params, self.grads):
            if p.grad is not grad:
                p.grad = grad
        for d, saved in self.module_dicts:
            if not _same_dict(d, saved):
                d.clear()
                d.update(saved)
        for state, saved in self.opt_states:
            for p in [p for p in state if p not in saved]:
                del state[p]
            for p, (entry, content) in saved.items():
                if state.get(p) is not entry:
                    state[p] = entry
                if not _same_dict(entry, content):
                    entry.clear()
                    entry.update(content)
        for groups, saved_list, saved in self.groups:
            if len(groups) != len(saved_list) or not all(map(operator.is_, groups, saved_list)):
                groups[:] = saved_list
            for group, content in saved:
                if not _same_dict(group, content):
                    group.clear()
                    group.update(content)
        for scaler, states, saved in self.scaler_states:
            scaler._per_optimizer_states = states
            states.clear()
            states.update({k: dict(v) for k, v in saved.items()})

    def changed_by_capture(self, known: _Known) -> tuple[str, str] | None:
        """(what, fix) for a change the capture made that replays would not repeat, if any."""
        old = {id(o) for o in self.optimizers}
        for o in known.stepped:
            if id(o) not in old and o.state:
                return (f"{type(o).__name__} first stepped during the capture, creating its "
                        "state there (an optimizer made inside the step?): a replay would reset "
                        "it", "create the optimizer outside the step, and let warm-up create "
                        "its state")
        for o, (groups, saved_list, saved) in zip(self.optimizers, self.groups):
            if len(groups) != len(saved_list):
                return (f"the step adds param groups to {type(o).__name__}",
                        "add them outside the step")
            for i, (group, content) in enumerate(saved):
                for key in sorted(set(group) | set(content), key=str):
                    if key != "params" and not _same(group.get(key, _MISSING),
                                                      content.get(key, _MISSING)):
                        return (f"the step changes {type(o).__name__}.param_groups[{i}]"
                                f"[{key!r}] in Python (an LR scheduler inside the step?): a "
                                "replay would keep the capture's value",
                                "change hyperparameters outside the step (a float lr then "
                                "recaptures; a tensor lr with capturable=True, changed with "
                                "fill_(), does not)")
        for o, (state, saved) in zip(self.optimizers, self.opt_states):
            for p, entry in state.items():
                old = saved.get(p)
                if old is None or entry is not old[0] or not _same_dict(entry, old[1]):
                    return (f"{type(o).__name__} created or replaced its state during the "
                            "capture (an optimizer made inside the step, or an out-of-place "
                            "state update): a replay would reset it",
                            "create the optimizer outside the step, and let warm-up create its "
                            "state")
        for d, saved in self.module_dicts:
            for key, value in d.items():
                if saved.get(key, _MISSING) is not value and value is not None:
                    return (f"the step reassigns {key!r} of a module (an out-of-place update of a "
                            "parameter or buffer): a replay would read its old memory",
                            f"update {key!r} in place (copy_, mul_, add_)")
        return None


def _same_dict(d: dict, saved: dict) -> bool:
    return len(d) == len(saved) and all(d.get(k, _MISSING) is v for k, v in saved.items())


class _Record:
    """What a captured graph reads or writes that Python could change, and its cheap check.

    Taken right after the capture. `check` returns None when a replay is
    exact (after putting back gradients the step replaces itself), else why
    not, for the log. The common case costs one identity comparison per
    value of each watched dict (a module's parameters, buffers and
    submodules, an optimizer's param groups and state) and per parameter's
    ``.grad``, and one C++ pass over the data pointers.
    """

    def __init__(self, known: _Known, before: _PythonState):
        modules = known.all_modules()
        optimizers = known.live(known.optimizers)
        roots = _roots(known.live(known.modules))
        self.refs = [weakref.ref(x) for x in roots + optimizers + known.live(known.scalers)]
        self.bindings = list(known.bindings)
        # NB: [dict, its values, its keys, label]; the values are refreshed when a value was
        # replaced by an equal one (a float lr set again), so the fast path stays fast.
        self.dicts: list[list[Any]] = []
        self.lists: list[tuple[list, tuple, str]] = []
        names = _module_names(roots)
        for m in modules:
            name = names.get(id(m), type(m).__name__)
            for kind, d in (("parameters", m._parameters), ("buffers", m._buffers),
                            ("submodules", m._modules)):
                if d:
                    self._watch(d, f"{kind} of {name}")
        for o in optimizers:
            oname = type(o).__name__
            self.lists.append((o.param_groups, tuple(o.param_groups), f"{oname}.param_groups"))
            for i, group in enumerate(o.param_groups):
                self.lists.append((group["params"], tuple(group["params"]),
                                   f"{oname}.param_groups[{i}]['params']"))
                self._watch(group, f"{oname}.param_groups[{i}]")
            self._watch(o.state, f"{oname}.state")
            for j, p in enumerate(_parameters_of([], [o])):
                state = o.state.get(p)
                if state:
                    self._watch(state, f"{oname} state of parameter {j}")
        seen: dict[int, tuple[torch.Tensor, str]] = {}
        for d, values, keys, label in self.dicts:
            for key, value in zip(keys, values):
                if isinstance(value, torch.Tensor):
                    seen.setdefault(id(value), (value, f"{label}[{_key_text(key)}]"))
        self.tensors = [t for t, _ in seen.values()]
        self.tensor_labels = [label for _, label in seen.values()]
        self.ptrs = [t.data_ptr() for t in self.tensors]
        self.ptr_indices = list(range(len(self.tensors)))
        self._flatten_dicts()
        self.modules = modules
        self.training = tuple(map(_TRAINING, modules))
        self.params = _parameters_of(modules, optimizers)
        self.requires_grad = tuple(map(_REQUIRES_GRAD, self.params))
        self.grads = tuple(map(_GRAD, self.params))
        grad_before = {id(p): g for p, g in zip(before.params, before.grads)}
        # NB: a grad the step replaced during the capture (zero_grad(set_to_none=True), then
        # backward) is rewritten by every replay without being read: it can be put back.
        self.replaced = [id(p) in grad_before and grad_before[id(p)] is not g
                         for p, g in zip(self.params, self.grads)]

    def _watch(self, d: dict, label: str) -> None:
        self.dicts.append([d, tuple(d.values()), tuple(d.keys()), label])

    def _flatten_dicts(self) -> None:
        # NB: one pass in C over every watched value (itertools, map) instead of a Python loop
        self.dict_objects = [w[0] for w in self.dicts]
        self.dict_lengths = tuple(map(len, self.dict_objects))
        self.dict_values = tuple(chain.from_iterable(w[1] for w in self.dicts))

    def check(self) -> str | None:
        """None when the graph may replay (gradients the step replaces are put back), else why."""
        for ref in self.refs:
            if ref() is None:
                return "a module, optimizer or scaler the step used was deleted"
        for binding in self.bindings:
            if not binding.holds():
                return binding.describe()
        if tuple(map(len, self.dict_objects)) != self.dict_lengths or not all(map(
                operator.is_, chain.from_iterable(map(dict.values, self.dict_objects)),
                self.dict_values)):
            for watched in self.dicts:
                why = _compare(watched)
                if why is not None:
                    return why
            self._flatten_dicts()
        for lst, items, label in self.lists:
            if len(lst) != len(items) or not all(map(operator.is_, lst, items)):
                return f"{label} changed"
        if not data_ptrs_equal(self.tensors, self.ptrs, self.ptr_indices):
            for t, ptr, label in zip(self.tensors, self.ptrs, self.tensor_labels):
                if t.data_ptr() != ptr:
                    return (f"{label} moved to other memory (model.to, load_state_dict with "
                            "assign=True, p.data = ...)")
        if tuple(map(_TRAINING, self.modules)) != self.training:
            return "a module switched between train() and eval()"
        if tuple(map(_REQUIRES_GRAD, self.params)) != self.requires_grad:
            return "a parameter's requires_grad changed"
        grads = tuple(map(_GRAD, self.params))
        if not all(map(operator.is_, grads, self.grads)):
            for now, want, replaced in zip(grads, self.grads, self.replaced):
                if now is not want and not replaced:
                    return ("the .grad of a parameter the step accumulates into (no zero_grad "
                            "inside the step) was changed outside the step")
            for p, now, want in zip(self.params, grads, self.grads):
                if now is not want:
                    p.grad = want
        return None


def _compare(watched: list[Any]) -> str | None:
    """Why a watched dict's change breaks the graph, or None (and refresh) if it does not."""
    d, values, keys, label = watched
    if len(d) == len(values) and all(map(operator.is_, d.values(), values)):
        return None
    if len(d) != len(keys) or any(k not in d for k in keys):
        return f"{label} gained or lost an entry"
    for key, old in zip(keys, values):
        new = d[key]
        if new is old:
            continue
        if not isinstance(old, _PLAIN + (tuple,)) or not isinstance(new, _PLAIN + (tuple,)):
            return f"{label}[{_key_text(key)}] was replaced"
        if not _same(new, old):
            hint = ""
            if "param_groups" in label:
                hint = ("; Python numbers are frozen into the graph: a tensor lr "
                        "(lr=torch.tensor(...) on the device with capturable=True, changed "
                        "with fill_()) changes without a recapture")
            return f"{label}[{_key_text(key)}] changed from {old!r} to {new!r}{hint}"
    watched[1], watched[2] = tuple(d.values()), tuple(d.keys())
    return None


def _key_text(key: Any) -> str:
    return "a parameter" if isinstance(key, torch.Tensor) else repr(key)


def _roots(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules that are no other one's submodule."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def _module_names(modules: list[torch.nn.Module]) -> dict[int, str]:
    """Readable names for guard messages: each module's path under the first module holding it."""
    names: dict[int, str] = {}
    for top in modules:
        if id(top) in names:
            continue
        prefix = type(top).__name__
        for name, module in top.named_modules():
            names.setdefault(id(module), f"{prefix}.{name}" if name else prefix)
    return names


# -- capture failures -------------------------------------------------------------

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


def _describe_failure(error: BaseException) -> tuple[str, str]:
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
    skip = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        filename = frame.filename
        if (filename.startswith(skip) or filename.startswith("<") or "contextlib" in filename
                or frame.name in ("__torch_dispatch__", "__torch_function__")):
            continue
        code = f" `{frame.line.strip()}`" if frame.line else ""
        return f" at {os.path.basename(filename)}:{frame.lineno}{code}"
    return ""


def _clear_frames(error: BaseException) -> None:
    """Drop the locals of the failed capture's frames (they hold the graph and its memory)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
