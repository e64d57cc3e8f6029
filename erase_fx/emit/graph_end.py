"""Blocks at the graph's end: run when the forward ends, or in the backward when it comes.

A block whose backward is ready only when its graph's forward ends (the last
block of a chain; every block, when graph breaks put each in a graph of its
own), in a graph that more of the user's forward follows (Dynamo ended it at a
graph break, or its caller is another module's forward that runs uncompiled:
`erase_fx.backend.more_forward_follows`), runs there, on its side stream, and
the main stream does not wait for it: it returns, and what follows the graph (the next graphs' forwards, in a
model Dynamo split) runs while the block's backward does. The backward waits
for it (`GraphEndBackward`), scales its gradients and hands them over, as for
every early block. That is ERASE at the granularity of graphs.

A forward whose backward never comes (a metric computed with grad enabled)
must not pay for a backward every step. So the program learns it: it starts
*armed* (blocks at the graph's end run at the forward's end); the backend
watches each forward's autograd node (`GraphEnd.watch`), and if one is freed
before its backward ran, that forward's work at the graph's end was wasted:
the program disarms for good (logged once). Disarmed, a forward does not run
those blocks; it keeps their inputs (`_Stash`) and hands the backward a
marker instead of their gradients, and the backward runs them then, from
what was kept, before its own graph. The same kernels run either way, so
the gradients are the same; disarmed, the inputs live until the backward as
the graph's saved tensors did before the block ran early, and a forward with
no backward frees them with its autograd graph.

Under CUDA graph capture (erase's own, or a whole step's) the blocks run
armed and are joined at the forward's end: a capture records what runs, and
must end with every stream it forked joined. Outside capture each step's
inputs are marked as used by its stream (``record_stream``) and the
gradients as used by the main stream, so the caching allocator hands their
memory out again only once the streams that read them are done.
"""
from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from erase_fx.emit.inner import Boxed, stream_capturing

log = logging.getLogger("erase_fx")


class _Stash:
    """A disarmed forward's inputs of its graph-end steps, kept for its backward."""

    def __init__(self, values: dict[int, Any]):
        self.values = values


class GraphEnd:
    """The state of one compiled forward's blocks at the graph's end.

    Attributes:
        name: the graph's name, for the log.
        armed: run them at the forward's end (True) or leave them to the backward.
        disarmed_reason: why it disarmed, or None.
        pending: events after the graph-end work launched by forwards whose backward has
            not waited for it yet.
    """

    def __init__(self, name: str):
        self.name = name
        self.armed = True
        self.disarmed_reason: str | None = None
        self.pending: list[Any] = []
        self._stashes: dict[int, tuple[Any, _Stash]] = {}

    # -- the forward ------------------------------------------------------------

    def stash(self, values: dict[int, Any], device: torch.device | None) -> torch.Tensor:
        """Keep ``values`` for the backward; the marker the forward returns in place of the
        gradients, by which the backward finds them (freed with it)."""
        marker = torch.empty(0, device=device)
        key = id(marker)
        self._stashes[key] = (weakref.ref(marker), _Stash(values))
        weakref.finalize(marker, self._stashes.pop, key, None)
        return marker

    def stashed(self, value: Any) -> _Stash | None:
        """The stash ``value`` is the marker of, or None (a real gradient)."""
        if not isinstance(value, torch.Tensor) or value.numel() != 0:
            return None
        entry = self._stashes.get(id(value))
        if entry is None or entry[0]() is not value:
            return None
        return entry[1]

    # -- learning whether the backward comes ------------------------------------------

    def watch(self, outputs: Any) -> None:
        """Watch one armed forward's autograd node: freed before its backward ran, the
        forward's graph-end work was wasted, and the program disarms.

        NB: not a forward run under CUDA graph capture: a capture runs the blocks armed
        whatever this says, and a capture that fails partway (a host sync later in the
        step, which makes `erase_fx.compile_step` run the step as written) frees the
        forward's graph without a backward: not the user's pattern, and disarmed, the
        uncaptured steps after it would leave the blocks to the backward and lose erase's
        own CUDA graph of the forward (`erase_fx.emit.cudagraphs`)."""
        if not self.armed or stream_capturing():
            return
        values = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
        node = next((v.grad_fn for v in values
                     if isinstance(v, torch.Tensor) and v.grad_fn is not None), None)
        if node is None:
            self.disarm("the graph returns nothing to differentiate: no backward can come")
            return
        came = [False]
        node.register_prehook(functools.partial(_backward_came, came))
        weakref.finalize(node, self._freed, came)

    def _freed(self, came: list[bool]) -> None:
        if not came[0]:
            self.disarm("a forward's autograd graph was freed without a backward (a forward "
                        "run for its values alone, with grad enabled)")

    def disarm(self, reason: str) -> None:
        """Leave the blocks at the graph's end to the backward from now on."""
        if not self.armed:
            return
        self.armed = False
        self.disarmed_reason = reason
        log.info("erase_fx %s: the blocks at the graph's end run in the backward from now on: "
                 "%s", self.name, reason)


@torch._dynamo.disable
def _backward_came(came: list[bool], grad_outputs: Any) -> None:
    """A watched forward's pre-hook: its backward came. NB: untraced when a backward runs
    inside a compiled frame (as `BackwardGuard`'s hook), and wrapped once, not per forward."""
    came[0] = True


class GraphEndBackward(Boxed):
    """A compiled backward that first waits for the blocks at its forward's end, or runs them.

    ``gradients``: the backward's argument positions of the values those blocks make (their
    early gradients and gradient parts), with the program's result index each is;
    ``run_stashed(stash)`` runs the blocks on a disarmed forward's kept inputs and returns
    their results by result index.
    """

    def __init__(self, fn: Callable[[list[Any]], Any], graph_end: GraphEnd,
                 gradients: Sequence[tuple[int, int]],
                 run_stashed: Callable[[_Stash], dict[int, Any]],
                 wait: Callable[[Sequence[Any]], None]):
        super().__init__()
        self.fn = fn
        self.graph_end = graph_end
        self.gradients = tuple(gradients)
        self.run_stashed = run_stashed
        self.wait = wait

    def __call__(self, args: list[Any]) -> Any:
        if stream_capturing():
            # NB: captured, this backward is a captured or replayed forward's, which joined
            # its blocks at its end: nothing to wait for, and waiting under capture on an
            # event recorded outside it is an error. The pending events are those of
            # forwards run without a graph, for their own backwards (or never: one whose
            # backward did not come disarmed the program).
            return self.fn(args)
        pending, self.graph_end.pending = self.graph_end.pending, []
        if pending:
            self.wait(pending)
        # NB: only a disarmed program stashes (and it never arms again)
        stash = None if self.graph_end.armed else next(
            (s for s in (self.graph_end.stashed(args[i]) for i, _ in self.gradients)
             if s is not None), None)
        if stash is not None:
            values = self.run_stashed(stash)
            for position, result in self.gradients:
                args[position] = values[result]
        return self.fn(args)
