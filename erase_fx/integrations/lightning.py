"""Whole-step capture under Lightning's ``Trainer``: `compile_manual_step`.

Why: `erase_fx.compile_step` captures a training step (forward, backward,
optimizer) in one CUDA graph, and a replay runs none of the step's Python.
Lightning's automatic optimization owns the step, so the step is written
with manual optimization; but even then Lightning does Python work inside
it that a replay skips:

- ``opt.step()`` of a ``LightningOptimizer`` counts the step in Python
  (``_on_before_step`` and ``_on_after_step``, lightning/pytorch/core/optimizer.py:146,156,
  set by the manual loop in lightning/pytorch/loops/optimization/manual.py:101-103,131-137):
  ``trainer.global_step`` is that count (loops/training_epoch_loop.py:117). Replayed, it
  stops at the capture's step, and ``Trainer(max_steps=N)`` never stops (Lightning 2.6).
- ``self.manual_backward`` and ``opt.step()`` call the ``on_before_backward``,
  ``on_after_backward`` and ``on_before_optimizer_step`` hooks of the module and the
  callbacks (plugins/precision/precision.py:49-50,80-81,87-88): replayed, they would have run
  once, at the capture.

`compile_manual_step` wraps a LightningModule method doing one step with
`compile_step` and makes the Trainer see every step: it counts the
``LightningOptimizer.step`` calls outside the graph and gives each replay its
count, and it runs the step as written (exact, with the reason) where one of
those hooks is overridden, where ``precision="16-mixed"``'s GradScaler would
sync with the host (plugins/precision/amp.py:88,95-96), or on more than one
device (strategies/ddp.py:323 prepares DDP's reducer in Python)::

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = Net()

        def forward(self, x, y):
            return self.net(x, y)         # the loss

        @compile_manual_step
        def step(self, x, y):
            opt = self.optimizers()
            opt.zero_grad(set_to_none=True)
            loss = self(x, y)
            self.manual_backward(loss)
            opt.step()
            return loss.detach()

        def training_step(self, batch, batch_idx):
            return self.step(*batch)   # batch_idx stays out: each value would be a capture

    trainer.fit(torch.compile(Model(), backend="erase"), loader)

Given a compiled module, Lightning compiles ``forward`` and ``training_step``
(lightning/pytorch/utilities/compile.py:57-58); the step's machinery runs outside
Dynamo (``torch._dynamo.disable``), ``forward`` compiled. Lightning is imported
when a step first runs, not by ``import erase_fx``.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from erase_fx.step import arguments as step_arguments
from erase_fx.errors import EraseError, StepCaptureError
from erase_fx.step import CompiledStep
from erase_fx.step.compiled import check_options

log = logging.getLogger(__name__)

#: Hooks Lightning calls inside ``manual_backward`` and ``LightningOptimizer.step``: a
#: replay would skip them.
HOOKS_IN_STEP = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")


def compile_manual_step(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Capture a LightningModule's step method in one CUDA graph; ``@compile_manual_step``.

    Args:
        fn: a method of a ``LightningModule`` with ``automatic_optimization =
            False`` doing one training step with Lightning's own calls
            (``self.optimizers()``, ``opt.zero_grad(set_to_none=True)``,
            ``self.manual_backward(loss)``, ``opt.step()``) and returning
            tensors. Call it from ``training_step`` with tensors (and fixed
            Python values), not ``batch_idx``.
        options: `erase_fx.compile_step`'s (``warmup``, ``max_captures``,
            ``on_unsupported``, ``early_optimizer``).

    Each module instance gets its own `ManualStep` at first access.
    """
    if fn is None:
        return functools.partial(compile_manual_step, **options)
    check_options(**options)  # NB: now, at class definition
    return _PerModule(fn, options)


class _PerModule:
    """The decorated method: a `ManualStep` per module, made at first access and kept in the
    module's ``__dict__`` (which attribute lookup reads before this non-data descriptor)."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options
        self.name = fn.__name__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    # NB: Lightning compiles training_step when given a compiled module; Dynamo must not trace
    # the step's machinery (compile_step runs the step's Python itself): it runs eagerly
    @torch._dynamo.disable
    def __get__(self, module: Any, owner: type | None = None) -> Any:
        if module is None:
            return self
        step = ManualStep(module, self.fn.__get__(module, owner), **self.options)
        module.__dict__[self.name] = step
        return step


class ManualStep:
    """One LightningModule's captured step: `erase_fx.CompiledStep` plus Lightning's bookkeeping.

    Attributes:
        compiled: the `erase_fx.CompiledStep` (``captures``, ``replays``, ``warmups``).
        uncaptured_reason: why the last call ran as written outside a warm-up
            (a hook Lightning would call inside the step, GradScaler, several
            devices, or compile_step's own reason); None when it replayed.
        optimizer_steps: ``LightningOptimizer.step`` calls the captured step makes,
            counted for Lightning at each replay.
    """

    def __init__(self, module: Any, fn: Callable[..., Any], **options: Any):
        self.module = module
        self.compiled = CompiledStep(fn, **options)
        self._options = options
        self.optimizer_steps = 0
        self._refusal: str | None = None
        self._checked = False
        self._counts = {"ran": 0, "captured": 0}

    @property
    def uncaptured_reason(self) -> str | None:
        return self._refusal or self.compiled.uncaptured_reason

    def __repr__(self) -> str:
        return f"ManualStep({self.compiled!r})"

    def __deepcopy__(self, memo: dict) -> ManualStep:
        # NB: a copy of the module (an SWA or EMA callback's) gets a step of its own
        module = memo.get(id(self.module), self.module)
        return ManualStep(module, self.compiled.fn.__func__.__get__(module), **self._options)

    @torch._dynamo.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.module.trainer
        if not self._checked:
            self._check(trainer)
        if self._refusal is not None:
            return self.compiled.fn(*args, **kwargs)
        optimizers = list(trainer.strategy._lightning_optimizers)
        counted = [(o, o._on_before_step, o._on_after_step) for o in optimizers]
        self._counts.update(ran=0, captured=0)
        for o in optimizers:
            # NB: the step's Python counts here, outside the graph: the loop's own counters
            # run once per step below, replayed or not
            o._on_before_step = self._count
            o._on_after_step = _nothing
        replays = self.compiled.replays
        try:
            out = self.compiled(*args, **kwargs)
        finally:
            for o, before, after in counted:
                o._on_before_step, o._on_after_step = before, after
        steps = self._counts["ran"]
        if self.compiled.replays != replays:
            if self._counts["captured"]:  # this call captured: its count holds for replays
                self.optimizer_steps = self._counts["captured"]
            steps += self.optimizer_steps
        if counted:
            _, before, after = counted[0]
            for _ in range(steps):
                before()
                after()
        return out

    def _count(self) -> None:
        # NB: a failed capture's partial run is not counted: the step then runs as written
        capturing = step_arguments.cuda_available() and torch.cuda.is_current_stream_capturing()
        self._counts["captured" if capturing else "ran"] += 1

    def _check(self, trainer: Any) -> None:
        """Refuse, once, a step whose replays would skip what Lightning runs inside it."""
        import lightning.pytorch as pl
        from lightning.pytorch.strategies import SingleDeviceStrategy
        from lightning.pytorch.utilities.model_helpers import is_overridden

        self._checked = True
        module = self.module
        if module.automatic_optimization:
            raise EraseError("compile_manual_step", f"{type(module).__name__} uses automatic "
                             "optimization: Lightning would run its own step around this one",
                             fix="set self.automatic_optimization = False in __init__")
        hooks = [f"{type(module).__name__}.{h}" for h in HOOKS_IN_STEP
                 if is_overridden(h, module, pl.LightningModule)]
        hooks += [f"{type(c).__name__}.{h}" for c in trainer.callbacks for h in HOOKS_IN_STEP
                  if is_overridden(h, c, pl.Callback)]
        if hooks:
            self._refuse(f"{', '.join(hooks)} would run only when the step is captured "
                         "(Lightning calls it inside manual_backward or opt.step)",
                         "move it to on_train_batch_end, or read the values it needs from "
                         "tensors the step returns")
        elif getattr(trainer.precision_plugin, "scaler", None) is not None:
            self._refuse("precision='16-mixed' steps through a GradScaler, whose inf check "
                         "syncs with the host (lightning/pytorch/plugins/precision/amp.py)",
                         "use precision='bf16-mixed' (no scaler) or 32")
        elif not isinstance(trainer.strategy, SingleDeviceStrategy):
            self._refuse(f"the {type(trainer.strategy).__name__} strategy: one device only "
                         "(DDP's reducer is prepared in Python at each manual_backward)",
                         "train on one device, or use the drop-in backend='erase' alone")

    def _refuse(self, reason: str, fix: str) -> None:
        if self.compiled.on_unsupported == "raise":
            raise StepCaptureError("compile_manual_step", reason, fix=fix)
        self._refusal = f"{reason}. Fix: {fix}"
        log.warning("erase_fx compile_manual_step %s: running uncaptured: %s",
                    getattr(self.compiled.fn, "__qualname__", "step"), self._refusal)


def _nothing() -> None:
    return None
