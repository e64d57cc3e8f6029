"""schedule_early_backward: move each early block's backward into the forward.

What: rewrites the joint graph so that each early block's backward is cloned
right after the block's ready point, with its loss tangent ``T`` replaced by
the constant seed ``s`` (``cfg.early_seed``, 1 by default; a tensor of the tangent's shape,
0-d or ``[1]``), and so that the
gradients it produces leave the backward as ``T / s * early_grad``.

A float16 graph's seed is learned instead (`erase_fx.emit.loss_seed`): an input of
the graph (``seed_input``), copied once in the forward (``Role.LOSS_SEED``); the
early copies run at that copy, and ``T`` is divided by it.

Why it is exact: the backward is linear in the tangent (checked op by op by
find_stop_gradient_blocks), so the gradient computed with seed ``s`` times
``T / s`` equals the gradient computed with ``T``. Nothing is written to
``.grad`` before ``.backward()`` runs: the early gradients are saved tensors
of the forward, scaled and returned by the backward. Forward without
backward, several forwards before one backward, ``no_grad`` and DDP hooks
keep eager semantics.

Invariants in: a joint graph and the `BlockAnalysis` of that same graph.
Invariants out (`check_early_schedule`): a new GraphModule (the input is not
touched) with the same inputs and the same number of outputs; every early
node reads no tangent, directly or not; every early gradient output is
``mul(early_grad, scale)`` where ``scale`` reads the block's tangent; each
early node is tagged ``NodeMeta(EARLY_BACKWARD, block)`` and, for the
gradient it produces, ``grad_of``; each ``mul`` is tagged
``NodeMeta(GRAD_SCALE, block, grad_of)`` (`defer_grad_scaling` finds it in
the backward by that tag). A block split from a larger backward
(``Component.partials``: the parts of gradients that sums in the backward
add up, see find_stop_gradient_blocks) hands each part to those sums as
``mul(early_part, scale)``, tagged ``NodeMeta(PARTIAL_SCALE, block)``.

Before::

    addmm_1 = addmm(...)                          # block 0's ready point
    ...rest of the forward...
    expand = expand(tangents_1, [4, 4])
    mse_loss_backward = mse_loss_backward(expand, addmm_1, y)
    mm_1 = mm(t_1, mse_loss_backward) ...
    return (add, mm_1, ...)

After::

    addmm_1 = addmm(...)
    full = full([], 1.0)                          # block 0, seed
    expand_1 = expand(full, [4, 4])               # block 0
    mse_loss_backward_1 = mse_loss_backward(expand_1, addmm_1, y)
    mm_2 = mm(t_2, mse_loss_backward_1)           # block 0, grad_of=0
    ...rest of the forward...
    mul = mul(mm_2, tangents_1)
    return (add, mul, ...)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from erase_fx.errors import GraphInvariantError
from erase_fx.passes.find_stop_gradient_blocks import PASS_NAME as FIND_BLOCKS
from erase_fx.passes.find_stop_gradient_blocks import Block, BlockAnalysis
from erase_fx.passes.graph import (
    aten,
    call_with_val,
    clone_module,
    fake_mode_of,
    is_tangent,
    output_node,
    upstream_of_seed,
    val_of,
)
from erase_fx.passes.node_meta import NodeMeta, Role, get_meta, set_meta
from erase_fx.passes.pass_result import PassContext, PassResult
from erase_fx.passes.zero_folding import ZERO, copy_folding_zeros

PASS_NAME = "schedule_early_backward"


def schedule_early_backward(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Clone each early block's backward after its ready point; see the module docstring.

    Reads ``ctx.cfg.early_seed``, or, given, ``seed_input`` (the placeholder of a learned
    seed: `_seed_copy`), and the `BlockAnalysis` of find_stop_gradient_blocks
    (``ctx.artifact``). The pipeline checks the result with `check_early_schedule`.
    """
    analysis: BlockAnalysis = ctx.artifact(FIND_BLOCKS)
    if not analysis.blocks:
        return PassResult(gm, modified=False)
    new_gm, _ = clone_module(gm)
    graph = new_gm.graph
    by_name = {n.name: n for n in graph.nodes}
    fake_mode = fake_mode_of(graph)
    seed_input = ctx.given.get("seed_input")
    seed = (_seed_copy(graph, by_name[seed_input], fake_mode) if seed_input
            else ctx.cfg.early_seed)
    out = output_node(graph)
    outputs = list(out.args[0])
    num_fwd_outputs = analysis.num_fwd_outputs

    for block in analysis.blocks:
        comp = block.component
        # NB: the loss seed: the tangent, or the element of it the block reads the loss
        # gradient through; what makes it runs in the backward as it is
        loss = by_name[block.seed_node]
        upstream = upstream_of_seed(loss, set(comp.seeds))
        to_clone = (set(comp.seeds) | set(comp.helpers) | set(comp.nodes)) - upstream
        dependent = {by_name[n] for n in comp.tangents + comp.seeds + comp.nodes}
        env = _copy_early(graph, block, by_name, _pieces(comp, by_name, to_clone), dependent,
                          seed, fake_mode)
        late = (_copy_late(graph, comp, loss, upstream, by_name, dependent, fake_mode)
                if block.other_tangents else {})

        _scale_partials(graph, block, by_name, env, late, to_clone, seed, fake_mode)

        with graph.inserting_before(out):
            for primal_index, grad_name in comp.grad_outputs:
                grad = by_name[grad_name]
                outputs[num_fwd_outputs + primal_index] = _returned_grad(
                    graph, block, primal_index, env[grad], late.get(grad, ZERO), loss,
                    seed, fake_mode)

    out.args = (tuple(outputs),)
    graph.eliminate_dead_code()
    graph.lint()
    new_gm.recompile()
    return PassResult(new_gm, modified=True)


def _copy_early(graph: fx.Graph, block: Block, by_name: dict[str, fx.Node],
                pieces: list[tuple[str, set[fx.Node]]], dependent: set[fx.Node], seed: Seed,
                fake_mode: Any) -> dict[fx.Node, Any]:
    """The block's early copy: the seed right after its first ready point, then each piece's
    nodes after that piece's ready point, the loss tangent read as the seed and the other
    outputs' tangents as zero (their part of the gradient is the backward's: `_copy_late`).
    Returns the original -> copy (or ``ZERO``) map."""
    loss = by_name[block.seed_node]
    loss_val = val_of(loss)
    early_meta = NodeMeta(Role.EARLY_BACKWARD, block=block.id, at_graph_end=block.at_graph_end)
    with graph.inserting_after(by_name[pieces[0][0]]):
        seed_node = _seed_value(graph, seed, loss_val, fake_mode)
    _tag_forward(seed_node, early_meta)
    env: dict[fx.Node, Any] = {loss: seed_node,
                               **{by_name[g]: ZERO for g in block.other_tangents}}
    last = seed_node
    for index, (ready, members) in enumerate(pieces):
        order = {n: i for i, n in enumerate(graph.nodes)}
        if order[by_name[ready]] > order[last]:
            last = by_name[ready]
        meta = (early_meta if len(pieces) == 1
                else dataclasses.replace(early_meta, piece=index))
        if index == 0:
            set_meta(seed_node, meta)
        made: list[fx.Node] = []

        def tag(node: fx.Node, meta: NodeMeta = meta) -> None:
            _tag_forward(node, meta)
            made.append(node)

        for node in [n for n in graph.nodes if n in members]:  # graph order: topological
            with graph.inserting_before(last.next):
                env[node] = copy_folding_zeros(graph, node, env, dependent,
                                               fake_mode=fake_mode, made=tag)
            if made:
                last = made[-1]
    return env


#: The seed an early copy runs at: ``cfg.early_seed``, or the forward's copy of a learned
#: seed (`_seed_copy`).
Seed = float | fx.Node


def _seed_copy(graph: fx.Graph, seed_input: fx.Node, fake_mode: Any) -> fx.Node:
    """The forward's copy of a learned seed (``seed_input``, a 0-d float32 placeholder,
    `erase_fx.emit.loss_seed`), right after the placeholders: every early copy runs at
    it and the backward divides ``T`` by it, saved (``Role.LOSS_SEED``: the partition
    keeps it in the forward), so a forward and its backward agree on the seed whatever
    the program does to its input in between."""
    with graph.inserting_after(list(graph.find_nodes(op="placeholder"))[-1]):
        copy = call_with_val(graph, aten.clone.default, (seed_input,), fake_mode=fake_mode)
    set_meta(copy, NodeMeta(Role.LOSS_SEED))
    copy.meta["partitioner_tag"] = "is_forward"
    return copy


def _seed_value(graph: fx.Graph, seed: Seed, loss_val: Any, fake_mode: Any) -> fx.Node:
    """The early copy's loss gradient: ``seed`` in the loss seed's own shape and dtype (a
    loss accumulated into ``torch.zeros(1)`` is ``[1]``)."""
    if not isinstance(seed, fx.Node):
        return call_with_val(
            graph, aten.full.default, (list(loss_val.shape), float(seed)),
            {"dtype": loss_val.dtype, "layout": torch.strided,
             "device": loss_val.device, "pin_memory": False},
            fake_mode=fake_mode)
    value = seed
    if val_of(seed).dtype != loss_val.dtype:
        value = call_with_val(graph, aten._to_copy.default, (value,), {"dtype": loss_val.dtype},
                              fake_mode=fake_mode)
    return call_with_val(graph, aten.expand.default, (value, list(loss_val.shape)),
                         fake_mode=fake_mode)


def _pieces(comp, by_name: dict[str, fx.Node],
            to_clone: set[str]) -> list[tuple[str, set[fx.Node]]]:
    """(ready point, nodes to clone) of each piece of a block, in launch order.

    A block cloned whole is one piece. A block in pieces clones each piece's
    nodes after that piece's ready point, with the seeds and helpers it is
    the first to need.
    """
    if not comp.pieces:
        return [(comp.ready_after, {by_name[n] for n in to_clone})]
    shared = {by_name[n] for n in comp.seeds + comp.helpers if n in to_clone}
    taken: set[fx.Node] = set()
    pieces = []
    for ready, names in zip(comp.piece_ready, comp.pieces):
        members = {by_name[n] for n in names}
        stack = [a for n in members for a in n.all_input_nodes]
        while stack:
            arg = stack.pop()
            if arg in shared and arg not in taken and arg not in members:
                members.add(arg)
                stack.extend(arg.all_input_nodes)
        taken |= members
        pieces.append((ready, members))
    return pieces


def _copy_late(graph: fx.Graph, comp, loss: fx.Node, upstream: set[str],
               by_name: dict[str, fx.Node], dependent: set[fx.Node],
               fake_mode: Any) -> dict[fx.Node, Any]:
    """The backward's part of a block that reads other tangents besides its loss's: each
    node that depends on the loss seed (``T``, or the element of it the block reads)
    copied with it zero, right after it
    (`copy_folding_zeros`); a node that does not is read as it is. Returns the original ->
    copy (or ``ZERO``) map."""
    late: dict[fx.Node, Any] = {loss: ZERO}
    members = {by_name[n] for n in comp.seeds + comp.nodes if n not in upstream}
    for node in [n for n in graph.nodes if n in members]:  # graph order: topological
        if not any(a in late for a in node.all_input_nodes):
            continue
        with graph.inserting_before(node.next):
            late[node] = copy_folding_zeros(graph, node, late, dependent, fake_mode=fake_mode)
    return late


def _returned_grad(graph: fx.Graph, block: Block, primal_index: int, early: Any, late: Any,
                   loss: fx.Node, seed: Seed, fake_mode: Any) -> Any:
    """What the joint graph returns as the gradient of primal ``primal_index``: the early
    gradient scaled, ``T / s * early`` (tagged ``GRAD_SCALE``), plus the backward's part
    ``late`` when the block reads other tangents; either alone where the other is zero."""
    if early is ZERO:
        return late
    set_meta(early, dataclasses.replace(get_meta(early), grad_of=primal_index))
    scale = _loss_grad_scale(graph, loss, val_of(early).dtype, seed, fake_mode)
    scaled = call_with_val(graph, aten.mul.Tensor, (early, scale), fake_mode=fake_mode)
    set_meta(scaled, NodeMeta(Role.GRAD_SCALE, block=block.id, grad_of=primal_index))
    if late is ZERO:
        return scaled
    return call_with_val(graph, aten.add.Tensor, (scaled, late), fake_mode=fake_mode)


def _tag_forward(node: fx.Node, meta: NodeMeta) -> None:
    set_meta(node, meta)
    # NB: the stock partitioners keep nodes tagged is_forward in the forward graph.
    node.meta["partitioner_tag"] = "is_forward"


def _scale_partials(graph: fx.Graph, block: Block, by_name: dict[str, fx.Node],
                    env: dict[fx.Node, Any], late: dict[fx.Node, Any], cloned: set[str],
                    seed: Seed, fake_mode: Any) -> None:
    """The sums in the backward read ``T / s *`` each early part instead of the part (plus
    the backward's own part of it, ``late``, for a block that reads other tangents)."""
    loss = by_name[block.seed_node]
    for name in block.component.partials:
        original = by_name[name]
        users = [u for u in original.users if u.name not in cloned]
        early, rest = env[original], late.get(original, ZERO) if late else ZERO
        if early is ZERO:
            replacement = rest
        else:
            anchor = rest if isinstance(rest, fx.Node) and rest is not original else original
            with graph.inserting_before(anchor.next):
                scale = _loss_grad_scale(graph, loss, val_of(original).dtype, seed,
                                         fake_mode)
                replacement = call_with_val(graph, aten.mul.Tensor, (early, scale),
                                            fake_mode=fake_mode)
                set_meta(replacement, NodeMeta(Role.PARTIAL_SCALE, block=block.id))
                if rest is not ZERO:
                    replacement = call_with_val(graph, aten.add.Tensor, (replacement, rest),
                                                fake_mode=fake_mode)
        if replacement is ZERO:
            raise GraphInvariantError(PASS_NAME, "a gradient part is zero in both the early and "
                                      "the late copy", node=name)
        for user in users:
            user.replace_input_with(original, replacement)


def _loss_grad_scale(graph, tangent, dtype, seed: Seed, fake_mode) -> fx.Node:
    """``T / seed``, 0-d, in the gradient's dtype, float32 for a 16-bit one: one scalar node
    per use (or the tangent itself). A one-element tangent of shape ``[1]`` is viewed as 0-d
    first, so the scale broadcasts to the gradient's own shape. A learned seed (a float32
    0-d node) divides as it is.

    NB: a 0-d scale does not promote the gradient's dtype, and the product is computed in
    float32 either way; cast to float16, a GradScaler's scale 65536 would be infinite."""
    scale = tangent
    if val_of(tangent).dim() != 0:
        scale = call_with_val(graph, aten.view.default, (scale, []), fake_mode=fake_mode)
    if dtype.is_floating_point and dtype.itemsize < 4:
        dtype = torch.float32
    if val_of(tangent).dtype != dtype:
        scale = call_with_val(graph, aten._to_copy.default, (scale,), {"dtype": dtype},
                              fake_mode=fake_mode)
    if isinstance(seed, fx.Node):
        scale = call_with_val(graph, aten.div.Tensor, (scale, seed), fake_mode=fake_mode)
    elif seed != 1.0:
        scale = call_with_val(graph, aten.div.Tensor, (scale, float(seed)), fake_mode=fake_mode)
    return scale


def check_early_schedule(result: PassResult, ctx: PassContext) -> None:
    """Invariants of the rewritten joint graph; raises GraphInvariantError."""
    gm = result.gm
    analysis: BlockAnalysis = ctx.artifact(FIND_BLOCKS)
    reads_tangent: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if is_tangent(node) or any(a in reads_tangent for a in node.all_input_nodes):
            reads_tangent.add(node)
        meta = get_meta(node)
        if meta is not None and meta.role is Role.EARLY_BACKWARD and node in reads_tangent:
            raise GraphInvariantError(PASS_NAME, "an early node reads a tangent", node=node.name)
    # NB: a block that reads other tangents returns T/s * early + its backward's part,
    # or its backward's part alone for a gradient its loss term does not reach
    declared = {(b.id, i) for b in analysis.blocks for i, _ in b.component.grad_outputs}
    split = {b.id for b in analysis.blocks if b.other_tangents}
    grads = list(output_node(gm.graph).args[0])[analysis.num_fwd_outputs:]
    found = set()
    for index, grad in enumerate(grads):
        if isinstance(grad, fx.Node) and grad.target is aten.add.Tensor:
            grad = grad.args[0]
        if not isinstance(grad, fx.Node) or grad.target is not aten.mul.Tensor:
            continue
        early, scale = grad.args
        meta = get_meta(early) if isinstance(early, fx.Node) else None
        if meta is None or meta.grad_of != index:
            continue
        if scale not in reads_tangent:
            raise GraphInvariantError(PASS_NAME, "early gradient scaled by a constant",
                                      node=grad.name)
        found.add((meta.block, index))
    expected = {(block, i) for block, i in declared if block not in split}
    if not expected <= found <= declared:
        missing = sorted(expected - found) or sorted(found - declared)
        raise GraphInvariantError(PASS_NAME, f"early gradients not returned as T*grad: {missing}")
    expected_parts = {b.id: len(b.component.partials) for b in analysis.blocks}
    parts: dict[int, int] = {}
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if meta is None or meta.role is not Role.PARTIAL_SCALE:
            continue
        early, scale = node.args
        early_meta = get_meta(early) if isinstance(early, fx.Node) else None
        if early_meta is None or early_meta.role is not Role.EARLY_BACKWARD or (
                early_meta.block != meta.block):
            raise GraphInvariantError(PASS_NAME, "a gradient part is not its block's early value",
                                      node=node.name)
        if scale not in reads_tangent or not node.users:
            raise GraphInvariantError(PASS_NAME, "a gradient part unscaled or unread",
                                      node=node.name)
        parts[meta.block] = parts.get(meta.block, 0) + 1
    unsplit = {k: v for k, v in parts.items() if k not in split}
    if (unsplit != {k: v for k, v in expected_parts.items() if v and k not in split}
            or any(parts.get(k, 0) > expected_parts[k] for k in split)):
        raise GraphInvariantError(PASS_NAME, f"gradient parts per block {parts}, expected "
                                  f"{expected_parts}")
