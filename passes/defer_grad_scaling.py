"""defer_grad_scaling: return early gradients unscaled, with their scales beside them.

What: in the backward module, every early gradient leaves as
``mul(early_grad, scale)`` (``scale`` = ``T / seed``, tagged ``GRAD_SCALE`` by
schedule_early_backward), where ``early_grad`` is a saved tensor of the
forward, or a view of one. This pass returns ``early_grad`` itself in that
output slot and appends each distinct ``scale`` to the outputs, so the
runtime (`erase_fx.emit.scale_grads.ScaledBackward`) can apply the scale in
place, and skip it on the device when the scale is 1.

Why: the multiplication reads and writes every early gradient once per step
(for the benchmark chains, hundreds of MB) on the critical path at the end of
the step, although with a plain ``loss.backward()`` (T == seed == 1) it
changes nothing. The tangent's value is known only on the device, so the
skip must be decided there.

When a gradient is left scaled in the graph: when ``early_grad`` (or a tensor
it is a view of) has another user in the backward, or when it is not reached
from a saved tensor through views alone. Those outputs keep the ``mul``.

Invariants in: a backward module whose GRAD_SCALE nodes read a scale that
depends on tangents only (and on the saved copy of a learned seed,
``Role.LOSS_SEED``). Invariants out (`check_deferred_scaling`): a new
module (the input untouched) with the same inputs; its first
``num_grads`` outputs are the gradients, then the scales; each deferred
gradient is a saved placeholder or a view chain of one, used by nothing else;
no deferred GRAD_SCALE node is left. The result's artifact, `DeferredScaling`,
says which outputs are scales of which gradients; with nothing to defer the
pass returns its input, unmodified.

Before::

    mul_tensor = mul(t_65, tangents_1)
    mul_tensor_1 = mul(view_13, tangents_1)
    return (mm_3, mul_tensor, mul_tensor_1)

After::

    return (mm_3, t_65, view_13, tangents_1)     # artifact: DeferredScaling(3, scaled=(...))
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from erase_fx.errors import GraphInvariantError
from erase_fx.passes.graph import aten, clone_module, is_tangent, output_node, output_values
from erase_fx.passes.node_meta import Role, get_meta
from erase_fx.passes.pass_result import DumpFile, PassContext, PassResult, graph_text

PASS_NAME = "defer_grad_scaling"

#: Ops that return a view of their first argument (no new memory).
VIEW_OPS = frozenset({
    aten.t.default, aten.view.default, aten._unsafe_view.default, aten.permute.default,
    aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.alias.default, aten.detach.default,
})


@dataclasses.dataclass(frozen=True)
class ScaledGrad:
    """Gradient output ``grad_index`` must be multiplied by extra output ``scale_index``.

    ``saved_index`` is the backward input (a saved tensor) whose memory the
    gradient lives in: the only input that may share that memory.
    """

    grad_index: int
    scale_index: int
    saved_index: int


@dataclasses.dataclass(frozen=True)
class DeferredScaling:
    """What the rewritten backward's outputs mean: ``num_grads`` gradients, then the scales
    of the ``scaled`` ones, returned unscaled."""

    num_grads: int
    scaled: tuple[ScaledGrad, ...]

    def render(self, gm: fx.GraphModule) -> tuple[DumpFile, ...]:
        return (DumpFile(".py", f"the backward as compiled: {self.num_grads} gradients, then "
                         f"the scales of the {len(self.scaled)} early ones returned unscaled",
                         graph_text(gm)),)


def defer_grad_scaling(bw: fx.GraphModule, ctx: PassContext) -> PassResult[DeferredScaling]:
    """Return early gradients unscaled plus their scales; see the module docstring.

    Reads nothing from ``ctx``. The pipeline checks the result with `check_deferred_scaling`.
    """
    num_grads = len(output_values(bw.graph))
    gm, _ = clone_module(bw)
    graph = gm.graph
    out = output_node(graph)
    outputs = output_values(graph)
    placeholder_index = {n: i for i, n in enumerate(graph.find_nodes(op="placeholder"))}

    scales: list[fx.Node] = []
    scaled: list[ScaledGrad] = []
    for grad_index, value in enumerate(outputs):
        meta = get_meta(value) if isinstance(value, fx.Node) else None
        if meta is None or meta.role is not Role.GRAD_SCALE or value.target is not aten.mul.Tensor:
            continue
        early_grad, scale = value.args
        saved = _saved_root(early_grad, value)
        if saved is None or not isinstance(scale, fx.Node):
            continue
        if scale not in scales:
            scales.append(scale)
        outputs[grad_index] = early_grad
        scaled.append(ScaledGrad(grad_index, scales.index(scale), placeholder_index[saved]))

    if not scaled:
        return PassResult(bw, modified=False, artifact=DeferredScaling(num_grads, ()))
    out.args = (tuple(outputs) + tuple(scales),)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return PassResult(gm, modified=True, artifact=DeferredScaling(num_grads, tuple(scaled)))


def _saved_root(node: fx.Node, consumer: fx.Node) -> fx.Node | None:
    """The saved placeholder ``node`` is a view chain of, if the chain feeds only ``consumer``."""
    while True:
        if len(node.users) != 1 or consumer not in node.users:
            return None
        if node.op == "placeholder":
            return None if is_tangent(node) else node
        if node.op != "call_function" or node.target not in VIEW_OPS:
            return None
        node, consumer = node.args[0], node


def check_deferred_scaling(result: PassResult[DeferredScaling], ctx: PassContext) -> None:
    """Invariants of the rewritten backward; raises GraphInvariantError."""
    graph = result.gm.graph
    deferred = result.artifact
    outputs = output_values(graph)
    num_scales = len(outputs) - deferred.num_grads
    if num_scales < 1 and deferred.scaled:
        raise GraphInvariantError(PASS_NAME, "deferred gradients but no scale outputs")
    placeholders = list(graph.find_nodes(op="placeholder"))
    for entry in deferred.scaled:
        grad = outputs[entry.grad_index]
        if not 0 <= entry.scale_index < num_scales:
            raise GraphInvariantError(PASS_NAME, f"scale index {entry.scale_index} out of range")
        scale = outputs[deferred.num_grads + entry.scale_index]
        if isinstance(scale, fx.Node) and not _reads_only_tangents(scale):
            raise GraphInvariantError(PASS_NAME, "a scale reads a saved tensor", node=scale.name)
        root = grad
        while isinstance(root, fx.Node) and root.op == "call_function":
            if root.target not in VIEW_OPS:
                raise GraphInvariantError(PASS_NAME, "a deferred gradient is not a view of a "
                                          "saved tensor", node=grad.name)
            root = root.args[0]
        if root is not placeholders[entry.saved_index]:
            raise GraphInvariantError(PASS_NAME, "a deferred gradient's saved tensor is wrong",
                                      node=getattr(grad, "name", None))


def _reads_only_tangents(node: fx.Node) -> bool:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder" and not is_tangent(current) and not _is_seed(current):
            return False
        stack.extend(current.all_input_nodes)
    return True


def _is_seed(node: fx.Node) -> bool:
    """Whether a backward placeholder is the forward's copy of a learned loss seed, which a
    scale divides ``T`` by (`erase_fx.emit.loss_seed`)."""
    meta = get_meta(node)
    return meta is not None and meta.role is Role.LOSS_SEED
