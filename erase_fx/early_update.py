"""An early block's optimizer update, during the forward, inside `compile_step`'s capture.

Why: with the optimizer in the step, its update runs after the backward, on
the main stream, and nothing overlaps it. On the small chains Adam's update
(``foreach``, ``capturable``) takes longer than the forward and backward
together (mlp:128:2000:2000:4 on an H200: 1.4 of 1.9 ms), so erase's overlap
of the early backward leaves the step at 0.94x of stock's. An early block's
gradients are final the moment its early backward ends, in the middle of the
forward; if nothing reads its parameters after that, their update can run
then, on a stream of its own, while the rest of the forward and the backward
run. ``compile_step(fn, early_optimizer=True)`` builds that into the graph it
captures; replays then overlap the update with the forward (H200: Adam steps
at 0.67-0.96x of stock's, 0.75-0.98x without it; `docs/performance.md`).

What decides it, and why each condition (a parameter failing one is updated
with the others, by the optimizer's own step, after the backward):

- compile time, per graph (`plan_early_updates`): the parameter's whole
  gradient is computed early and handed out as the saved early gradient
  itself (`erase_fx.early_grads.plan_early_grads`), and every reader of the
  parameter in the forward (through views) is something one of its block's
  gradients is computed from: nothing in the forward or the backward reads
  it once its block is done. A parameter saved for the backward, shared with a later
  block, or returned is not updated early; nor is any parameter of a graph
  with more than one differentiable output (see the backward below), nor
  of a graph compiled under DistributedDataParallel: its gradients are
  all-reduced after their block (erase's early all-reduce, or DDP at the
  end of the backward), so an update after the block would read them
  unreduced; such a graph plans its early gradients for the all-reduce only
  (`erase_fx.compilation`).
- while `compile_step` captures the step (`UpdateSession`, which the graphs
  find on the step's `erase_fx.emit.capture_scope.StepScope`):

  - each block's completion records an event on its side stream: the update
    waits for it and for nothing else;
  - the graph's backward runs once, from ``loss.backward()`` with no
    gradient given on the graph's own output: the loss gradient ``T`` is
    then exactly 1 and, with the default seed 1, the early gradients are
    handed out as computed (``T / seed == 1``: the backward's in-place
    scaling does nothing). A scaled loss, a loss computed outside the graph,
    the graph run twice (gradient accumulation): no parameter of that graph
    is updated early;
  - autograd adopts the handed gradient as ``.grad`` with no other term,
    and ``.grad`` was None before (``zero_grad(set_to_none=True)``):
    checked on the parameter's AccumulateGrad node, as `erase_fx.ddp` does;
  - no later compiled graph of the step with early blocks of its own (after
    a graph break) takes the parameter as an input;
  - at ``optimizer.step()``: the optimizer is SGD, Adam or AdamW (updates
    per parameter: narrowing their parameter groups changes no bit of the
    result), called without a closure, with no step hooks but
    ``compile_step``'s; the gradient, the parameter and the groups' tensor
    hyperparameters (a tensor ``lr``) are unchanged since (their version
    counters): a clipped gradient or a changed lr, and the parameter waits.

- Then, before the optimizer's own step runs, the eligible parameters are
  updated, one call of the optimizer's own step function per block, with
  the parameter groups narrowed to the block's, on the update stream paired
  with the block's side stream, after the block's event
  (`StreamOps.run_update`: not on the block's side stream, whose freed
  memory the main stream may still be reading; one update stream per side
  stream, so that the blocks' updates overlap as their backwards do); the
  optimizer's step then updates the rest on the main stream; after it the
  main stream waits for the update streams, so what follows
  ``optimizer.step()`` in the step sees every new parameter.

What ``early_optimizer=True`` asks of the step, because it cannot be checked:
between a block's forward and ``optimizer.step()``, nothing outside the
compiled graphs reads that block's parameters: not the step's own code, not
eager code between two graphs of the model (reading one there, say a weight
norm for logging, may see the new value). A later compiled graph of the step
that has early blocks of its own and takes one as an input is seen; one with
none is not. Writes are checked.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from erase_fx.early_grads import EarlyGrad, block_key, hook_each_block
from erase_fx.emit.capture_scope import StepScope, current_scope
from erase_fx.passes import MAIN_STREAM
from erase_fx.passes.graph import is_view, output_values

log = logging.getLogger(__name__)

#: Optimizers whose update of a parameter reads only that parameter's own
#: state: narrowing their groups to some parameters updates those exactly as
#: one call over all of them does.
PER_PARAMETER_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


# -- which parameters: the plan, per compiled graph ------------------------------


def plan_early_updates(fw: fx.GraphModule, grads: Sequence[EarlyGrad]) -> tuple[EarlyGrad, ...]:
    """The early gradients whose parameter nothing in ``fw`` reads once its block's are made.

    ``grads``: the graph's whole early gradients (`erase_fx.early_grads.plan_early_grads`).
    A parameter qualifies when every node reading it, directly or through a
    chain of views, is an ancestor of a node making one of its block's
    gradients (the block's backward reads a weight for the gradient of its
    input, which feeds other parameters' gradients): the stream program runs
    every such reader before the block completes, and the block's completion
    event orders the update after all of them. A reader that is not
    (another block, a value saved for the backward or returned: the output
    node reads those) keeps the parameter out.
    """
    placeholders = list(fw.graph.find_nodes(op="placeholder"))
    outputs = output_values(fw.graph)
    before: dict[Any, set[fx.Node]] = {}
    for grad in grads:
        made = outputs[grad.result]
        if isinstance(made, fx.Node):
            before.setdefault(block_key(grad), set()).update(_ancestors(made))
    return tuple(grad for grad in grads
                 if all(reader in before.get(block_key(grad), ())
                        for reader in _readers(placeholders[grad.param])))


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it is computed from."""
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(current.all_input_nodes)
    return found


def _readers(node: fx.Node) -> set[fx.Node]:
    """The nodes that read ``node``'s memory: its users, and the users of its views."""
    found: set[fx.Node] = set()
    bases, stack = {node}, list(node.users)
    while stack:
        user = stack.pop()
        if user in found:
            continue
        found.add(user)
        if is_view(user) and user.args and user.args[0] in bases:
            bases.add(user)
            stack.extend(user.users)
    return found


def unprovable_loss_gradient(differentiable_outputs: int, seed: float, *,
                             learned: bool) -> str | None:
    """Why a graph's early gradients cannot be proven handed out as computed, or None.

    A backward from the graph's only differentiable output, with no gradient
    given, makes the loss gradient ``T`` exactly 1; with ``seed`` 1 too,
    ``T / seed == 1`` and the backward's in-place scaling does nothing. A seed
    ``learned`` from the last loss gradient (`erase_fx.emit.loss_seed`) is
    known only at run time.
    """
    if learned:
        return ("its seed is learned from the last loss gradient (float16): T / seed cannot "
                "be proven 1")
    if differentiable_outputs != 1:
        return ("its graph has more than one differentiable output: its loss gradient cannot "
                "be proven 1")
    if seed != 1.0:
        return f"the backend's seed is {seed}, not 1: T / seed is not 1"
    return None


# -- one compiled graph at run time ------------------------------------------------


class EarlyUpdates:
    """The early updates of one compiled graph.

    `attach` hooks the graph's `StreamProgram` (one completion hook per
    block: the event its update waits for); `wrap_backward` wraps its compiled
    backward (what it hands to autograd, and from which autograd node). Both
    do nothing unless `compile_step` is capturing a step with
    ``early_optimizer=True`` (`active_session`).

    NB: the backward runs on the autograd engine's thread, where the step's
    scope is not current: it reports to the session its forward met
    (`session`), which the session clears when it closes.

    Attributes:
        graph_id: the compiled graph's number (for messages).
        grads: the whole early gradients (`erase_fx.early_grads.plan_early_grads`):
            a block completes when all of its are made.
        planned: which of them may be updated early (`plan_early_updates`).
        unprovable: why no parameter of the graph may be updated early, decided
            at compile time (`unprovable_loss_gradient`), or None.
    """

    def __init__(self, graph_id: int, grads: Sequence[EarlyGrad], planned: Sequence[EarlyGrad],
                 unprovable: str | None):
        self.graph_id = graph_id
        self.grads = tuple(grads)
        chosen = set(planned)
        self.planned = tuple(g in chosen for g in self.grads)
        self.unprovable = unprovable
        #: the session the last forward ran under, while it is open: the backward's
        self.session: UpdateSession | None = None

    def attach(self, program: Any) -> None:
        hook_each_block(program, self.grads, self._begin, self._block_done)

    def _begin(self, inputs: Sequence[Any]) -> _Call | None:
        session = active_session()
        if session is None:
            return None
        params = [inputs[g.param] if planned else None
                  for g, planned in zip(self.grads, self.planned)]
        self.session = session
        session.forward_began(self, params, inputs)
        return _Call(session, params)

    def _block_done(self, members: tuple[int, ...], call: _Call, values: list[Any],
                    after: tuple[int, ...], streams: Any) -> None:
        """A block completes: its planned parameters' updates may start after this event."""
        call.session.block_done(self, [call.params[i] for i in members], values, after, streams)

    def wrap_backward(self, compiled: Any) -> Any:
        return _NotingBackward(compiled, self)


@dataclasses.dataclass
class _Call:
    """One forward of a graph under a session: the session and each planned gradient's parameter."""

    session: UpdateSession
    params: list[Any]


class _NotingBackward:
    """The compiled backward; tells the session what it handed to autograd, from which node."""

    def __init__(self, fn: Callable[[list[Any]], Any], owner: EarlyUpdates):
        # NB: an instance attribute: wrappers copy the instance __dict__, and AOT reads it.
        self._boxed_call = True
        self.fn = fn
        self.owner = owner

    def __call__(self, args: list[Any]) -> list[Any]:
        outputs = self.fn(args)
        session = self.owner.session
        if session is not None:
            # NB: the autograd node running this backward: the graph's output's grad_fn
            node = torch._C._current_autograd_node()
            session.handed(self.owner, [outputs[g.param] for g in self.owner.grads], node)
        return outputs


# -- the session: one capture of one step --------------------------------------------


@dataclasses.dataclass
class _Param:
    """What the session knows of one parameter whose gradient a block made early."""

    param: torch.Tensor
    owner: EarlyUpdates
    streams: Any
    events: list[Any]
    param_version: int
    #: the block's side stream, less one: its update stream (`StreamOps.run_update`)
    lane: int = 0
    handed: torch.Tensor | None = None
    node: Any = None
    adopted_ptr: int | None = None
    grad_version: int | None = None
    handed_stride: tuple[int, ...] | None = None
    problem: str | None = None


@dataclasses.dataclass(frozen=True)
class _BackwardCall:
    tensors: tuple[Any, ...]
    gradient_given: bool
    create_graph: bool
    inputs_given: bool


def active_session() -> UpdateSession | None:
    """The session of the step being captured with ``early_optimizer=True``, if any: the one
    on the current `erase_fx.emit.capture_scope.StepScope` (in the caller's thread; see
    `EarlyUpdates` for the backward's)."""
    scope = current_scope()
    return None if scope is None else scope.session


class UpdateSession:
    """Early updates while one step is captured: what the graphs report, and the optimizer's step.

    Open it with `open_session` on the step's scope around the capture. It
    records, through the graphs' hooks, each block's completion and what each
    backward hands out; through a wrapper of ``torch.autograd.backward``, the
    step's backward calls; through global optimizer step hooks, each ``optimizer.step()``,
    where it launches the early updates (`before_step`) and joins them
    (`after_step`).

    Attributes:
        updated: parameters updated early in the captured step.
        refused: why the other parameters of early blocks were not, with how many.
    """

    def __init__(self, optimizers: Sequence[Any] = (), own_hooks: Sequence[Any] = ()):
        self.params: dict[int, _Param] = {}
        self.backwards: list[_BackwardCall] = []
        self.updated = 0
        self.refused: collections.Counter[str] = collections.Counter()
        self.own_hooks = [*own_hooks, self.before_step, self.after_step]
        #: the tensor hyperparameters' versions of the optimizers known at the start
        self.hyperparameters = {id(o): _hyperparameter_versions(o) for o in optimizers}
        self._forwards: dict[int, list[Any]] = {}
        self._owners: list[EarlyUpdates] = []
        self._hooks: list[Any] = []
        self._narrowed: list[tuple[dict[str, Any], list[Any]]] = []
        self._joins: list[Any] = []

    # -- what the graphs report

    def forward_began(self, owner: EarlyUpdates, params: list[Any],
                      inputs: Sequence[Any]) -> None:
        """A forward of ``owner`` starts with ``inputs``; ``params``: its planned parameters."""
        if id(owner) in self._forwards:
            self._refuse_owner(owner, "its graph ran twice in the step (gradient accumulation)")
        else:
            self._owners.append(owner)
        self._forwards[id(owner)] = params
        # NB: another graph reading a parameter a block already made the gradient of (tied
        # weights across a graph break) may run while its update does: not early, then
        by_memory = {_memory(e.param): e for e in self.params.values() if e.owner is not owner}
        for value in inputs:
            if isinstance(value, torch.Tensor) and _memory(value) in by_memory:
                entry = by_memory[_memory(value)]
                entry.problem = entry.problem or ("another compiled graph of the step reads it "
                                                  "after its block")

    def block_done(self, owner: EarlyUpdates, params: Sequence[Any], grads: Sequence[Any],
                   after: tuple[int, ...], streams: Any) -> None:
        """A block's early gradients are launched on ``after``: record the event to wait for."""
        side = [s for s in after if s != MAIN_STREAM]
        events = [streams.record_event(s) for s in after] if side else []
        for param, grad in zip(params, grads):
            if not isinstance(param, torch.Tensor) or not isinstance(grad, torch.Tensor):
                continue
            entry = self.params.get(id(param))
            if entry is not None:
                entry.problem = entry.problem or "its gradient is made twice in the step"
                continue
            entry = _Param(param, owner, streams, events, param._version,
                           lane=side[0] - 1 if side else 0)
            if not side:
                entry.problem = "its block runs on the main stream (streams=0 or overlap=False)"
            else:
                entry.problem = owner.unprovable
            self.params[id(param)] = entry
            if entry.problem is None:
                self._watch(entry)

    def handed(self, owner: EarlyUpdates, grads: Sequence[Any], node: Any) -> None:
        """A backward of ``owner`` handed ``grads`` (the plan's order) to autograd, from autograd
        node ``node``."""
        for param, grad in zip(self._forwards.get(id(owner), ()), grads):
            entry = self.params.get(id(param))
            if entry is None or entry.owner is not owner:
                continue
            if entry.node is not None:
                entry.problem = entry.problem or "its graph's backward ran twice in the step"
            entry.node = node
            entry.handed = grad if isinstance(grad, torch.Tensor) else None

    def backward_called(self, tensors: Any, grad_tensors: Any, create_graph: bool,
                        inputs: Any) -> None:
        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
        self.backwards.append(_BackwardCall(tuple(tensors), grad_tensors is not None,
                                            bool(create_graph), inputs is not None))

    def _refuse_owner(self, owner: EarlyUpdates, why: str) -> None:
        for entry in self.params.values():
            if entry.owner is owner:
                entry.problem = entry.problem or why

    def _watch(self, entry: _Param) -> None:
        """Check, as autograd accumulates the parameter's gradient, that it adopts the handed one.

        NB: a pre-hook on the parameter's AccumulateGrad node: autograd sums
        several gradient terms into a new tensor (it cannot reuse a term's
        memory while ``handed`` holds it), so the tensor is the handed one
        exactly when there is no other term. The hook drops the session's
        reference, so that AccumulateGrad may adopt it as ``.grad`` (it
        copies a gradient someone else still holds).
        """
        node = torch.autograd.graph.get_gradient_edge(entry.param).node

        def check(grad_outputs: Sequence[Any]) -> None:
            handed, entry.handed = entry.handed, None
            if handed is None or len(grad_outputs) != 1 or grad_outputs[0] is not handed:
                entry.problem = entry.problem or (
                    "its gradient has another term than the early one (the parameter is used "
                    "outside its block too)")
            elif entry.param.grad is not None:
                entry.problem = entry.problem or (
                    ".grad was not None before the backward (zero the gradients with "
                    "set_to_none=True, the default)")
            else:
                entry.adopted_ptr = handed.data_ptr()
                entry.grad_version = handed._version
                entry.handed_stride = tuple(handed.stride())

        self._hooks.append(node.register_prehook(check))

    # -- the optimizer's step

    def before_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """Launch the early updates of ``optimizer``'s eligible parameters; narrow its groups to
        the rest for its own step."""
        mine = [self.params[id(p)] for group in optimizer.param_groups for p in group["params"]
                if id(p) in self.params]
        if not mine:
            return
        problem = self._optimizer_problem(optimizer, args, kwargs)
        early = []
        for entry in mine:
            why = problem or entry.problem or self._changed(entry)
            if why is None:
                early.append(entry)
            else:
                self.refused[why] += 1
        if not early:
            return
        step = _step_function(optimizer)
        groups = optimizer.param_groups
        originals = [group["params"] for group in groups]
        # NB: one update per block, in the order the blocks completed (the order the session
        # met their parameters): each waits for its own block's event only (one list a block)
        chosen_entries = {id(e) for e in early}
        by_block: dict[int, list[_Param]] = {}
        for entry in self.params.values():
            if id(entry) in chosen_entries:
                by_block.setdefault(id(entry.events), []).append(entry)
        try:
            for entries in by_block.values():
                chosen = {id(e.param) for e in entries}
                for group, params in zip(groups, originals):
                    group["params"] = [p for p in params if id(p) in chosen]
                streams = entries[0].streams
                streams.run_update(entries[0].lane, entries[0].events, lambda: step(optimizer))
                if all(s is not streams for s in self._joins):
                    self._joins.append(streams)
        finally:
            for group, params in zip(groups, originals):
                group["params"] = params
        done = {id(e.param) for e in early}
        for group, params in zip(groups, originals):
            self._narrowed.append((group, params))
            group["params"] = [p for p in params if id(p) not in done]
        self.updated += len(early)

    def after_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """Give the optimizer its groups back; the main stream waits for the early updates."""
        self._restore_groups()
        for streams in self._joins:
            streams.join_update()
        self._joins.clear()

    def _optimizer_problem(self, optimizer: Any, args: tuple, kwargs: dict) -> str | None:
        """Why none of ``optimizer``'s parameters may be updated early, or None."""
        if type(optimizer) not in PER_PARAMETER_OPTIMIZERS:
            return (f"the optimizer is {type(optimizer).__name__}: only SGD, Adam and AdamW "
                    "update parameters early")
        # NB: torch hands step hooks the step's whole arguments, the optimizer first
        if args[1:] or kwargs:
            return "optimizer.step() was given a closure"
        others = _other_step_hooks(optimizer, self.own_hooks)
        if others:
            return f"the optimizer has step hooks ({others}): they must see every update"
        if any(group.get("differentiable", False) for group in optimizer.param_groups):
            return "differentiable=True"
        known = self.hyperparameters.get(id(optimizer))
        if known is None:
            return "an optimizer the warm-up steps did not step"
        if known != _hyperparameter_versions(optimizer):
            return "a tensor hyperparameter (lr) was changed in place during the step"
        return None

    def _changed(self, entry: _Param) -> str | None:
        """Why this parameter, eligible so far, is not updated early, or None."""
        if entry.node is None:
            return "its graph's backward did not run"
        calls = [call for call in self.backwards
                 if any(isinstance(t, torch.Tensor) and t.grad_fn is entry.node
                        for t in call.tensors)]
        if len(calls) != 1 or len(calls[0].tensors) != 1 or calls[0].tensors[0].dim() != 0:
            return ("the backward did not start at its graph's loss (a loss scaled or summed "
                    "outside the compiled graph): the loss gradient is not proven 1")
        call = calls[0]
        if call.gradient_given or call.create_graph or call.inputs_given:
            return ("the backward was given a gradient, create_graph or inputs: the loss "
                    "gradient is not proven 1")
        grad = entry.param.grad
        if entry.adopted_ptr is None:
            return "autograd did not accumulate the early gradient into .grad"
        if grad is None or grad.data_ptr() != entry.adopted_ptr:
            if entry.handed_stride != entry.param.stride():
                log.info("erase_fx: a parameter of shape %s and strides %s got a copy of its "
                         "early gradient (strides %s) as .grad", tuple(entry.param.shape),
                         tuple(entry.param.stride()), entry.handed_stride)
                return ("autograd copied the early gradient into .grad: its layout is not the "
                        "parameter's")
            return "autograd copied the early gradient into .grad (same layout)"
        if grad._version != entry.grad_version:
            return "the gradient was changed in place before optimizer.step() (clipping?)"
        if entry.param._version != entry.param_version:
            return "the parameter was changed in place during the step"
        return None

    # -- closing

    def _restore_groups(self) -> None:
        for group, params in self._narrowed:
            group["params"] = params
        self._narrowed.clear()

    def close(self) -> None:
        self._restore_groups()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.params.clear()
        self.backwards.clear()
        self._forwards.clear()
        for owner in self._owners:
            if owner.session is self:
                owner.session = None
        self._owners.clear()


def describe_refusals(refused: dict[str, int]) -> str:
    """``refused`` (why, how many parameters) in one line: "why (n); why (n)"."""
    return "; ".join(f"{why} ({n})" for why, n in refused.items())


def _memory(tensor: torch.Tensor) -> int:
    """Where a tensor's memory starts: the same for a parameter and any view of it."""
    return tensor.untyped_storage().data_ptr()


def _hyperparameter_versions(optimizer: Any) -> tuple[tuple[int, str, int], ...]:
    return tuple((i, name, value._version) for i, group in enumerate(optimizer.param_groups)
                 for name, value in sorted(group.items(), key=lambda item: item[0])
                 if name != "params" and isinstance(value, torch.Tensor))


def _step_function(optimizer: Any) -> Callable[[Any], Any]:
    """The optimizer class's own ``step``, without torch's hook wrapper.

    NB: torch wraps each optimizer class's ``step`` once
    (``Optimizer._patch_step_function``: ``profile_hook_step``, marked
    ``hooked``), with ``functools.wraps``; ``__wrapped__`` is the class's own
    step, which the early updates call once per block so that step hooks run
    once, around the optimizer's own call. Pinned in
    ``tests/test_early_update.py`` for torch 2.11-2.14.
    """
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


def _other_step_hooks(optimizer: Any, own: Sequence[Any]) -> str:
    """Names of the optimizer's step hooks, global or its own, other than ``own``.

    NB: torch keeps them in ``torch.optim.optimizer._global_optimizer_pre_hooks``
    and ``_global_optimizer_post_hooks`` and in each optimizer's
    ``_optimizer_step_pre_hooks`` / ``_optimizer_step_post_hooks`` (ordered
    dicts of callables). Pinned in ``tests/test_early_update.py``.
    """
    import torch.optim.optimizer as optimizer_module

    hooks = [*optimizer_module._global_optimizer_pre_hooks.values(),
             *optimizer_module._global_optimizer_post_hooks.values(),
             *optimizer._optimizer_step_pre_hooks.values(),
             *optimizer._optimizer_step_post_hooks.values()]
    return ", ".join(getattr(h, "__qualname__", repr(h)) for h in hooks
                     if not any(h == o for o in own))


@contextlib.contextmanager
def open_session(scope: StepScope, optimizers: Sequence[Any] = (),
                 own_hooks: Sequence[Any] = ()) -> Iterator[UpdateSession]:
    """An `UpdateSession` on ``scope`` (``scope.session``) for the duration of one capture.

    ``scope``: the capturing step's (`erase_fx.emit.capture_scope.StepScope`): the graphs
    that run while it is current report to the session. ``optimizers``: those the
    warm-up steps stepped (their tensor hyperparameters' versions now are the
    reference); ``own_hooks``: the caller's own optimizer step hooks, which do not
    count as the user's.
    """
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    if scope.session is not None:
        raise RuntimeError("erase_fx: one early-update session at a time")
    session = scope.session = UpdateSession(optimizers, own_hooks)
    original_backward = torch.autograd.backward

    @functools.wraps(original_backward)
    def recording_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
                           grad_variables=None, inputs=None):
        session.backward_called(tensors, grad_tensors if grad_tensors is not None
                                else grad_variables, create_graph, inputs)
        return original_backward(tensors, grad_tensors, retain_graph, create_graph,
                                 grad_variables, inputs=inputs)

    # NB: Tensor.backward calls torch.autograd.backward by its module attribute (torch
    # 2.11-2.14; pinned in tests/test_early_update.py): the wrapper sees loss.backward().
    torch.autograd.backward = recording_backward
    pre = register_optimizer_step_pre_hook(session.before_step)
    post = register_optimizer_step_post_hook(session.after_step)
    try:
        yield session
    finally:
        pre.remove()
        post.remove()
        torch.autograd.backward = original_backward
        session.close()
        scope.session = None
