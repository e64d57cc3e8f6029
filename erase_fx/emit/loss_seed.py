"""A float16 graph's loss seed, learned from the loss gradient of the last backward.

An early block's backward runs in the forward, before its loss gradient ``T``
is known, at a seed ``s``; the backward then scales its gradients by ``T / s``
(`passes.schedule_early_backward`). In float32 and bfloat16, ``s = 1`` is exact
up to rounding whatever ``T`` is. In float16 it is not: under a loss scaler
(``torch.amp.GradScaler``, ``T`` = its scale, 65536 at the start) gradients
computed at 1 underflow where those computed at ``T`` do not. So a graph that
computes in float16, with no ``seed`` option, runs its early blocks at the
loss gradient its last backward got:

- the backend adds one input to Dynamo's graph (`add_seed_input`): a 0-d
  float32 tensor the program owns (`LossSeed.value`), passed at every call;
- the forward copies it once (the copy is saved for the backward:
  ``Role.LOSS_SEED``), runs each early block at that copy, and the backward
  divides ``T`` by the same copy. A forward and its backward always agree
  on ``s``, whatever other forwards and backwards run in between;
- a pre-hook on the autograd node of each forward's outputs reads the
  gradients of the blocks' losses before the backward runs (`LossSeed.watch`)
  and sets the seed to the largest of them, where it is finite and not 0:
  on the device, with no host sync.

In steady state ``T / s`` is exactly 1 and the gradients are bitwise those of
the stock backend. When the scaler changes its scale, one step runs at the
previous one: after a growth (``T = 2 s``) the result is the same up to
float16's denormals; after a backoff the early copy runs at the scale that
overflowed, and likely overflows again, so the scaler skips one more step and
halves once more than it would have. A graph whose seed is not known yet (no
backward has reached its losses) runs as torch's ``aot_eager`` backend
compiles it (`UntilSeeded`): eager's kernels, exact as eager, and a compile
that costs one trace, not a second code generation, for the one step it runs.

Under DistributedDataParallel every rank learns the same seed (the scaler's
scale is the same on every rank) and switches at the same step. Not built:
early optimizer updates, which need ``T / s == 1`` proven at compile time.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from erase_fx.emit.inner import stream_capturing
from erase_fx.emit.live_tangents import node_of_outputs

#: The name of the placeholder `add_seed_input` adds to Dynamo's graph.
SEED_INPUT = "erase_fx_loss_seed"


def computes_in_float16(gm: fx.GraphModule) -> bool:
    """Whether some value of Dynamo's graph is float16 (an autocast region included:
    Dynamo's example values carry the dtype each op computes in)."""
    return any(getattr(node.meta.get("example_value"), "dtype", None) == torch.float16
               for node in gm.graph.nodes)


class LossSeed:
    """The seed one compiled graph runs its early blocks at, learned from its losses.

    Attributes:
        value: the seed, a 0-d float32 tensor on the graph's device (1 until learned),
            updated in place, so its memory is the same at every call (a CUDA graph
            reads it where it is).
        known: whether a backward has reached the blocks' losses since the graph was
            compiled (before that, `UntilSeeded` runs the graph as ``aot_eager`` does).
        losses: the indices, among the compiled graph's outputs, of the blocks' losses
            (set once the blocks are found); the seed is learned from their gradients.
    """

    def __init__(self, device: torch.device):
        self.value = torch.ones((), dtype=torch.float32, device=device)
        self.known = False
        self.losses: tuple[int, ...] = ()
        # NB: untraced when a backward runs inside a compiled frame, as LiveTangents' hook
        self._learn = torch._dynamo.disable(self._learn_from)

    def watch(self, outputs: Any) -> None:
        """Hook the autograd node of one forward's ``outputs`` (the compiled graph's) to
        learn the seed from its losses' gradients. Where a loss is not an output of that
        node (none requires grad, or autograd regenerated it), nothing is learned from
        this forward: its backward leaves the seed as it is."""
        found = node_of_outputs(outputs, self.losses)
        if found is not None:
            node, positions = found
            node.register_prehook(functools.partial(self._learn, positions))

    def _learn_from(self, positions: tuple[int, ...], grad_outputs: Sequence[Any]) -> None:
        grads = [grad_outputs[p] for p in positions if grad_outputs[p] is not None]
        if not grads:
            return
        with torch.no_grad():
            largest = functools.reduce(torch.maximum, (
                torch.linalg.vector_norm(g.detach(), math.inf, dtype=torch.float32)
                for g in grads))
            # NB: NaN compares false: kept, as inf and 0 are
            usable = (largest > 0) & (largest < math.inf)
            torch.where(usable, largest, self.value, out=self.value)
        self.known = True


def add_seed_input(gm: fx.GraphModule, example_inputs: Sequence[Any],
                   seed: LossSeed) -> list[Any]:
    """Add the seed's placeholder to Dynamo's graph ``gm`` (in place, last), and return
    the example inputs with the seed's fake value after them.

    NB: AOTAutograd reads Dynamo's metadata from each placeholder (torch 2.11-2.14,
    ``_try_get_metadata_from_dynamo``): ``_dynamo_source`` (None: no user source, as for
    the placeholders Dynamo's DDP optimizer adds) and ``tensor_dict``'s
    ``_dynamo_static_input_type``, which makes the seed a static input (its memory is
    the same at every call: a CUDA graph reads it in place). tests/test_loss_seed.py
    pins both.
    """
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(example_inputs)
    fake = fake_mode.from_tensor(seed.value, static_shapes=True) if fake_mode else seed.value
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    where = (gm.graph.inserting_after(placeholders[-1]) if placeholders
             else gm.graph.inserting_before(next(iter(gm.graph.nodes))))
    with where:
        node = gm.graph.placeholder(SEED_INPUT)
    node.meta["example_value"] = fake
    node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
    node._dynamo_source = None
    gm.recompile()
    return [*example_inputs, fake]


def with_seed(compiled: Callable[..., Any], seed: LossSeed) -> Callable[..., Any]:
    """``compiled`` (Dynamo's calling convention), called with the seed after the graph's
    own inputs."""

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        return compiled(*args, seed.value)

    return run


class UntilSeeded:
    """A float16 graph's stock compilation until its seed is learned, then erase's.

    NB: erase's program is not run for the first time under CUDA graph capture (a
    `erase_fx.compile_step` with ``warmup=1``, whose one warm-up ran the stock
    compilation): its backward, compiled at its first run, would compile inside the
    capture. That capture records the stock compilation; the default two warm-ups run
    erase's before it.

    Attributes:
        erase: erase's compiled function, the seed passed (`with_seed`).
        stock: a stock backend's compiled function for the same graph (``aot_eager``,
            which runs once, or the inner compiler's where the seed cannot be learned).
        seed: the graph's `LossSeed`; each stock forward is watched to learn it.
    """

    def __init__(self, erase: Callable[..., Any], stock: Callable[..., Any], seed: LossSeed):
        self.erase = erase
        self.stock = stock
        self.seed = seed
        self._erase_ran = False

    def __call__(self, *args: Any) -> Any:
        if self.seed.known and (self._erase_ran or not stream_capturing()):
            self._erase_ran = True
            return self.erase(*args)
        outputs = self.stock(*args)
        self.seed.watch(outputs)
        return outputs
