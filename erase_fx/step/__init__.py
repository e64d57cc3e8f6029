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
      was measured; with ``Tuning.stock_candidate``, the stock compilation of erase's graphs
      is the last candidate, and WARM-UP comes again before its capture (its code never ran),
      with its choice set
``max_captures`` reached, argument not capturable ─► UNCAPTURED (run as written; reason logged once)
capture failed (a host sync, a non-capturable optimizer) ─► restore the Python state the capture
      touched, then UNCAPTURED from then on (``on_unsupported="fallback"``) or raise
      `StepCaptureError` (``"raise"``)
```

Guards, checked before every replay (a failed one means warm-up, then a new
capture, counted toward ``max_captures``): what the graph reads or writes
that Python could change:

- the modules the step ran (found during the first warm-up with a forward
  pre-hook of torch's for every module) and the modules, optimizers,
  gradient scalers, tensors and plain values the step's code names (its
  globals, closure cells, ``self`` attributes, and those of the functions of
  its module it calls): each still the same object (a new optimizer, a
  swapped model, a changed global);
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

Dynamo and the module hook: Dynamo can guard on torch's module hooks
(their number and keys: registering a new hook around each call recompiled
a compiled ``nn.Sequential`` at every call, on torch 2.13). The hook is
therefore installed once, from the first warm-up to the end of the first
capture attempt (of the tuning of the ``"auto"`` options, when the first
capture starts one), and then removed for good; later warm-ups find modules
through the step's code and the optimizers' parameters. A signature warmed
up while the hook was installed gets one more warm-up after it is gone, so
that a recompile this may cause never happens under capture; the first
uncaptured call after that (a fallback) may compile once more.

The package, by concern:

- `erase_fx.step.compiled`: `compile_step` and `CompiledStep`, the state
  machine above, per signature;
- `erase_fx.step.arguments`: a call's signature and leaves, and whether the
  step can be captured on this device;
- `erase_fx.step.uses`: what the step uses (the hooks, the names its code
  reads);
- `erase_fx.step.guards`: the Python state around a capture, and the guards
  checked before every replay;
- `erase_fx.step.capture`: running the step off the caller's stream (a
  warm-up, a capture) in its `erase_fx.emit.capture_scope.StepScope`, and why
  a capture failed;
- `erase_fx.step.tuning`: the tuning of the ``"auto"`` options across
  captures (`erase_fx.capture_tuning` has its rules).

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

from erase_fx.step.compiled import NO_CUDA, CompiledStep, compile_step

__all__ = ["NO_CUDA", "CompiledStep", "compile_step"]
