"""copy_input_values_per_block: each early block makes its own copy of a large value that is
computed from the graph's inputs alone and read by more than that block.

What: a value early nodes read although it is not theirs alone (other
blocks, or the forward, read it too) is copied when it depends on no
activation, only on graph inputs and constants, through pure ops without
matrix work (`_made_from_inputs`); when it, or a value it is made from, is
large (at least `MIN_BYTES`) and much larger than the graph inputs it is made
from (`GROWTH` times their bytes); and when the forward does not return it (a
value saved for the backward lives past the join anyway). The stock
partitioner's CSE makes such values: a cross-entropy's backward builds the
same batch x classes ``where(iota == target, -1, 0) / n`` from the labels in
every block, and CSE keeps one of them for all. Each (block, piece) whose
early nodes read the value gets its own copy of it and of the large values it
is made from, placed right before its first reader there and marked as that
block's; the small values they read (the labels, masks made from them) stay
shared, so the block reads what it read before and launches where it did. The
original keeps its other readers and is dropped when none is left.

Why: a value several blocks read is made by one of them (or the main stream)
and read on other streams, so under CUDA graph capture it lives until the join
(`erase_fx.emit.release`): 128 MiB of fp32 on gpt:16:384:256:8, alive through
every block. Made by each block, it is made, read and freed on the block's own
stream, and with Inductor its elementwise chain can fuse into the block's
kernels that read it instead of being written out. The cost is the chain run once
per block: elementwise work on small inputs (that is what the size rule
admits), next to a block's matrix work.

``EraseConfig.copy_input_values=False`` turns the pass off (the input comes
back unchanged).

Invariants out (`check_input_values_per_block`): a new module (the input
itself when there is nothing to copy: ``modified`` False); no value this
pass would copy is left (each such value is read by the early nodes of one
(block, piece) at most, and only by them); each copy is an early node of the
block whose nodes read it, and the large values it reads are that block's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.errors import GraphInvariantError
from erase_fx.passes.flops import node_flops
from erase_fx.passes.graph import clone_module, output_node, rebuild_in_order, val_of
from erase_fx.passes.node_meta import NodeMeta, Role, get_meta, is_early, set_meta
from erase_fx.passes.pass_result import DumpFile, PassResult, graph_text

PASS_NAME = "copy_input_values_per_block"

#: Smaller shared values stay shared: a copy per block would add launches and save little.
MIN_BYTES = 1 << 20
#: A copied value must be this many times larger than the graph inputs it is made from, so
#: that making it again costs little next to holding it (a label tensor -> a batch x
#: classes mask; not a cast of a weight, which reads more bytes than it writes).
GROWTH = 4

#: Whose early nodes read a value: (block, piece).
Owner = tuple[int, "int | None"]


@dataclasses.dataclass(frozen=True)
class InputValueCopies:
    """Which values each block now makes itself: original name -> the copies' names, one
    per (block, piece) that reads it, in block order; and the bytes of each value (at its
    shape's hints)."""

    copies: dict[str, tuple[str, ...]]
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)

    def render(self, gm: fx.GraphModule) -> tuple[DumpFile, ...]:
        listed = "; ".join(f"{name} -> {', '.join(made)}" for name, made in self.copies.items())
        part = (f"the forward with {len(self.copies)} input-only value(s) copied per block"
                + (f" ({listed})" if listed else ""))
        return (DumpFile(".py", part, graph_text(gm)),)


def copy_input_values_per_block(gm: fx.GraphModule,
                                cfg: EraseConfig) -> PassResult[InputValueCopies]:
    """Give each block its own copy of the shared input-only values; see the module docstring."""
    if not cfg.copy_input_values or not _values_to_copy(*_analysed(gm.graph)):
        return PassResult(gm, modified=False, artifact=InputValueCopies({}))
    new_gm, _ = clone_module(gm)
    graph = new_gm.graph
    nodes, from_inputs, position = _analysed(graph)
    made: dict[Owner, dict[fx.Node, fx.Node]] = {}  # per owner: original -> its copy
    origin: dict[fx.Node, fx.Node] = {}  # copy -> original
    copies: dict[str, tuple[str, ...]] = {}
    sizes: dict[str, int] = {}
    to_copy = _values_to_copy(nodes, from_inputs, position)
    readers = {node: _early_readers(node, position) for node in to_copy}
    for node in to_copy:
        names = []
        for owner in sorted(readers[node], key=lambda o: (o[0], -1 if o[1] is None else o[1])):
            copy = _copy_chain(graph, node, owner, made=made.setdefault(owner, {}),
                               origin=origin)
            for user in readers[node][owner]:
                user.replace_input_with(node, copy)
            names.append(copy.name)
        copies[node.name] = tuple(names)
        sizes[node.name] = _bytes(val_of(node)) or 0
    _drop_unread(reversed(nodes), from_inputs)
    new_gm = rebuild_in_order(new_gm, _copies_before_readers(graph, set(origin)))
    new_gm.graph.lint()
    return PassResult(new_gm, modified=True, artifact=InputValueCopies(copies, sizes))


def _analysed(graph: fx.Graph) -> tuple[list[fx.Node], set[fx.Node], dict[fx.Node, int]]:
    """The graph's nodes, its input-only ones (`_made_from_inputs`) and each node's position."""
    nodes = list(graph.nodes)
    return nodes, _made_from_inputs(nodes), {n: i for i, n in enumerate(nodes)}


def _made_from_inputs(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """The pure call_function nodes without matrix work whose inputs are graph inputs
    (placeholders, attributes) or such nodes: functions of the inputs alone."""
    found: set[fx.Node] = set()
    for node in nodes:
        if (node.op == "call_function" and not node.is_impure() and not _is_random(node)
                and node_flops(node) == 0
                and all(a.op in ("placeholder", "get_attr") or a in found
                        for a in node.all_input_nodes)):
            found.add(node)
    return found


def _is_random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return isinstance(node.target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in tags)


def _values_to_copy(nodes: list[fx.Node], from_inputs: set[fx.Node],
                    position: dict[fx.Node, int]) -> list[fx.Node]:
    """In graph order: the large input-only values early nodes read that are not theirs alone."""
    found = []
    for node in nodes:
        if node not in from_inputs:
            continue
        readers = _early_readers(node, position)
        if not readers:
            continue
        alone = len(readers) == 1 and all(is_early(u) for u in node.users)
        if alone or _returned(node) or not _chain_is_large_from_small_inputs(node):
            continue
        found.append(node)
    return found


def _returned(node: fx.Node) -> bool:
    """Whether the forward returns ``node`` or a view of it (saved for the backward, say): it
    then lives past the join whoever reads it, and a copy would only add work and memory."""
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user.op == "output":
                return True
            if _is_view(user):
                stack.append(user)
    return False


def _early_readers(node: fx.Node, position: dict[fx.Node, int]) -> dict[Owner, list[fx.Node]]:
    """The early nodes that read ``node``, by (block, piece), each list in graph order
    (``position``: the graph's order)."""
    readers: dict[Owner, list[fx.Node]] = {}
    for user in node.users:  # NB: users in the order they were added, not the graph's
        if is_early(user):
            meta = get_meta(user)
            readers.setdefault((meta.block, meta.piece), []).append(user)
    return {owner: sorted(users, key=position.__getitem__) for owner, users in readers.items()}


def _is_view(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _chain_is_large_from_small_inputs(node: fx.Node) -> bool:
    """Whether ``node``'s chain (it and the input-only nodes it is made from) holds a value of
    at least `MIN_BYTES` that is `GROWTH` times larger than the graph inputs the chain reads.

    NB: the chain, not only the node: a small value several blocks read (the row sums of a
    batch x classes mask) drags the large value it is made from into one block (or onto the
    main stream, from where other streams read it) unless it is copied too."""
    chain, inputs = _chain_of(node)
    sizes = [_bytes(val_of(i)) for i in inputs]
    if any(s is None for s in sizes):
        return False
    limit = max(MIN_BYTES, GROWTH * sum(sizes))
    return any((size := _bytes(val_of(n))) is not None and size >= limit
               for n in chain if not _is_view(n))


def _chain_of(node: fx.Node) -> tuple[set[fx.Node], set[fx.Node]]:
    """An input-only value's chain (the node and the nodes it is made from) and the
    placeholders and attributes that chain reads."""
    chain: set[fx.Node] = {node}
    inputs: set[fx.Node] = set()
    stack = [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg in chain or arg in inputs:
                continue
            if arg.op in ("placeholder", "get_attr"):
                inputs.add(arg)
            else:
                chain.add(arg)
                stack.append(arg)
    return chain, inputs


def _bytes(value) -> int | None:
    """Bytes of a tensor value (its shape's numel, at the shape's hints), None if unknown; 0 for
    a non-tensor (a SymInt, a number)."""
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


def _copy_chain(graph: fx.Graph, node: fx.Node, owner: Owner, *,
                made: dict[fx.Node, fx.Node], origin: dict[fx.Node, fx.Node]) -> fx.Node:
    """``node`` copied for ``owner`` (before the output: `_copies_before_readers` places it),
    with the inputs whose own chains hold a large value; other inputs (the labels, small
    masks made from them) are read as they are, so the block still reads what it read
    before and launches where it did. Copies made for ``owner`` already (``made``) are
    reused; a node redirected to another owner's copy is copied from the original
    (``origin``)."""
    node = origin.get(node, node)
    if node in made:
        return made[node]
    block, piece = owner

    def copied(arg: fx.Node) -> fx.Node:
        arg = origin.get(arg, arg)
        if arg.op in ("placeholder", "get_attr"):
            return arg
        # NB: a multi-output op goes with the getitem that reads it: segments pass tensors
        if _chain_is_large_from_small_inputs(arg) or isinstance(val_of(arg), (tuple, list)):
            return _copy_chain(graph, arg, owner, made=made, origin=origin)
        return arg

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), copied)
    suffix = f"_block_{block}" + ("" if piece is None else f"_piece_{piece}")
    with graph.inserting_before(output_node(graph)):
        copy = graph.create_node(node.op, node.target, args, kwargs, name=node.name + suffix)
    copy.meta = dict(node.meta)
    set_meta(copy, NodeMeta(Role.EARLY_BACKWARD, block=block, piece=piece))
    made[node] = copy
    origin[copy] = node
    return copy


def _copies_before_readers(graph: fx.Graph, copies: set[fx.Node]) -> list[fx.Node]:
    """The graph's order with each copy moved to right before its first reader (its inputs
    first): as late as it can be made, so it lives no longer than the block needs it.

    NB: the originals a copy reads come before that reader: they are in the chain of the
    value the reader read, made before it."""
    order: list[fx.Node] = []
    placed: set[fx.Node] = set()

    def place(node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            if arg in copies and arg not in placed:
                place(arg)
        order.append(node)
        placed.add(node)

    for node in graph.nodes:
        if node not in copies:
            place(node)
    return order


def _drop_unread(nodes: Iterable[fx.Node], from_inputs: set[fx.Node]) -> None:
    """Erase the input-only nodes nothing reads any more (reverse order: readers first)."""
    for node in nodes:
        if node in from_inputs and not node.users:
            node.graph.erase_node(node)


def check_input_values_per_block(result: PassResult[InputValueCopies]) -> None:
    """The invariants in the module docstring."""
    nodes, from_inputs, position = _analysed(result.gm.graph)
    left = _values_to_copy(nodes, from_inputs, position)
    if left:
        raise GraphInvariantError(PASS_NAME, f"{left[0].name} is read by the early nodes of "
                                  "several blocks (or with the forward) and was not copied")
    copied = {name for made in result.artifact.copies.values() for name in made}
    by_name = {n.name: n for n in nodes}
    for name in copied:
        copy = by_name.get(name)
        if copy is None or not is_early(copy):
            raise GraphInvariantError(PASS_NAME, f"the copy {name} is not an early node")
        meta = get_meta(copy)
        for arg in copy.all_input_nodes:
            if arg.op in ("placeholder", "get_attr"):
                continue
            arg_meta = get_meta(arg)
            own = is_early(arg) and (arg_meta.block, arg_meta.piece) == (meta.block, meta.piece)
            if not own and _chain_is_large_from_small_inputs(arg):
                raise GraphInvariantError(PASS_NAME, f"the copy {name} of block {meta.block} "
                                          f"reads {arg.name}, a large value not its block's own")
