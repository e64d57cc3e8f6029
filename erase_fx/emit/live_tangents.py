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

The same pre-hook watches each early block's loss (`WatchedLoss`): a loss
that gets no gradient (a one-element value kept with grad only to be logged,
``self.norm = h.norm()``, or local losses returned beside a total that is not
the one differentiated) had its block's backward run in the forward for
nothing. The gradients stay exact (that work is scaled by the zero
gradient), but the time is lost at every such step; a warning says so once
per graph, with the loss named where the user's code makes it and the fix.

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

import dataclasses
import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from erase_fx.emit.inner import Boxed

log = logging.getLogger(__name__)


def plain_outputs(joint: fx.GraphModule) -> dict[str, int]:
    """Each tangent (a joint-graph placeholder, by name) that is a plain user output's
    gradient: that output's index in the compiled graph, from AOTAutograd's descriptors."""
    from torch._functorch._aot_autograd.descriptors import PlainAOTOutput

    found = {}
    for node in joint.graph.find_nodes(op="placeholder"):
        output = getattr(node.meta.get("desc"), "output", None)
        if isinstance(output, PlainAOTOutput):
            found[node.name] = output.idx
    return found


def node_of_outputs(outputs: Any, indices: Sequence[int]) -> tuple[Any, tuple[int, ...]] | None:
    """The autograd node that makes the compiled graph's ``outputs`` at ``indices``, and
    the position of each among its outputs (``output_nr``: where a pre-hook's
    ``grad_outputs`` holds its gradient); None where there are none, or they are not
    all tensors made by one node (one does not require grad, autograd regenerated it)."""
    values = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
    if not indices or max(indices) >= len(values):
        return None
    watched = [values[i] for i in indices]
    if not all(isinstance(v, torch.Tensor) and v.grad_fn is not None for v in watched):
        return None
    node = watched[0].grad_fn
    if any(v.grad_fn is not node for v in watched):
        return None
    return node, tuple(v.output_nr for v in watched)


@dataclasses.dataclass(frozen=True)
class WatchedLoss:
    """An early block's loss, an output of the compiled graph.

    Attributes:
        output: its index among the compiled graph's outputs.
        block: the block's id.
        name: the output, named with where the user's code makes it.
    """

    output: int
    block: int
    name: str


class LiveTangents:
    """Whether any watched output of the running backward's forward got a gradient, and
    whether the early blocks' losses did (a warning, once, where one did not).

    Attributes:
        outputs: the indices, among the compiled graph's outputs, of the watched
            outputs (those whose gradients the specialized backward takes as zero).
        losses: the early blocks' losses watched until one is found without a gradient.
        graph: the graph's name, for the warning.
    """

    def __init__(self, outputs: Sequence[int], losses: Sequence[WatchedLoss] = (),
                 graph: str = "graph"):
        self.outputs = tuple(outputs)
        self.losses = tuple(losses)
        self.graph = graph
        #: the losses the warning named (set once, on the autograd engine's thread)
        self.unused_losses: tuple[WatchedLoss, ...] = ()
        # NB: autograd runs a node's pre-hooks and then the node on one thread; several
        # backwards of one graph may run at once on different threads (one per device).
        self._seen = threading.local()
        # NB: untraced when a backward runs inside a compiled frame (as `BackwardGuard`'s
        # hook); wrapped once, each forward's hook is this with its positions bound
        self._record = torch._dynamo.disable(self._record_live)

    def watch(self, outputs: Any) -> None:
        """Hook the autograd node of one forward's ``outputs`` (the compiled graph's)."""
        losses = () if self.unused_losses else self.losses
        found = node_of_outputs(outputs, self.outputs + tuple(loss.output for loss in losses))
        if found is None:
            return
        node, positions = found
        split = len(self.outputs)
        node.register_prehook(functools.partial(
            self._record, positions[:split], tuple(zip(losses, positions[split:]))))

    def _record_live(self, positions: tuple[int, ...],
                     losses: tuple[tuple[WatchedLoss, int], ...],
                     grad_outputs: Sequence[Any]) -> None:
        if positions:
            self._seen.live = any(grad_outputs[p] is not None for p in positions)
        unused = tuple(loss for loss, p in losses if grad_outputs[p] is None)
        if unused and not self.unused_losses:
            self.unused_losses = unused
            log.warning(
                "erase_fx %s: %s got no gradient at this backward, so the early backward of "
                "%s ran in the forward for nothing (the gradients are exact: that work is "
                "scaled by zero). If such a value is only logged, compute it from a detached "
                "tensor (h.detach().norm()) or under torch.no_grad(); a loss differentiated "
                "only at some steps costs this at the others.",
                self.graph, "; ".join(loss.name for loss in unused),
                ", ".join(f"block {loss.block}" for loss in unused))

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
