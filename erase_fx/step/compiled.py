"""`compile_step` and `CompiledStep`: the state machine of one call, per argument signature.

How one call runs is drawn in `erase_fx.step`'s docstring. This module
decides, at each call, which state the call's signature is in (uncaptured,
warm-up, capture, replay) and keeps the counts users read; running the step
and capturing it is `erase_fx.step.capture`'s, the guards
`erase_fx.step.guards`', the tuning of the ``"auto"`` options
`erase_fx.step.tuning`'s.
"""
from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from erase_fx.early_update import describe_refusals
from erase_fx.emit.cudagraphs import ASYNC_ALLOCATOR_FIX, allocator_refusal
from erase_fx.errors import EraseOptionError, StepCaptureError
from erase_fx.step import arguments
from erase_fx.step.capture import Capturer, Entry, clear_frames, describe_failure
from erase_fx.step.guards import Guards, PythonState
from erase_fx.step.tuning import StepTuning
from erase_fx.step.uses import MISSING, StepUses

log = logging.getLogger(__name__)

#: Where a step's compiled graphs have no parameter an early update could move.
NONE_EARLY = ("early updates need graphs compiled with backend='erase' that have early blocks "
              "and parameters only those blocks read; none under DistributedDataParallel; "
              "erase_fx.explain says how many each graph has")

#: Allowed values of ``on_unsupported``.
ON_UNSUPPORTED = ("fallback", "raise")

NO_CUDA = "CUDA is not available: the step runs as written"


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
            same values, bit for bit, as the step without it). Each
            parameter's conditions are checked (`erase_fx.early_update`);
            one that fails one is updated as usual. It asks one thing of the
            step that cannot be checked: between the model's forward and
            ``optimizer.step()`` nothing outside the compiled graphs reads
            those parameters.

    Without CUDA the step always runs as written. See `CompiledStep` and
    `erase_fx.step` for the state machine and the guards.
    """
    if fn is None:
        return functools.partial(compile_step, warmup=warmup, max_captures=max_captures,
                                 on_unsupported=on_unsupported, early_optimizer=early_optimizer)
    return CompiledStep(fn, warmup=warmup, max_captures=max_captures,
                        on_unsupported=on_unsupported, early_optimizer=early_optimizer)


def check_options(**options: Any) -> None:
    """Raise for bad ``options`` as ``CompiledStep(fn, **options)`` would (`EraseOptionError`;
    an unknown name: ``TypeError``), without making a step: the constructor's signature is the
    one place the options and their defaults are listed."""
    bound = inspect.signature(CompiledStep.__init__).bind(None, None, **options)
    bound.apply_defaults()
    _check_options(**{name: value for name, value in bound.arguments.items()
                      if name not in ("self", "fn")})


def _check_options(warmup: Any, max_captures: Any, on_unsupported: Any,
                   early_optimizer: Any) -> None:
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
        _check_options(warmup, max_captures, on_unsupported, early_optimizer)
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.warmup = warmup
        self.max_captures = max_captures
        self.on_unsupported = on_unsupported
        self.early_optimizer = early_optimizer
        self.early_updated = 0
        self.early_refused: dict[str, int] = {}
        self.captures = 0
        self.replays = 0
        self.warmups = 0
        self.uncaptured_reason: str | None = None
        self._entries: dict[Any, Entry] = {}
        self._disabled: str | None = None
        self._allocator_refusal: Any = MISSING
        self._logged: set[str] = set()
        self._uses = StepUses()
        self._capturer = Capturer(fn, self._uses, early_optimizer)
        self._tuning = StepTuning(lambda: self._name, self._uses.end_module_discovery)

    @property
    def tuning(self) -> bool:
        """Whether a signature's ``"auto"`` options are still being chosen (its next calls
        time a candidate or capture the choice; `erase_fx.capture_tuning`)."""
        return self._tuning.under_way(self._entries.values())

    @property
    def tuning_captures(self) -> int:
        return self._tuning.captures

    @property
    def capture_tunings(self) -> list[Any]:
        return self._tuning.tuners

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return (f"CompiledStep({name}, captures={self.captures}, replays={self.replays}, "
                f"uncaptured_reason={self.uncaptured_reason!r})")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not arguments.cuda_available():
            return self._run_uncaptured(NO_CUDA, args, kwargs, level=logging.INFO)
        if self._disabled is not None:
            return self._run_uncaptured(self._disabled, args, kwargs)
        if self._allocator_refusal is MISSING:
            # NB: once: the allocator is chosen for the process when CUDA starts
            self._allocator_refusal = allocator_refusal()
        if self._allocator_refusal is not None:
            return self._unsupported(self._allocator_refusal, ASYNC_ALLOCATOR_FIX, args, kwargs,
                                     None)
        leaves, spec = arguments.flatten(args, kwargs)
        key, why = arguments.signature(leaves, spec)
        if why is not None:
            return self._run_uncaptured(why, args, kwargs)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = Entry()
        if entry.reason is not None:
            return self._run_uncaptured(entry.reason, args, kwargs)
        if entry.graph is not None:
            why = entry.guards.check()
            if why is None:
                return self._replay(entry, leaves)
            self._log_once(logging.WARNING, f"recapturing, after {self.warmup} warm-up calls",
                           why)
            entry.drop()
            if entry.tuner is not None:
                entry.tuner.forget_replays()
        if entry.warmups < self.warmup or entry.hooked != self._uses.module_hook_installed:
            # NB: a change of the module hook since the last warm-up changes Dynamo's guards:
            # one more warm-up compiles for it, so that the capture never compiles.
            if self.captures >= self.max_captures and not entry.tuning_capture:
                return self._over_bound(entry, args, kwargs)
            return self._warm_up(entry, args, kwargs, leaves)
        if self.captures >= self.max_captures and not entry.tuning_capture:
            return self._over_bound(entry, args, kwargs)
        return self._capture(entry, args, kwargs, leaves, spec)

    # -- the states ---------------------------------------------------------

    def _warm_up(self, entry: Entry, args: tuple, kwargs: dict, leaves: list[Any]) -> Any:
        self._uses.install_module_hook(self)
        out, mutated = self._capturer.warm_up(args, kwargs, leaves,
                                              self._tuning.choice_for(entry))
        entry.mutated.update(mutated)
        entry.warmups += 1
        entry.hooked = self._uses.module_hook_installed
        self.warmups += 1
        self.uncaptured_reason = None
        return out

    def _capture(self, entry: Entry, args: tuple, kwargs: dict, leaves: list[Any],
                 spec: Any) -> Any:
        self._uses.scan(self.fn)
        before = PythonState(self._uses)
        why = arguments.device_problem(leaves, before)
        if why is not None:
            self._uses.end_module_discovery()
            entry.reason = why
            return self._run_uncaptured(why, args, kwargs)
        choice = self._tuning.choice_for(entry)
        tuning, entry.tuning_capture = entry.tuning_capture, False
        try:
            captured = self._capturer.capture(leaves, spec, choice)
        except Exception as error:  # noqa: BLE001 - every capture failure is reported below
            before.restore()
            self._uses.end_module_discovery()
            reason, fix = describe_failure(error)
            clear_frames(error)
            if tuning and not entry.tuner.done:
                self._tuning.capture_failed(entry, choice, reason)
                self.uncaptured_reason = reason
                return self.fn(*args, **kwargs)
            return self._unsupported(reason, fix, args, kwargs, error)
        candidates = self._tuning.candidates(entry, captured.met)
        is_open = self._tuning.is_open(entry, candidates)
        if not is_open:
            # NB: a tuning keeps the module hook to its end: removing it changes Dynamo's
            # guards, and the next candidate's capture would need a warm-up that recompiles
            self._uses.end_module_discovery()
        problem, rebound = self._replay_would_differ(before)
        if problem is not None:
            self._uses.end_module_discovery()
            captured = None
            before.restore()
            for binding in rebound:
                binding.restore()
            return self._unsupported(problem[0], problem[1], args, kwargs, None)
        entry.keep(captured, Guards(self._uses, before))
        session, pool = captured.session, captured.pool
        # NB: the state before the capture holds the last graph's .grad tensors: gone now,
        # so that a tuning's dropped graphs can give their pools back (StepTuning.end)
        del before, captured
        self._note_early_updates(session)
        self._tuning.start(entry, candidates)
        if not tuning:
            self.captures += 1
            log.info("erase_fx compile_step %s: captured (%d of at most %d)", self._name,
                     self.captures, self.max_captures)
        self._tuning.captured(entry, choice, pool, is_open, tuning)
        return self._replay(entry, leaves, copy_inputs=False)

    def _replay_would_differ(self, before: PythonState) -> tuple[tuple[str, str] | None, list]:
        """(what, fix) for a change the capture made in Python that a replay would not
        make, or None; and the names the step's code reads that it assigned."""
        problem = before.changed_by_capture(self._uses)
        self._uses.stepped = []
        rebound = [b for b in self._uses.bindings if not b.holds()]
        if problem is None and rebound:
            problem = (f"the step assigns {rebound[0].key!r} (a global, closure variable or "
                       "attribute it reads) in Python: a replay would not",
                       "keep such state out of the step, or in a tensor updated in place")
        return problem, rebound

    def _replay(self, entry: Entry, leaves: list[Any], copy_inputs: bool = True) -> Any:
        if copy_inputs and entry.input_indices:
            torch._foreach_copy_(entry.static_inputs, [leaves[i] for i in entry.input_indices])
        self._tuning.replay(entry)
        self.replays += 1
        for i, static in entry.copy_back:
            leaves[i].copy_(static)
        self.uncaptured_reason = None
        if entry.single:
            result = entry.outputs[0].clone()
        else:
            outputs = [o.clone() if isinstance(o, torch.Tensor) else o for o in entry.outputs]
            result = pytree.tree_unflatten(outputs, entry.out_spec)
        self._tuning.after_replay(entry)
        return result

    def _over_bound(self, entry: Entry, args: tuple, kwargs: dict) -> Any:
        self._uses.end_module_discovery()
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
