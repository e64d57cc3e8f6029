"""Which outputs got a gradient: the backward that runs depends on it, with no host sync.

An early block that reads the gradients of other outputs besides its loss
(a tensor kept for logging, an activation captured by a forward hook) leaves
those outputs' part of its gradients in the backward
(`passes.schedule_early_backward`). When none of them gets a gradient at
``.backward()`` (the usual case), that part is all zeros; erase_fx then runs
a backward compiled without it (`passes.specialize_unused_tangents`).

Whether an output got a gradient is known, before the backward runs, to the
autograd node AOTAutograd makes for the compiled graph: a pre-hook on it sees
``None`` where no gradient arrived (autograd materializes the zeros later,
when it calls the node). `LiveTangents.watch` registers that pre-hook on each
forward's outputs; `SelectedBackward` reads what it saw and runs the
specialized backward or the whole one. Nothing reads the device.

NB: torch internals relied on (tests/test_tangent_split.py fails if one stops
holding: it checks that the specialized backward runs): every output of one
compiled graph has AOTAutograd's node as its ``grad_fn`` (AOTAutograd
regenerates only outputs that alias inputs or other outputs outside it:
those are never watched), the hook's ``grad_outputs`` are indexed by
``Tensor.output_nr``, and an output index is the joint graph's
``PlainAOTOutput.idx`` of its tangent. Where any of that does not hold for a
call, the whole backward runs: exact either way.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from erase_fx.emit.inner import Boxed


def output_indices(joint: fx.GraphModule, tangents: Sequence[str]) -> tuple[int, ...] | None:
    """The compiled graph's output index of each of ``tangents`` (joint-graph placeholder
    names), from AOTAutograd's descriptors; None unless each is a plain user output's."""
    from torch._functorch._aot_autograd.descriptors import PlainAOTOutput

    found = {}
    for node in joint.graph.find_nodes(op="placeholder"):
        output = getattr(node.meta.get("desc"), "output", None)
        if node.name in tangents and isinstance(output, PlainAOTOutput):
            found[node.name] = output.idx
    if len(found) != len(set(tangents)):
        return None
    return tuple(sorted(found.values()))


class LiveTangents:
    """Whether any watched output of the running backward's forward got a gradient.

    Attributes:
        outputs: the indices, among the compiled graph's outputs, of the watched
            outputs (those whose gradients the specialized backward takes as zero).
    """

    def __init__(self, outputs: Sequence[int]):
        self.outputs = tuple(outputs)
        # NB: autograd runs a node's pre-hooks and then the node on one thread; several
        # backwards of one graph may run at once on different threads (one per device).
        self._seen = threading.local()
        # NB: untraced when a backward runs inside a compiled frame (as `BackwardGuard`'s
        # hook); wrapped once, each forward's hook is this with its positions bound
        self._record = torch._dynamo.disable(self._record_live)

    def watch(self, outputs: Any) -> None:
        """Hook the autograd node of one forward's ``outputs`` (the compiled graph's)."""
        values = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
        watched = [values[i] for i in self.outputs if i < len(values)]
        if len(watched) != len(self.outputs) or not all(
                isinstance(v, torch.Tensor) and v.grad_fn is not None for v in watched):
            return
        node = watched[0].grad_fn
        if any(v.grad_fn is not node for v in watched):
            return
        positions = tuple(v.output_nr for v in watched)
        node.register_prehook(functools.partial(self._record, positions))

    def _record_live(self, positions: tuple[int, ...], grad_outputs: Sequence[Any]) -> None:
        self._seen.live = any(grad_outputs[p] is not None for p in positions)

    def take(self) -> bool | None:
        """What the pre-hook saw for the node about to run on this thread (True: some
        watched output got a gradient; None: unknown), forgotten once read."""
        live = getattr(self._seen, "live", None)
        self._seen.live = None
        return live


class SelectedBackward(Boxed):
    """The backward specialized for unused outputs (``lean``) when `LiveTangents` saw none
    of them get a gradient, else the whole one (``whole``)."""

    def __init__(self, lean: Any, whole: Any, live: LiveTangents):
        super().__init__()
        self.lean = lean
        self.whole = whole
        self.live = live

    def __call__(self, args: list[Any]) -> Any:
        if self.live.take() is False:
            return self.lean(args)
        return self.whole(args)
