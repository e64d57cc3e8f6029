"""CUDA graph replay of a compiled forward (multi-stream) and of its backward.

Without graphs, every segment call, stream fork and join costs CPU time, and
on small models the CPU, not the GPU, sets the pace. `GraphedForward` and
`GraphedBackward` capture the whole compiled forward (side streams forked
from and joined to the capture stream) and the whole backward once, then
replay them: one launch each per step.

Rules that keep replay exact (each one has a test on the GPU in
``bench/check_cuda.py``):

- **Inputs.** A graph reads fixed addresses. Parameters and buffers
  (AOTAutograd's static inputs) are captured in place; an optimizer updates
  them in place. If one moves (``model.to(...)``, a reassigned parameter),
  the graph is captured again. Every other input is copied into a static
  buffer before replay.
- **Memory shared by streams.** Under capture, a side stream's inputs are
  held until the join (`CudaStreams`), so the capture never hands their
  memory to main-stream work that would overwrite it during replay.
- **Outputs.** Replay overwrites the previous replay's outputs. The forward's
  user-visible outputs (the loss, mutated buffers) are cloned (they are
  small). The tensors saved for the backward are handed out as fresh aliases
  of the graph's memory. Until the replay's backward has run (and for good,
  if it ran with ``retain_graph=True``), replaying again would overwrite
  them; unless the autograd graph was dropped (the use count of that memory
  is back to what the graph itself holds, counted as torch's cudagraph trees
  do), such a call runs the compiled program without the graph instead. Two forwards before one
  backward are therefore exact, the second one just not replayed.
- **Backward.** Replayed only when its saved tensors are exactly those of the
  last forward replay (same memory); otherwise it runs without the graph.
  The gradients are cloned out of the graph's memory, so ``.grad`` never
  aliases memory the next replay writes.
- **First calls.** The first call runs without the graph (warm-up: lazy
  initialisation of libraries must not happen under capture); the second
  captures, then replays.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger("erase_fx")

BoxedCallable = Callable[[list[Any]], Any]


class GraphedForward:
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
        # NB: an instance attribute: wrappers such as torch._dynamo.disable copy
        # the instance __dict__, not class attributes, and AOT reads this flag.
        self._boxed_call = True
        self.fn = fn
        self.num_user_outputs = num_user_outputs
        self.static_input_indices = frozenset(static_input_indices)
        self.device = device
        self.name = name
        self.calls = 0
        self.replays = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: list[Any] = []
        self.static_outputs: list[Any] = []
        self.baseline_uses: list[tuple[torch.Tensor, int]] = []
        self.awaiting_backward = False  # the last replay's backward has not run yet
        self.backward: GraphedBackward | None = None
        self.disabled_reason: str | None = None
        self._said_unreplayed = False

    def __call__(self, args: list[Any]) -> list[Any]:
        self.calls += 1
        if self.disabled_reason is not None or self.calls == 1:
            return list(self.fn(args))
        if self._previous_outputs_alive():
            if not self._said_unreplayed:
                log.info("erase_fx %s: forward called again while the last replay's saved "
                         "tensors are alive (backward not run yet): running without the CUDA "
                         "graph for such calls", self.name)
                self._said_unreplayed = True
            return list(self.fn(args))
        if self.graph is None or self._static_inputs_moved(args):
            self._capture(args)
            if self.graph is None:
                return list(self.fn(args))
        else:
            self._copy_inputs(args)
        args.clear()
        self.graph.replay()
        self.replays += 1
        self.awaiting_backward = True
        return self._outputs()

    # -- capture and replay ---------------------------------------------------

    def _capture(self, args: list[Any]) -> None:
        self.static_inputs = [
            a if (i in self.static_input_indices or not isinstance(a, torch.Tensor)) else a.clone()
            for i, a in enumerate(args)
        ]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                outputs = self.fn(list(self.static_inputs))
        except Exception as error:  # noqa: BLE001 - replay is an optimisation; run without it
            self.disabled_reason = f"capture failed: {type(error).__name__}: {error}"
            log.warning("erase_fx %s: CUDA graph %s; running without it", self.name,
                        self.disabled_reason)
            self.graph = None
            return
        self.graph = graph
        self.static_outputs = list(outputs)
        # NB: saved tensors that are parameters are never overwritten by a
        # replay; the others (activations, input buffers) are.
        parameters = {self.static_inputs[i].untyped_storage().data_ptr()
                      for i in self.static_input_indices if i < len(self.static_inputs)}
        saved = [o for o in self.static_outputs[self.num_user_outputs:]
                 if isinstance(o, torch.Tensor)
                 and o.untyped_storage().data_ptr() not in parameters]
        self.baseline_uses = [(o, _storage_uses(o)) for o in saved]
        if self.backward is not None:
            self.backward.reset()

    def _static_inputs_moved(self, args: list[Any]) -> bool:
        for i in self.static_input_indices:
            if i < len(args) and args[i].data_ptr() != self.static_inputs[i].data_ptr():
                return True
        return False

    def _copy_inputs(self, args: list[Any]) -> None:
        for arg, static in zip(args, self.static_inputs):
            if isinstance(arg, torch.Tensor) and arg.data_ptr() != static.data_ptr():
                static.copy_(arg)

    def _outputs(self) -> list[Any]:
        user = [
            o.clone() if isinstance(o, torch.Tensor) else o
            for o in self.static_outputs[: self.num_user_outputs]
        ]
        saved = [
            o.detach() if isinstance(o, torch.Tensor) else o
            for o in self.static_outputs[self.num_user_outputs:]
        ]
        return user + saved

    def _previous_outputs_alive(self) -> bool:
        """Whether replaying now could overwrite tensors the last replay's backward needs."""
        if not self.awaiting_backward:
            return False
        # NB: no backward yet; if the autograd graph was dropped (a forward
        # without backward), nothing holds the saved tensors any more.
        alive = any(_storage_uses(t) > uses for t, uses in self.baseline_uses)
        self.awaiting_backward = alive
        return alive

    def backward_done(self, retained: bool) -> None:
        """The last replay's backward ran (``retained``: it may run again)."""
        self.awaiting_backward = retained

    def saved_pointers(self) -> list[int]:
        return [o.data_ptr() for o in self.static_outputs[self.num_user_outputs:]
                if isinstance(o, torch.Tensor)]


class GraphedBackward:
    """A compiled backward replayed from a CUDA graph; see the module docstring."""

    def __init__(self, fn: BoxedCallable, forward: GraphedForward, num_saved: int, name: str):
        # NB: an instance attribute: wrappers such as torch._dynamo.disable copy
        # the instance __dict__, not class attributes, and AOT reads this flag.
        self._boxed_call = True
        self.fn = fn
        self.forward = forward
        self.num_saved = num_saved
        self.name = name
        self.replays = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: list[Any] = []
        self.static_outputs: list[Any] = []
        self.disabled_reason: str | None = None
        forward.backward = self

    def reset(self) -> None:
        """The forward was captured again: its saved tensors moved."""
        self.graph = None

    def __call__(self, args: list[Any]) -> Any:
        if self.disabled_reason is not None or not self._reads_forward_replay(args):
            return self.fn(args)
        if self.graph is None:
            self._capture(args)
            if self.graph is None:
                return self.fn(args)
        else:
            for arg, static in zip(args[self.num_saved:], self.static_inputs[self.num_saved:]):
                if isinstance(arg, torch.Tensor):
                    static.copy_(arg)
        args.clear()
        self.graph.replay()
        self.replays += 1
        self.forward.backward_done(torch._C._autograd._get_current_graph_task_keep_graph())
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in self.static_outputs]

    def _reads_forward_replay(self, args: list[Any]) -> bool:
        if self.forward.graph is None or self.forward.replays == 0:
            return False
        saved = [a.data_ptr() for a in args[: self.num_saved] if isinstance(a, torch.Tensor)]
        return saved == self.forward.saved_pointers()

    def _capture(self, args: list[Any]) -> None:
        # NB: saved tensors stay where the forward graph writes them (its
        # static outputs keep that memory); only the tangents get buffers.
        # Holding the saved tensors here would keep the forward's replay
        # "alive" forever.
        tangents = [a.clone() if isinstance(a, torch.Tensor) else a for a in args[self.num_saved:]]
        self.static_inputs = [None] * self.num_saved + tangents
        graph = torch.cuda.CUDAGraph()
        try:
            # warm-up of the backward happens in the forward's first (uncaptured) step
            with torch.cuda.graph(graph):
                outputs = self.fn(list(args[: self.num_saved]) + tangents)
        except Exception as error:  # noqa: BLE001 - replay is an optimisation; run without it
            self.disabled_reason = f"capture failed: {type(error).__name__}: {error}"
            log.warning("erase_fx %s: backward CUDA graph %s; running without it", self.name,
                        self.disabled_reason)
            return
        self.graph = graph
        self.static_outputs = list(outputs)


def _storage_uses(tensor: torch.Tensor) -> int:
    """How many tensors share this tensor's memory (torch's cudagraph trees count the same way)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
