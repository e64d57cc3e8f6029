"""CUDA graph replay of a compiled forward (multi-stream) and of its backward.

Without graphs, every segment call, stream fork and join costs CPU time, and
on small models the CPU, not the GPU, sets the pace. `GraphedForward` and
`GraphedBackward` capture the whole compiled forward (side streams forked
from and joined to the capture stream) and the whole backward once, then
replay them: one launch each per step.

Rules that keep replay exact (each one has a test on the GPU in
``bench/check_cuda.py``; the pure parts have CPU tests):

- **Inputs.** A graph reads fixed addresses. Parameters and buffers
  (AOTAutograd's static inputs) are captured in place; an optimizer updates
  them in place. If one moves (``model.to(...)``, a reassigned parameter),
  the graph is captured again. Every other input is copied into a static
  buffer before replay.
- **Memory shared by streams.** Under capture, `StreamProgram` frees
  nothing before the join at the end of the forward (``release_lag=None``),
  so the capture never hands memory a side stream reads to main-stream work
  that would overwrite it during replay; ``release_lag`` opts into releases
  ordered by events (`erase_fx.emit.release`).
- **Outputs are handed out, not copied.** Replay overwrites the memory of the
  previous replay's outputs. The forward's user-visible outputs (the loss,
  mutated buffers) are cloned (they are small). Everything else (the tensors
  saved for the backward, the gradients the backward returns, early
  gradients included, which live in the forward's memory) is handed out as
  fresh aliases of the graph's memory: no copy, no extra memory.
- **Replay only over dead outputs.** Before a replay, each graph checks that
  nobody holds its previous outputs any more (the use count of their memory
  is back to what the graph itself holds, counted as torch's cudagraph trees
  do). If someone does (a backward not run yet, ``retain_graph=True``,
  gradients kept across steps by accumulation or ``zero_grad(set_to_none=False)``),
  that call runs the compiled program without the graph, which is exact;
  an INFO line says so once. Two forwards before one backward are therefore
  exact, the second one just not replayed.
- **Backward.** Replayed only when its saved tensors are exactly those of the
  last forward replay (same memory); otherwise it runs without the graph.
- **One memory pool.** The backward graph is captured into the forward's
  memory pool, so its temporaries reuse the forward's (peak memory of one
  step, not of two graphs side by side). The backward's memory may then lie
  where the forward keeps its temporaries: the forward also does not replay
  while the backward's outputs (gradients) are in use.
- **The native allocator only.** Under ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``
  nothing is captured (`allocator_refusal`): a tensor made during capture and
  freed before the graph's first replay aborts the process there.
- **First calls.** The first call runs without the graph (warm-up: lazy
  initialisation of libraries must not happen under capture); the second
  captures, then replays.
- **Inside someone else's capture** (the user captures the whole training
  step in one ``torch.cuda.CUDAGraph``): the compiled program runs as is, so
  the user's graph captures it, side streams included. The same while
  `erase_fx.compile_step` warms a step up or captures it (its
  `erase_fx.emit.capture_scope.StepScope` is current): its uncaptured warm-up
  calls must not capture graphs of ours that its graph never replays. The
  backward, which runs on the autograd engine's thread, goes by what its
  forward saw (`GraphedForward.inside_step`).
- **Every call that does not replay** says why: `Unreplayed` (first call,
  someone else captures, outputs or gradients still held, a backward not
  after a replay or keeping its graph, a capture that failed). The
  forward's `unreplayed()` and the backward's `unreplayed(args)` are the one
  place each graph decides; `graph_backward` builds a forward's backward
  and links the two.
- **retain_graph=True.** The backward's graph scales early gradients in
  place (`erase_fx.emit.scale_grads`); a backward that keeps its graph runs
  without the CUDA graph, so a second backward reads unscaled saved tensors.
- **Blocks at a graph's end** (`erase_fx.emit.graph_end`). A capture runs
  them at the forward's end and joins them, so a replay does too, whether or
  not the program has disarmed: disarming (after one forward whose backward
  never came, say a metric computed with grad enabled) changes the forwards
  run without the graph only. A forward with no backward then pays for those
  blocks inside its replay, where leaving every later forward unreplayed would
  pay for every kernel's launch.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Sequence
from typing import Any

import torch

from erase_fx.emit.capture_scope import current_scope
from erase_fx.emit.inner import (
    Boxed,
    BoxedCallable,
    cuda_device_of,
    has_symbolic_shapes,
    stream_capturing,
)
from erase_fx.emit.scale_grads import backward_keeps_graph

log = logging.getLogger("erase_fx")


class Unreplayed(str, enum.Enum):
    """Why a call of a graphed forward or backward runs the compiled program without its graph.

    Every other call replays (capturing first when there is no graph yet, or
    when the forward's static inputs moved). `GraphedForward.unreplayed` and
    `GraphedBackward.unreplayed` return one of these, or None.
    """

    #: the capture failed once: replay is off for good (the warning said why)
    CAPTURE_FAILED = "capture_failed"
    #: a forward's first call: lazy initialisation must not happen under capture
    WARM_UP = "warm_up"
    #: someone else captures the step (a user's graph, `erase_fx.compile_step`)
    INSIDE_CAPTURE = "inside_capture"
    #: a forward: tensors of its last replay are still held (saved for a
    #: backward not run yet, or gradients kept as .grad)
    OUTPUTS_IN_USE = "outputs_in_use"
    #: a backward that keeps its graph (``retain_graph=True``)
    KEEPS_GRAPH = "keeps_graph"
    #: a backward whose saved tensors are not those of the last forward replay
    NOT_AFTER_A_REPLAY = "not_after_a_replay"
    #: a backward: gradients of its last replay are still held
    GRADIENTS_IN_USE = "gradients_in_use"


@dataclasses.dataclass(frozen=True)
class AliasOf:
    """A graph output that lives in the memory of one of the graph's inputs.

    Such an output (a gradient computed by the forward and passed through
    the backward, or one written into a donated saved tensor) is rebuilt at
    each replay as a view of that input, so the graph holds no reference to
    memory it does not own. ``whole``: the output is the whole input (its
    shape, strides and offset), so a replay rebuilds it with one detach.
    The geometry is decided at capture: a backward replays only over the
    saved tensors of the last forward replay, the same tensors every step.
    """

    input_index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    whole: bool = False


def plan_outputs(outputs: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """For each output: an `AliasOf` if it lives in an input's memory, else the output itself."""
    owner: dict[int, int] = {}
    for j, value in enumerate(inputs):
        if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr():
            owner.setdefault(value.untyped_storage().data_ptr(), j)
    plan: list[Any] = []
    for value in outputs:
        j = owner.get(value.untyped_storage().data_ptr()) if isinstance(value, torch.Tensor) \
            else None
        if j is None:
            plan.append(value)
            continue
        geometry = (tuple(value.shape), tuple(value.stride()), value.storage_offset())
        source = inputs[j]
        plan.append(AliasOf(j, *geometry, whole=geometry == (
            tuple(source.shape), tuple(source.stride()), source.storage_offset())))
    return plan


def realize_outputs(plan: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """The outputs of one replay: fresh aliases of graph memory or of the inputs' memory.

    NB: every backward replay runs this over every gradient (about 50 on a
    small chain), so it does no more than one detach (and one ``as_strided``
    for a partial alias) per output.
    """
    outputs: list[Any] = []
    append = outputs.append
    for entry in plan:
        if entry.__class__ is AliasOf:
            if entry.whole:
                append(inputs[entry.input_index].detach())
            else:
                append(inputs[entry.input_index].detach().as_strided(
                    entry.size, entry.stride, entry.storage_offset))
        elif isinstance(entry, torch.Tensor):
            append(entry.detach())
        else:
            append(entry)
    return outputs


class _OwnedMemory:
    """The memory a graph owns, and whether anyone but the graph still uses it.

    NB: it holds each storage and its handle once, at capture, so that a check
    before a replay is one C++ call per storage (about 60 of them on a small
    chain, every step).
    """

    def __init__(self, tensors: Sequence[Any]):
        storages = [t.untyped_storage() for t in tensors
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr()]
        self.storages = storages  # held: part of the baseline below
        self.baseline = [(s._cdata, _USE_COUNT(s._cdata)) for s in storages]

    def in_use(self) -> bool:
        return any(_USE_COUNT(handle) > uses for handle, uses in self.baseline)


class GraphedForward(Boxed):
    """A compiled forward replayed from a CUDA graph; see the module docstring."""

    def __init__(
        self,
        fn: BoxedCallable,
        *,
        num_user_outputs: int,
        static_input_indices: Sequence[int],
        device: torch.device,
        name: str,
    ):
        super().__init__()
        self.fn = fn
        self.num_user_outputs = num_user_outputs
        self.static_input_indices = sorted(set(static_input_indices))
        self.device = device
        self.name = name
        self.calls = 0
        self.replays = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: list[Any] = []
        self.static_input_ptrs: list[int | None] = []
        self.copied_input_indices: list[int] = []
        self.static_outputs: list[Any] = []
        self.saved_outputs: list[Any] = []
        self.saved_ptrs: list[int | None] = []
        self.saved_tensor_indices: list[int] = []
        self.memory = _OwnedMemory(())
        self.pool: Any = None
        self.backward: GraphedBackward | None = None
        self.disabled_reason: str | None = None
        #: whether the last call ran while `erase_fx.compile_step` warmed up or captured a
        #: step (`erase_fx.emit.capture_scope.current_scope`): its backward, on the autograd
        #: engine's thread, cannot see the scope and reads this
        self.inside_step = False
        self._said_unreplayed = False

    def unreplayed(self) -> Unreplayed | None:
        """Why this call must run without the graph, or None: it replays (capturing if needed)."""
        if self.disabled_reason is not None:
            return Unreplayed.CAPTURE_FAILED
        if self.calls == 1:
            return Unreplayed.WARM_UP
        if self.inside_step or stream_capturing():
            return Unreplayed.INSIDE_CAPTURE
        if self.graph is not None and (self.memory.in_use() or (
                self.backward is not None and self.backward.memory.in_use())):
            return Unreplayed.OUTPUTS_IN_USE
        return None

    def __call__(self, args: list[Any]) -> list[Any]:
        self.calls += 1
        self.inside_step = current_scope() is not None
        reason = self.unreplayed()
        if reason is not None:
            if reason is Unreplayed.OUTPUTS_IN_USE and not self._said_unreplayed:
                log.info("erase_fx %s: forward called while tensors of its last replay are in "
                         "use (saved for a backward not run yet, or gradients still held as "
                         ".grad): running such calls without the CUDA graph; call "
                         "zero_grad(set_to_none=True) before the forward to replay every "
                         "step", self.name)
                self._said_unreplayed = True
            return list(self.fn(args))
        if self.graph is None or not self._static_inputs_stable(args):
            self._capture(args)
            if self.graph is None:
                return list(self.fn(args))
        else:
            self._copy_inputs(args)
        args.clear()
        self.graph.replay()
        self.replays += 1
        return self._outputs()

    # -- capture and replay ---------------------------------------------------

    def _capture(self, args: list[Any]) -> None:
        self.static_input_indices = [i for i in self.static_input_indices if i < len(args)]
        static = set(self.static_input_indices)
        self.static_inputs = [
            a if (i in static or not isinstance(a, torch.Tensor)) else a.clone()
            for i, a in enumerate(args)
        ]
        self.static_input_ptrs = [
            a.data_ptr() if isinstance(a, torch.Tensor) else None for a in self.static_inputs
        ]
        self.copied_input_indices = [
            i for i, a in enumerate(self.static_inputs)
            if i not in static and isinstance(a, torch.Tensor)
        ]
        graph = torch.cuda.CUDAGraph()
        self.pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self.fn(list(self.static_inputs))
        except Exception as error:  # noqa: BLE001 - replay is an optimisation; run without it
            self.disabled_reason = f"capture failed: {type(error).__name__}: {error}"
            log.warning("erase_fx %s: CUDA graph %s; running without it", self.name,
                        self.disabled_reason)
            self.graph = None
            return
        self.graph = graph
        self.static_outputs = list(outputs)
        saved = self.static_outputs[self.num_user_outputs:]
        self.saved_outputs = saved
        self.saved_ptrs = [o.data_ptr() if isinstance(o, torch.Tensor) else None for o in saved]
        self.saved_tensor_indices = [i for i, o in enumerate(saved) if isinstance(o, torch.Tensor)]
        # NB: saved tensors that are parameters are never overwritten by a
        # replay; the others (activations, input buffers, early grads) are.
        parameters = {self.static_inputs[i].untyped_storage().data_ptr()
                      for i in static if i < len(self.static_inputs)}
        self.memory = _OwnedMemory([o for o in saved if isinstance(o, torch.Tensor)
                                    and o.untyped_storage().data_ptr() not in parameters])
        if self.backward is not None:
            self.backward.reset()

    def _static_inputs_stable(self, args: list[Any]) -> bool:
        return len(args) == len(self.static_input_ptrs) and data_ptrs_equal(
            args, self.static_input_ptrs, self.static_input_indices)

    def _copy_inputs(self, args: list[Any]) -> None:
        indices = [i for i in self.copied_input_indices
                   if args[i].data_ptr() != self.static_input_ptrs[i]]
        if indices:
            torch._foreach_copy_([self.static_inputs[i] for i in indices],
                                 [args[i] for i in indices])

    def _outputs(self) -> list[Any]:
        user = [
            o.clone() if isinstance(o, torch.Tensor) else o
            for o in self.static_outputs[: self.num_user_outputs]
        ]
        # NB: no AliasOf here (a forward's inputs are copied or static): one
        # detach per saved tensor, the fresh alias the liveness check counts
        return user + [o.detach() if isinstance(o, torch.Tensor) else o
                       for o in self.saved_outputs]

    def replayed_saved(self, saved: Sequence[Any]) -> bool:
        """Whether ``saved`` (a backward's saved inputs) are the last replay's saved outputs."""
        return (self.graph is not None and self.replays > 0 and len(saved) == len(self.saved_ptrs)
                and data_ptrs_equal(list(saved), self.saved_ptrs, self.saved_tensor_indices))


def graph_backward(forward: GraphedForward, fn: BoxedCallable, num_saved: int,
                   name: str) -> GraphedBackward:
    """The graphed backward of a graphed forward, the two linked: each checks the other's memory."""
    backward = GraphedBackward(fn, forward, num_saved, name)
    forward.backward = backward
    return backward


class GraphedBackward(Boxed):
    """A compiled backward replayed from a CUDA graph; see the module docstring.

    Build it with `graph_backward`, which links it to its forward.
    """

    def __init__(self, fn: BoxedCallable, forward: GraphedForward, num_saved: int, name: str):
        super().__init__()
        self.fn = fn
        self.forward = forward
        self.num_saved = num_saved
        self.name = name
        self.replays = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_tangents: list[Any] = []
        self.tangent_indices: list[int] = []
        self.output_plan: list[Any] = []
        self.memory = _OwnedMemory(())
        self.disabled_reason: str | None = None
        self._said_unreplayed = False

    def reset(self) -> None:
        """The forward was captured again: its saved tensors moved."""
        self.graph = None
        self.output_plan = []
        self.memory = _OwnedMemory(())

    def unreplayed(self, args: list[Any]) -> Unreplayed | None:
        """Why this call must run without the graph, or None: it replays (capturing if needed)."""
        if self.disabled_reason is not None:
            return Unreplayed.CAPTURE_FAILED
        if self.forward.inside_step or stream_capturing():
            return Unreplayed.INSIDE_CAPTURE
        if backward_keeps_graph():
            return Unreplayed.KEEPS_GRAPH
        if not self.forward.replayed_saved(args[: self.num_saved]):
            return Unreplayed.NOT_AFTER_A_REPLAY
        if self.graph is not None and self.memory.in_use():
            return Unreplayed.GRADIENTS_IN_USE
        return None

    def __call__(self, args: list[Any]) -> Any:
        reason = self.unreplayed(args)
        if reason is not None:
            if reason is Unreplayed.GRADIENTS_IN_USE and not self._said_unreplayed:
                log.info("erase_fx %s: gradients of the last replay are still in use "
                         "(accumulated across steps, or zero_grad(set_to_none=False)): "
                         "running such backwards without the CUDA graph", self.name)
                self._said_unreplayed = True
            return self.fn(args)
        if self.graph is None:
            self._capture(args)
            if self.graph is None:
                return self.fn(args)
        else:
            torch._foreach_copy_(self.static_tangents, [args[i] for i in self.tangent_indices])
        sources = list(args[: self.num_saved]) + [None] * (len(args) - self.num_saved)
        for i, static in zip(self.tangent_indices, self.static_tangents):
            sources[i] = static
        args.clear()
        self.graph.replay()
        self.replays += 1
        return realize_outputs(self.output_plan, sources)

    def _capture(self, args: list[Any]) -> None:
        # NB: saved tensors stay where the forward graph writes them (its
        # static outputs keep that memory); only the tangents get buffers.
        # Holding the saved tensors here would keep the forward's memory "in
        # use" forever.
        self.tangent_indices = [i for i in range(self.num_saved, len(args))
                                if isinstance(args[i], torch.Tensor)]
        self.static_tangents = [args[i].clone() for i in self.tangent_indices]
        inputs = list(args)
        for i, static in zip(self.tangent_indices, self.static_tangents):
            inputs[i] = static
        graph = torch.cuda.CUDAGraph()
        try:
            # warm-up of the backward happens in the forward's first (uncaptured) step
            with torch.cuda.graph(graph, pool=self.forward.pool):
                outputs = self.fn(list(inputs))
        except Exception as error:  # noqa: BLE001 - replay is an optimisation; run without it
            self.disabled_reason = f"capture failed: {type(error).__name__}: {error}"
            log.warning("erase_fx %s: backward CUDA graph %s; running without it", self.name,
                        self.disabled_reason)
            return
        self.graph = graph
        self.output_plan = plan_outputs(list(outputs), inputs)
        del outputs, inputs
        owned = [p for p in self.output_plan if isinstance(p, torch.Tensor)]
        self.memory = _OwnedMemory(owned + self.static_tangents)


def data_ptrs_equal(tensors: list[Any], ptrs: list[int | None], indices: list[int]) -> bool:
    """``tensors[i].data_ptr() == ptrs[i]`` for each i in ``indices`` (in C++ on CUDA builds)."""
    fast = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if fast is not None:
        return fast(tensors, ptrs, indices)
    return all(tensors[i].data_ptr() == ptrs[i] for i in indices)


#: How many references a storage has (torch's cudagraph trees count the same way).
_USE_COUNT = torch._C._storage_Use_Count

#: Why erase_fx captures no CUDA graph under the ``cudaMallocAsync`` allocator backend.
ASYNC_ALLOCATOR = (
    "the CUDA allocator is cudaMallocAsync (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync): "
    "there a graph's memory exists only once it has been replayed, and a tensor made during "
    "capture and freed before the first replay aborts the process (seen on an H200, torch "
    "2.11, with stock torch.compile too)")
#: What to do about `ASYNC_ALLOCATOR`.
ASYNC_ALLOCATOR_FIX = "leave PYTORCH_CUDA_ALLOC_CONF's backend at native (the default)"


def allocator_refusal() -> str | None:
    """Why no CUDA graph may be captured with this process's CUDA allocator, or None.

    Call only where CUDA is available (the allocator is chosen when CUDA
    starts, from ``PYTORCH_CUDA_ALLOC_CONF``).
    """
    if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        return ASYNC_ALLOCATOR
    return None


def data_dependent_refusal(gm: torch.fx.GraphModule) -> str | None:
    """Why the forward ``gm`` cannot be captured in a CUDA graph for its data-dependent sizes
    or values, or None.

    A node whose value holds an unbacked symbol (the row count of a boolean
    mask or ``nonzero``, an ``.item()`` kept in the graph) reads the device
    from the host: a capture fails there, and a replay would reuse the sizes
    of the captured step. Stock Inductor refuses such graphs its CUDA graphs
    the same way (``torch._inductor.utils.get_first_incompatible_cudagraph_node``).
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if value is not None and free_unbacked_symbols(value):
            return (f"data-dependent sizes or values (node {node.name}: "
                    f"{getattr(node.target, '__name__', node.target)})")
    return None


def _storage_uses(tensor: torch.Tensor) -> int:
    """How many tensors share this tensor's memory."""
    return _USE_COUNT(tensor.untyped_storage()._cdata)


def graph_forward(
    compiled: BoxedCallable,
    example_inputs: Sequence[Any],
    *,
    cudagraphs: bool | None,
    fw_metadata: Any,
    name: str,
    refusal: str | None = None,
) -> GraphedForward | None:
    """A `GraphedForward` around a compiled forward, or None where replay cannot or should not run.

    Not on CPU, not with ``cudagraphs=False``, not under the ``cudaMallocAsync``
    allocator (`allocator_refusal`), not with dynamic shapes (a graph replays
    one set of shapes), not without AOTAutograd's forward metadata (which
    outputs are the user's), not when the caller gives a ``refusal`` (e.g. a
    forward that all-reduces in the middle); each but the first two logs its
    reason once, at WARNING where ``cudagraphs=True`` asked for graphs, else
    at INFO.
    """
    device = cuda_device_of(example_inputs)
    if device is None or cudagraphs is False:
        return None
    if refusal is None:
        refusal = allocator_refusal()
    if refusal is None and has_symbolic_shapes(example_inputs):
        refusal = "dynamic shapes"
    num_user_outputs = getattr(fw_metadata, "num_forward_returns", None)
    if refusal is None and num_user_outputs is None:
        refusal = "no AOT forward metadata"
    if refusal is not None:
        log.log(logging.WARNING if cudagraphs else logging.INFO,
                "erase_fx %s: no CUDA graphs: %s", name, refusal)
        return None
    return GraphedForward(
        compiled,
        num_user_outputs=num_user_outputs,
        static_input_indices=list(getattr(fw_metadata, "static_input_indices", None) or ()),
        device=device,
        name=name,
    )
