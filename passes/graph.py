"""Small predicates and builders over FX graphs, shared by the passes.

Names follow torch's partitioners: ``is_primal`` / ``is_tangent`` look at the
placeholder names AOTAutograd gives the joint graph (``primals_*`` then
``tangents_*``), which are stable across torch 2.11-2.15.

The values made from the graph's inputs alone (`made_from_inputs`: soft
targets made from the labels) and a block's loss tail (`loss_tails`) are
defined here once: `copy_input_values_per_block` copies such values per
block and `assign_streams` decides where they and the tails run; a large
value (`MIN_BYTES`) is one worth holding on one stream rather than another.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from erase_fx.passes.flops import node_flops
from erase_fx.passes.node_meta import Owner, early_owner, is_early

aten = torch.ops.aten

#: A value at least this large is worth a decision of where it is made: held on one stream
#: while others read it (until the join, under CUDA graph capture), or made again by each
#: block; smaller shared values stay shared (a copy per block would add launches and save
#: little, and a scalar loss crossing the join holds nothing).
MIN_BYTES = 1 << 20
#: The op namespaces whose ops say when they are impure or draw random numbers (a custom op or
#: a higher-order op may do either without saying so): a pure op of theirs that draws none
#: may be made again, copied (`is_copyable`) or recomputed (`recompute_boundary_values`).
EFFECT_DECLARING_NAMESPACES = ("aten", "prims")


def is_primal(node: fx.Node) -> bool:
    return node.op == "placeholder" and str(node.target).startswith("primals")


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and str(node.target).startswith("tangents")


def upstream_of_seed(seed: fx.Node, seeds: Collection[str]) -> set[str]:
    """The names of the ``seeds`` (a block's, by name) that make its loss seed ``seed``, the
    seed included; none when ``seed`` is the tangent itself. The backward computes them
    from the tangent as they are; a block's early copy starts after them.

    NB: a seed reads only tangents, seeds and constants, so every seed it is made from is
    reached by walking back through seeds alone.
    """
    if is_tangent(seed):
        return set()
    found, stack = {seed.name}, list(seed.all_input_nodes)
    while stack:
        node = stack.pop()
        if node.name in seeds and node.name not in found:
            found.add(node.name)
            stack.extend(node.all_input_nodes)
    return found


def is_one_element(value: Any) -> bool:
    """Whether ``value`` is a tensor of exactly one element: a loss, 0-d or ``[1]``
    (``torch.zeros(1)`` plus the local losses). NB: sizes that are symbolic count as
    not 1, so no guard is added on them."""
    return isinstance(value, torch.Tensor) and all(
        isinstance(size, int) and size == 1 for size in value.shape)


def output_node(graph: fx.Graph) -> fx.Node:
    return graph.find_nodes(op="output")[0]


def output_values(graph: fx.Graph) -> list[Any]:
    """The flat list a graph returns (AOT graphs return a tuple)."""
    out = output_node(graph).args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def output_descriptors(graph: fx.Graph) -> list[tuple[Any, Any]] | None:
    """Each value the graph returns with its AOTAutograd output descriptor (``desc`` on the
    output node: what the value is, e.g. saved for the backward, an input's new value);
    None when the graph has no descriptors, or not one per value."""
    descs = output_node(graph).meta.get("desc")
    values = output_values(graph)
    if descs is None or len(descs) != len(values):
        return None
    return list(zip(values, descs))


def tangent_outputs(graph: fx.Graph, num_fwd_outputs: int) -> dict[fx.Node, fx.Node]:
    """Each tangent of a joint graph -> the forward output it is the gradient of, matched by
    AOTAutograd's descriptors (``TangentAOTInput.output`` is the output's own descriptor);
    empty when the graph has none."""
    described = output_descriptors(graph)
    if described is None:
        return {}
    by_desc = {desc: value for value, desc in described[:num_fwd_outputs]
               if isinstance(value, fx.Node) and desc is not None}
    found = {}
    for node in graph.find_nodes(op="placeholder"):
        output = getattr(node.meta.get("desc"), "output", None)
        if is_tangent(node) and output in by_desc:
            found[node] = by_desc[output]
    return found


def primals(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.find_nodes(op="placeholder") if is_primal(n)]


def val_of(node: Any) -> Any:
    """The example value of a node (a fake tensor or SymInt), or the constant itself."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def fake_mode_of(graph: fx.Graph):
    """The FakeTensorMode the graph's example values live in, or None."""
    return detect_fake_mode([val_of(n) for n in graph.find_nodes(op="placeholder")])


def clone_module(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A new GraphModule with a fresh copy of the graph (meta copied shallowly).

    Structural passes never mutate their input: they clone, then edit the clone.
    Returns the clone and the map from old nodes to new ones.
    """
    graph = fx.Graph(owning_module=None, tracer_cls=gm.graph._tracer_cls)
    node_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, node_map, return_output_node=True)
    # NB: graph_copy returns the output *value*; re-emit the output node with its meta.
    old_out = output_node(gm.graph)
    new_out = graph.output(out[0] if isinstance(out, tuple) else out)
    new_out.meta = dict(old_out.meta)
    node_map[old_out] = new_out
    graph._codegen = gm.graph._codegen
    new_gm = fx.GraphModule(gm, graph, class_name=gm.__class__.__name__)
    new_gm.meta = dict(getattr(gm, "meta", {}))
    return new_gm, node_map


#: What Dynamo sets on the GraphModule it hands a backend besides ``meta`` (torch 2.11-2.14,
#: ``torch._dynamo.output_graph``).
DYNAMO_GRAPH_ATTRIBUTES = ("_param_name_to_source", "compile_subgraph_reason",
                           "_source_to_user_stacks", "_backend_id", "torchdynamo_force_dynamic")


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's ``gm`` whose graph can be changed without touching ``gm``'s (modules
    shared): what the stock backend compiles in a fallback, and what Dynamo's DDP optimizer
    splits after erase's backend declined a whole graph (`erase_fx.backend`, `erase_fx.ddp`).
    Unlike `clone_module`, it keeps ``gm``'s class and tracer as Dynamo made them, and
    what Dynamo sets on its graph besides ``meta`` (`DYNAMO_GRAPH_ATTRIBUTES`, each
    placeholder's ``_dynamo_source``): without them AOTAutograd takes the graph for an
    exported one and marks no input static (torch 2.11-2.14,
    ``_try_get_metadata_from_dynamo``; tests/test_loss_seed.py pins it), and a graph ended
    at a graph break looks ended at its return (`erase_fx.graph_breaks`)."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    copies: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    clone = fx.GraphModule(gm, graph)
    clone.meta.update(gm.meta)
    for name in DYNAMO_GRAPH_ATTRIBUTES:
        if hasattr(gm, name):
            setattr(clone, name, getattr(gm, name))
    for node in gm.graph.find_nodes(op="placeholder"):
        if hasattr(node, "_dynamo_source"):
            copies[node]._dynamo_source = node._dynamo_source
    return clone


def rebuild_in_order(gm: fx.GraphModule, order: Sequence[fx.Node]) -> fx.GraphModule:
    """A new GraphModule whose nodes are ``order`` (a topological order of gm's nodes)."""
    graph = fx.Graph(owning_module=None, tracer_cls=gm.graph._tracer_cls)
    env: dict[fx.Node, fx.Node] = {}
    for node in order:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph._codegen = gm.graph._codegen
    new_gm = fx.GraphModule(gm, graph, class_name=gm.__class__.__name__)
    new_gm.meta = dict(getattr(gm, "meta", {}))
    return new_gm


def call_with_val(
    graph: fx.Graph,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    fake_mode=None,
) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insert point, with meta["val"].

    The value is computed by running the op on the inputs' example values
    inside the graph's fake mode, so shapes (symbolic ones too) stay right.
    """
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    vargs, vkwargs = fx.node.map_arg((args, kwargs), val_of)
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*vargs, **vkwargs)
    else:
        node.meta["val"] = target(*vargs, **vkwargs)
    return node


def topo_positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def draws_random_numbers(node: fx.Node) -> bool:
    """Whether the node is an op that draws random numbers (dropout, attention with dropout):
    its tags say so (``nondeterministic_seeded``)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in target.tags)


def is_view(node: fx.Node) -> bool:
    """A call of an aten or prims op whose output is a view of its first input."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def returned_to_the_user(graph: fx.Graph) -> set[fx.Node] | None:
    """The output values that are forward returns, not saved for the backward (None: unknown)."""
    from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput

    described = output_descriptors(graph)
    if described is None:
        return None
    return {v for v, d in described
            if isinstance(v, fx.Node) and not isinstance(d, SavedForBackwardsAOTOutput)}


def feeds_returns_only(nodes: list[fx.Node], returned: set[fx.Node],
                       eligible: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """The ``eligible`` call_function nodes that only feed what the graph returns to the user
    (``returned``, `returned_to_the_user`: the loss sum), directly or through such nodes,
    not tensors saved for the backward."""
    feeds: set[fx.Node] = set()
    for node in reversed(nodes):
        if node.op == "call_function" and eligible(node) and node.users and all(
                (user.op == "output" and node in returned) or user in feeds
                for user in node.users):
            feeds.add(node)
    return feeds


def returned_values(graph: fx.Graph) -> set[fx.Node]:
    """The nodes the graph returns, and the nodes they are views of (a forward's outputs and
    the values it saves for the backward: they live past its end whoever reads them)."""
    found: set[fx.Node] = set()
    stack = list(output_node(graph).all_input_nodes)
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        if is_view(node):
            stack.extend(node.all_input_nodes[:1])  # NB: a view's base is its first input
    return found


def tensor_bytes(value: Any) -> int | None:
    """Bytes of a tensor value (its shape's numel, at the shape's hints); None if unknown (no
    example value, a size without a hint); 0 for a non-tensor (a SymInt, a number)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        return 0
    numel = 1
    for size in value.shape:
        if isinstance(size, torch.SymInt):
            hint = size.node.hint
            if hint is None:
                return None
            size = int(hint)
        numel *= int(size)
    return numel * value.element_size()


def is_copyable(node: fx.Node) -> bool:
    """An op whose copy computes what it computed: a pure aten or prims op that draws no
    random numbers, a getitem, or arithmetic on symbolic sizes."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return (target.namespace in EFFECT_DECLARING_NAMESPACES and not node.is_impure()
                and not draws_random_numbers(node))
    return getattr(target, "__module__", None) == operator.__name__  # getitem, SymInt math


def made_from_inputs(nodes: list[fx.Node]) -> set[fx.Node]:
    """The pure aten and prims nodes without matrix work (and getitems, symbolic-size
    arithmetic) whose inputs are graph inputs (placeholders, attributes) or such nodes:
    functions of the inputs alone."""
    found: set[fx.Node] = set()
    for node in nodes:
        if (node.op == "call_function"
                and all(a.op in ("placeholder", "get_attr") or a in found
                        for a in node.all_input_nodes)
                and is_copyable(node) and node_flops(node) == 0):
            found.add(node)
    return found


def loss_tails(graph: fx.Graph, nodes: list[fx.Node],
               from_inputs: set[fx.Node]) -> dict[fx.Node, Owner]:
    """The forward nodes of a block's loss tail, by the (block, piece) they are of: pure
    nodes that only feed what the forward returns to the user (the loss sum), whose
    inputs, graph inputs and values made from them alone aside, are all read by the early
    nodes of one (block, piece) (``mul(soft_targets, log_softmax)``: the block's backward
    reads its log-softmax). `assign_streams` runs such a node in its block, and
    `copy_input_values_per_block` gives it the block's copy. Without output descriptors,
    none."""
    returned = returned_to_the_user(graph)
    if returned is None:
        return {}
    tails: dict[fx.Node, Owner] = {}
    for node in feeds_returns_only(nodes, returned, lambda node: not is_early(node)):
        computed = [a for a in node.all_input_nodes
                    if a.op not in ("placeholder", "get_attr") and a not in from_inputs]
        owners = {early_owner(u) for a in computed for u in a.users} - {None}
        if (computed and len(owners) == 1 and not node.is_impure()
                and all(any(is_early(u) for u in a.users) for a in computed)):
            tails[node] = owners.pop()
    return tails
