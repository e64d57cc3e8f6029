"""Data parallel: blocks kept whole under DDP, and early gradients all-reduced during the forward.

For a model wrapped in ``DistributedDataParallel`` and compiled with
``backend="erase"`` (``torch.compile(DDP(model), backend="erase")``, or
``DDP(torch.compile(model, backend="erase"))``), with torch's defaults:

**Blocks stay whole.** With ``torch._dynamo.config.optimize_ddp`` on (the
default), Dynamo hands every graph captured inside a DDP module's forward to
its DDP optimizer (``torch/_dynamo/backends/distributed.py``,
``DDPOptimizer.compile_fn``), which splits it at DDP's bucket boundaries and
calls the backend once per piece; a block and its local loss land in
different pieces and nothing runs early. The split exists so that DDP's
all-reduce of one bucket overlaps the backward of the pieces before it; an
early block's gradients are all-reduced during the forward instead (below),
so for erase's graphs the split costs the schedule and buys little. Dynamo
decides to split from global state only (the config flag and
``DistributedDataParallel._get_active_ddp_module()``, read in
``convert_frame.CatchErrorsWrapper.__call__`` in torch 2.11 and 2.13), with no
per-backend switch, and ``torch.compile`` wraps the backend so that a
``backend_ctx_ctor`` on it is lost. So erase_fx wraps
``DDPOptimizer.compile_fn`` once (`keep_blocks_whole_under_ddp`, applied by
`keeps_blocks_whole` where erase's backend is defined, before Dynamo can meet a
DDP module, and not at that meeting: see there): when the optimizer's backend
is erase's (`is_erase_backend`), the whole graph goes to erase's backend, as
the optimizer itself does when a graph fills one bucket;
if that graph turns out to have no early block (the analysis of its joint
graph finds none, before any code is generated), or erase fails on it,
erase's backend raises `NoEarlyBlocks` and the optimizer splits it as usual
(erase then compiles each piece), so such a graph compiles exactly as with
the stock backend, at the cost of one extra trace. Every other
backend's graphs, in the same process, go through the optimizer untouched;
no config is changed. ``tests/test_ddp_torch_internals.py`` pins what this
relies on.

**Early all-reduce** (``EraseConfig.early_allreduce``, on by default). An
early block's gradients are final once its early backward has run, in the
middle of the forward. `EarlyAllReduce` hooks each block's completion in the
`StreamProgram` (`StreamProgram.add_completion_hooks`): there, on a
communication stream (`StreamOps.run_comm`; on CPU in program order), the
block's gradients are multiplied by ``1 / world_size`` into one flat buffer
per dtype (as DDP's reducer does when it copies a gradient into its bucket),
the buffer is all-reduced (sum), and the result is copied back into the
gradients, which are saved tensors of the forward. The backward waits for the
communication stream and hands them to autograd scaled by ``T / seed`` as
before: all-reduce is linear, so that equals DDP's average of the scaled
gradients (bitwise when ``T == seed``, as for ``loss.backward()``; within
rounding otherwise).

DDP's reducer must not reduce them again. erase_fx registers a DDP
communication hook (`early_aware_allreduce`, DDP's documented
``register_comm_hook``) that reduces each bucket as DDP's default does
(multiply by ``1 / world_size``, all-reduce sum) except the parameters whose
``.grad`` this step is exactly an early-reduced gradient: those are already
final. Exactly, because a parameter's gradient may have other terms than the
early block's (the parameter also used outside the graph, or in another
graph), and ``.grad`` may hold a value already: a hook on the parameter's
AccumulateGrad node checks that the gradient autograd accumulates is the
very tensor the backward handed out (any other term makes autograd sum into
a new tensor) and that ``.grad`` is None (zeroed with ``set_to_none=True``,
torch's default); if not, the bucket
reduces it like any other (reducing an already averaged term again leaves it
unchanged, up to rounding), and a parameter found with another term is left
to DDP from then on. Which gradients qualify is decided per graph at compile
time, and the check's outcome depends on the program, not on the data: every
rank issues the same collectives.

DDP semantics kept:

- ``no_sync()``: a forward with ``require_backward_grad_sync`` off reduces
  nothing early; gradients accumulate locally and the next synced step
  lets DDP reduce everything (early gradients included), as DDP does.
- ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``,
  ``bucket_cap_mb``: DDP's reducer runs as it does, with the hook above.
- Not supported, falling back to DDP's reduction with a logged reason
  (`EraseDistributedError` under ``on_error="raise"``): a DDP module that
  already has a communication hook (erase_fx's is needed; register yours
  before the first forward to get this fallback, or pass
  ``early_allreduce=False``), DDP's ``mixed_precision``, the python reducer
  (``optimize_ddp="python_reducer"``), and forwards under CUDA graph capture
  or a ``Join`` context (uneven inputs): those steps reduce through DDP.
  erase's own CUDA graphs are off for a graph that reduces early (a
  collective in a replayed graph and the per-step Python bookkeeping here
  cannot agree), with a logged reason.
- Every rank must run the same compiled graphs in a step, as DDP's
  ``static_graph`` assumes: a rank that compiled a different graph (a
  data-dependent branch) would issue different early collectives.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from erase_fx.early_grads import EarlyGrad, hook_each_block, plan_early_grads
from erase_fx.emit.scale_grads import is_dense
from erase_fx.errors import EraseDistributedError
from erase_fx.passes.graph import copy_graph_module

log = logging.getLogger(__name__)

WHERE = "ddp"
#: The attribute that marks erase's backend callables (`keeps_blocks_whole`).
BACKEND_MARK = "_erase_fx_backend"


# -- blocks kept whole: Dynamo's DDP optimizer ----------------------------------


class NoEarlyBlocks(Exception):  # noqa: N818 - a signal, not an error
    """Raised by erase's backend for a whole DDP graph with no early block.

    Only under `whole_ddp_graph`: Dynamo's DDP optimizer then splits the graph
    at bucket boundaries, as for any backend. Not an `EraseError`: nothing
    failed, and it never reaches the user.
    """


_WHOLE_DDP_GRAPH: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "erase_fx_whole_ddp_graph", default=False)


def whole_ddp_graph() -> bool:
    """Whether the graph being compiled is a whole DDP graph kept from the DDP optimizer."""
    return _WHOLE_DDP_GRAPH.get()


@contextlib.contextmanager
def _compiling_whole_ddp_graph() -> Iterator[None]:
    token = _WHOLE_DDP_GRAPH.set(True)
    try:
        yield
    finally:
        _WHOLE_DDP_GRAPH.reset(token)


def keeps_blocks_whole(fn: Any) -> Any:
    """Decorator of erase's backend: marks ``fn`` (`is_erase_backend`) and makes Dynamo's DDP
    optimizer hand it whole graphs (`keep_blocks_whole_under_ddp`, once per process).

    NB: applied where the backend is defined, so the wrapper is in place once the backend can
    be handed to ``torch.compile``: by name (Dynamo's registry imports the entry point's
    module), through `erase_fx.make_backend`, or as the function. It cannot wait until DDP is
    met: for a frame run inside a DDP module's forward, Dynamo binds
    ``DDPOptimizer.compile_fn`` and the optimizer splits the graph before any backend runs, so
    installed at the first graph erase compiles under DDP, that graph (the model's forward,
    which Dynamo then caches) would stay split, its blocks lost. Pinned by
    ``tests/test_ddp_torch_internals.py`` (in a fresh process).
    """
    setattr(fn, BACKEND_MARK, True)
    keep_blocks_whole_under_ddp()
    return fn


#: Where torch's wrappers keep the callable they wrap (see `is_erase_backend`).
_WRAPPED_ATTRS = ("_torchdynamo_orig_backend", "compiler_fn", "__wrapped__", "func")


def is_erase_backend(fn: Any) -> bool:
    """Whether ``fn`` is erase's backend, through the wrappers torch puts around it.

    NB: Dynamo hands the DDP optimizer ``WrapBackendDebug`` (which copies the
    wrapped callable's ``__dict__`` and keeps it as ``_torchdynamo_orig_backend``)
    around ``torch.compile``'s ``_TorchCompileWrapper`` (``compiler_fn``); a
    ``functools.partial`` (`erase_fx.make_backend`) keeps it as ``func``.
    """
    stack, seen = [fn], 0
    while stack and seen < 16:
        current = stack.pop()
        seen += 1
        if current is None:
            continue
        if getattr(current, BACKEND_MARK, False) is True:
            return True
        stack.extend(getattr(current, attr, None) for attr in _WRAPPED_ATTRS)
    return False


def keep_blocks_whole_under_ddp() -> bool:
    """Make Dynamo's DDP optimizer hand erase's backend whole graphs (once per process).

    Returns whether the DDP optimizer is there to wrap (not on builds without
    torch.distributed).

    NB: torch internals, on purpose (see the module docstring): Dynamo has no
    per-backend way to opt out of its DDP optimizer, and flipping the global
    ``optimize_ddp`` would change every other model. The wrapper changes
    nothing for other backends. Pinned by ``tests/test_ddp_torch_internals.py``.
    """
    if not torch.distributed.is_available():
        return False
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
    except ImportError:  # pragma: no cover - torch.distributed without Dynamo's DDP support
        return False
    original = DDPOptimizer.compile_fn
    if getattr(original, "_erase_fx_original", None) is not None:
        return True

    @functools.wraps(original)
    def compile_fn(self: Any, gm: fx.GraphModule, example_inputs: Any, **configs: Any) -> Any:
        if not is_erase_backend(getattr(self, "backend_compile_fn", None)):
            return original(self, gm, example_inputs, **configs)
        # NB: stock compilers may change the graph they are given; the split
        # below must see it as Dynamo made it.
        whole = copy_graph_module(gm)
        try:
            with _compiling_whole_ddp_graph():
                return self.backend_compile_fn(whole, example_inputs, **configs)
        except NoEarlyBlocks:
            log.info("erase_fx: a DDP graph with no early block: Dynamo's DDP optimizer splits "
                     "it at bucket boundaries, as for the stock backend")
        return original(self, gm, example_inputs, **configs)

    compile_fn._erase_fx_original = original  # type: ignore[attr-defined]
    DDPOptimizer.compile_fn = compile_fn
    return True


def active_ddp_module() -> Any:
    """The DDP module whose forward is running (and being compiled), or None.

    NB: ``DistributedDataParallel._get_active_ddp_module`` is the hook DDP
    keeps for Dynamo ("TorchDynamo requires DDP's status and module for
    cooperative optimization"); set while ``DDP.forward`` runs the wrapped
    module, in torch 2.11 and 2.13.
    """
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module()


# -- early all-reduce: the per-DDP-module state and DDP's communication hook ----


def _data_ptr(value: Any) -> int | None:
    return value.data_ptr() if isinstance(value, torch.Tensor) else None


class DDPState:
    """What erase_fx tracks of one DDP module across its compiled graphs and steps.

    Attributes:
        group: DDP's process group; ``scale``: ``1 / world_size``, DDP's factor.
        param_ids: ``id`` of every parameter DDP reduces.
        mixed: parameters whose gradient turned out to have another term than
            the early one (read by another graph too, or outside the compiled
            graphs): no longer reduced early.
        reduced: ``data_ptr`` of each saved gradient reduced early and not yet
            handed out by its backward, to the ``id`` of its parameter.
        handed: per parameter ``id``, the gradient the backward handed to autograd.
        confirmed: parameters whose ``.grad`` this step is exactly an early-reduced
            gradient (checked as autograd accumulates it: the handed tensor, no other
            term, and no ``.grad`` before it): DDP's hook skips them.
        accumulating: a ``no_sync()`` forward ran since the last synced backward:
            gradients hold local terms, so DDP reduces everything at the synced step.
        unsupported: why early all-reduce is off for this module (None: it is on).
        stats: counters for tests and benchmarks (``early_collectives``,
            ``early_grads``, ``hook_collectives``, ``hook_skipped``, ``hook_reduced``).
    """

    def __init__(self, ddp: Any):
        import torch.distributed as dist

        self.ddp_ref = weakref.ref(ddp)
        self.group = ddp.process_group
        self.world_size = dist.get_world_size(self.group)
        self.scale = 1.0 / self.world_size
        self.param_ids = {id(p) for p in ddp.parameters()
                          if p.requires_grad and not getattr(p, "_ddp_ignored", False)}
        self.mixed: set[int] = set()
        self.reduced: dict[int, int] = {}
        self.handed: dict[int, torch.Tensor] = {}
        self.confirmed: set[int] = set()
        self.accumulating = False
        self.unsupported: str | None = None
        self.stats: collections.Counter[str] = collections.Counter()
        self._hooked: dict[int, Any] = {}
        self._noted: set[str] = set()

    # -- per forward

    def wants_early(self) -> bool:
        """Whether this forward all-reduces its early gradients (read once per forward)."""
        ddp = self.ddp_ref()
        if ddp is None or self.unsupported is not None:
            return False
        if not ddp.require_backward_grad_sync:
            self.accumulating = True
            return False
        if self.accumulating:
            return False
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self._note("capture", "a forward under CUDA graph capture reduces its early "
                       "gradients through DDP at .backward(), not early")
            return False
        join = getattr(ddp, "_join_config", None)
        if join is not None and getattr(join, "enable", False):
            self._note("join", "a forward in a Join context (uneven inputs) reduces its early "
                       "gradients through DDP at .backward(), not early")
            return False
        return True

    def eligible(self, param: Any) -> bool:
        key = id(param)
        return key in self.param_ids and key not in self.mixed

    def watch(self, param: torch.Tensor) -> None:
        """Check, each time autograd accumulates ``param``'s gradient, that it is the handed one.

        NB: a pre-hook on the parameter's AccumulateGrad node, which DDP's
        reducer keeps alive (its own hooks are post-hooks there). Autograd
        sums several gradient terms into a new tensor (it cannot reuse a
        term's memory while ``handed`` holds it), so the tensor is the handed
        one exactly when there is no other term. The hook drops ``handed``'s
        reference, so AccumulateGrad may still adopt the tensor as ``.grad``.
        """
        key = id(param)
        if key in self._hooked:
            return
        node = torch.autograd.graph.get_gradient_edge(param).node
        state_ref, param_ref = weakref.ref(self), weakref.ref(param)

        def check_gradient(grad_outputs: Sequence[Any]) -> None:
            state, param = state_ref(), param_ref()
            if state is None or param is None:
                return
            handed = state.handed.pop(key, None)
            state.confirmed.discard(key)
            if handed is None:
                return
            if len(grad_outputs) != 1 or grad_outputs[0] is not handed:
                state.mixed.add(key)
                state._note(f"mixed {key}", "a parameter reduced early also has a gradient term "
                            "from outside its block (another graph, or eager code): DDP reduces "
                            "it from now on")
            elif param.grad is not None:
                # NB: .grad already holds something (zero_grad(set_to_none=False), or a
                # gradient from a backward DDP did not see): DDP reduces the sum, as it would.
                state._note("grad kept", "a gradient reduced early is added to a .grad that is "
                            "not None: DDP reduces it again at .backward() (zero the gradients "
                            "with set_to_none=True, the default, to save that)")
            else:
                state.confirmed.add(key)

        self._hooked[key] = (node, node.register_prehook(check_gradient))

    def end_step(self) -> None:
        """After a synced backward's last bucket: the next step starts clean."""
        self.confirmed.clear()
        self.handed.clear()
        self.reduced.clear()
        self.accumulating = False

    def _note(self, key: str, message: str, level: int = logging.INFO) -> None:
        """Log ``message`` once per module and ``key``."""
        if key not in self._noted:
            self._noted.add(key)
            log.log(level, "erase_fx: %s", message)


# NB: no annotations on ``bucket`` and the result: DDP compares them with
# dist.GradBucket and Future[Tensor], and this module's annotations are strings.
def early_aware_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's communication hook: DDP's default reduction, minus the gradients already reduced early.

    DDP's default (no hook) multiplies each gradient by ``1 / world_size``
    as it copies it into the bucket and all-reduces the bucket (sum); with a
    hook the bucket holds the gradients as they are, so this hook multiplies
    first: the same values, bitwise. The parameters in ``state.confirmed``
    hold their final value: their part of the bucket is left as it is.
    """
    import torch.distributed as dist

    buffer = bucket.buffer()
    skip = [id(p) in state.confirmed for p in bucket.parameters()]
    spans = _spans_to_reduce(bucket, buffer, skip) if any(skip) else [(0, buffer.numel())]
    if bucket.is_last():
        state.end_step()
    if spans is None:  # a bucket layout this hook does not know: reduce all of it
        spans = [(0, buffer.numel())]
    else:
        state.stats["hook_skipped"] += sum(skip)
    if not spans:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done
    state.stats["hook_collectives"] += 1
    state.stats["hook_reduced"] += sum(stop - start for start, stop in spans)
    if len(spans) == 1:
        start, stop = spans[0]
        part = buffer[start:stop].mul_(state.scale)
        work = dist.all_reduce(part, group=state.group, async_op=True)
        return work.get_future().then(lambda _: buffer)
    packed = torch.cat([buffer[start:stop] for start, stop in spans]).mul_(state.scale)
    work = dist.all_reduce(packed, group=state.group, async_op=True)

    def unpack(_: Any) -> torch.Tensor:
        offset = 0
        for start, stop in spans:
            buffer[start:stop].copy_(packed[offset: offset + stop - start])
            offset += stop - start
        return buffer

    return work.get_future().then(unpack)


def _spans_to_reduce(bucket: Any, buffer: torch.Tensor,
                     skip: Sequence[bool]) -> list[tuple[int, int]] | None:
    """The ``[start, stop)`` element ranges of ``buffer`` holding gradients not skipped (merged)."""
    base = buffer.untyped_storage().data_ptr()
    spans: list[tuple[int, int]] = []
    for grad, skipped in zip(bucket.gradients(), skip):
        if grad.untyped_storage().data_ptr() != base:
            return None
        if skipped:
            continue
        start = grad.storage_offset() - buffer.storage_offset()
        stop = start + grad.numel()
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], stop)
        else:
            spans.append((start, stop))
    return spans


_states: weakref.WeakKeyDictionary[Any, DDPState] = weakref.WeakKeyDictionary()


def state_of(ddp: Any) -> DDPState | None:
    """erase_fx's state for a DDP module (None if no erase graph reduces early under it)."""
    return _states.get(ddp)


def ddp_state(ddp: Any) -> DDPState:
    """The module's `DDPState`, registering erase_fx's communication hook the first time."""
    state = _states.get(ddp)
    if state is not None:
        return state
    state = DDPState(ddp)
    state.unsupported = _unsupported(ddp)
    if state.unsupported is None:
        try:
            ddp.register_comm_hook(state, early_aware_allreduce)
        except (RuntimeError, ValueError, TypeError) as error:
            hooks = getattr(ddp, "_comm_hooks", None)
            if hooks and hooks[-1][0] is early_aware_allreduce:
                hooks.pop()
            state.unsupported = f"DDP refused erase_fx's communication hook ({error})"
    _states[ddp] = state
    return state


def _unsupported(ddp: Any) -> str | None:
    """Why early all-reduce cannot run under this DDP module, or None."""
    if getattr(ddp, "_use_python_reducer", False):
        return "DDP runs its python reducer (optimize_ddp='python_reducer')"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "DDP's mixed_precision reduces in another dtype"
    if getattr(ddp, "_delay_all_reduce_all_params", False):
        return "DDP delays the all-reduce of every parameter"
    if getattr(ddp, "_comm_hooks", None) or _has_builtin_comm_hook(ddp):
        return ("the DDP module already has a communication hook, and early all-reduce needs "
                "its own")
    return None


def _has_builtin_comm_hook(ddp: Any) -> bool:
    """Whether DDP's logging data names a communication hook (a built-in one is not in
    ``_comm_hooks``); best effort, the registration itself is checked too."""
    try:
        data = ddp._get_ddp_logging_data()
    except Exception:  # noqa: BLE001 - logging data is best effort
        return False
    return isinstance(data, dict) and bool(data.get("comm_hook"))


# -- early all-reduce: one compiled graph -----------------------------------------


@dataclasses.dataclass
class _Call:
    """One forward's decision: whether it reduces early, and each early gradient's parameter."""

    early: bool
    params: list[Any]


class EarlyAllReduce:
    """Early all-reduce for one compiled graph under a DDP module.

    `attach` hooks a `StreamProgram` (one hook per block, after the step that
    completes its gradients); `wrap_backward` wraps the compiled backward so it
    waits for the communication stream and tells the state what it handed out.
    """

    def __init__(self, state: DDPState, graph_id: int, grads: Sequence[EarlyGrad]):
        self.state = state
        self.graph_id = graph_id
        self.grads = tuple(grads)
        self.streams: Any = None

    @property
    def attached(self) -> bool:
        return self.streams is not None

    def attach(self, program: Any) -> None:
        hook_each_block(program, self.grads, self._begin, self._reduce_block)
        self.streams = program.streams

    def _begin(self, inputs: Sequence[Any]) -> _Call:
        return _Call(self.state.wants_early(), [inputs[g.param] for g in self.grads])

    def _reduce_block(self, members: tuple[int, ...], call: _Call, values: list[Any],
                      after: tuple[int, ...], streams: Any) -> None:
        state = self.state
        chosen: list[tuple[torch.Tensor, Any]] = []
        for i, value in zip(members, values):
            if (call.early and isinstance(value, torch.Tensor) and value.is_floating_point()
                    and is_dense(value) and state.eligible(call.params[i])):
                chosen.append((value, call.params[i]))
            else:
                state.reduced.pop(_data_ptr(value), None)
        if not chosen:
            return
        tensors = [t for t, _ in chosen]
        streams.run_comm(after, tensors, functools.partial(_all_reduce_flat, tensors, state))
        for tensor, param in chosen:
            state.watch(param)
            state.reduced[tensor.data_ptr()] = id(param)
        state.stats["early_grads"] += len(chosen)

    def wrap_backward(self, compiled: Any) -> Any:
        if not self.attached:
            return compiled
        return _HandingBackward(compiled, self)


def _all_reduce_flat(tensors: Sequence[torch.Tensor], state: DDPState) -> None:
    """``t = all_reduce_sum(t / world_size)`` for each tensor; one flat buffer per dtype, device."""
    import torch.distributed as dist

    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for (dtype, device), members in groups.items():
        flat = torch.empty(sum(t.numel() for t in members), dtype=dtype, device=device)
        views, offset = [], 0
        for tensor in members:
            view = flat[offset: offset + tensor.numel()].view(tensor.shape)
            # NB: as DDP's reducer scales a gradient into its bucket (mul by 1 / world_size)
            torch.mul(tensor, state.scale, out=view)
            views.append(view)
            offset += tensor.numel()
        dist.all_reduce(flat, group=state.group)
        state.stats["early_collectives"] += 1
        for tensor, view in zip(members, views):
            tensor.copy_(view)


class _HandingBackward:
    """The compiled backward, after the communication stream; notes what it hands to autograd."""

    def __init__(self, fn: Callable[[list[Any]], Any], owner: EarlyAllReduce):
        # NB: an instance attribute: wrappers copy the instance __dict__, and AOT reads it.
        self._boxed_call = True
        self.fn = fn
        self.owner = owner

    def __call__(self, args: list[Any]) -> list[Any]:
        owner = self.owner
        state = owner.state
        handed = [(grad.param, state.reduced.pop(_data_ptr(args[grad.saved]), None))
                  for grad in owner.grads]
        owner.streams.wait_comm()
        outputs = self.fn(args)
        for index, key in handed:
            if key is not None and outputs[index] is not None:
                state.handed[key] = outputs[index]
        return outputs


def early_allreduce_for(ddp: Any, graph_id: int, fw: fx.GraphModule, bw: fx.GraphModule,
                        num_fwd_outputs: int, on_error: str) -> EarlyAllReduce | None:
    """The early all-reduce of one graph compiled under ``ddp``, or None (logged) if it has none."""
    grads = plan_early_grads(fw, bw, num_fwd_outputs)
    if not grads:
        log.info("erase_fx graph %d: no early gradient to all-reduce in the forward: DDP "
                 "reduces them at .backward()", graph_id)
        return None
    state = ddp_state(ddp)
    if state.unsupported is not None:
        if on_error == "raise":
            raise EraseDistributedError(
                WHERE, f"early all-reduce is not supported here: {state.unsupported}",
                fix="pass options={'early_allreduce': False} (DDP reduces the early gradients "
                "at .backward()), or options={'on_error': 'fallback'}")
        state._note("unsupported", f"early all-reduce is off for this DDP module: "
                    f"{state.unsupported}; DDP reduces every gradient at .backward()",
                    logging.WARNING)
        return None
    return EarlyAllReduce(state, graph_id, grads)
