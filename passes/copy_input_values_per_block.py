"""copy_input_values_per_block: each early block makes its own copy of a large value that is
computed from the graph's inputs alone and read by more than that block.

What: a value early nodes read although it is not theirs alone (other
blocks, or the forward, read it too) is copied when it depends on no
activation, only on graph inputs and constants, through pure aten or prims
ops without matrix work (`made_from_inputs`; a custom op may draw random
numbers without saying so); when it, or a value it is made from, is large
(at least `MIN_BYTES`) and much larger than the graph inputs it is made from
(`GROWTH` times their bytes); and when the forward does not return it (a
value saved for the backward lives past the join anyway: such a value is
read as it is, like an input, by the copies made from it). Merging
common subexpressions makes such values (`merge_common_subexpressions`, as
the stock partitioner's CSE): blocks that learn the same soft targets
(``one_hot(labels) * 0.9 + 0.1 / classes``) each build them in the forward,
and the merge keeps one of them for all. (A helper of the backward alone, a
cross-entropy's batch x classes label mask, is cloned per block after the
merge and is not shared.) Each (block, piece) whose
early nodes read the value gets its own copy of it and of the large values it
is made from, placed right before its first reader there and marked as that
block's; the small values they read (the labels, masks made from them) stay
shared, so the block reads what it read before and launches where it did.
The block's **loss tail** reads its copy too (`loss_tails`: a forward node
that only feeds the loss the forward returns and whose other inputs, values
made from the inputs aside, the early nodes of that one block read:
``mul(soft_targets, log_softmax)``, which `assign_streams` runs in the
block), and counts as the block's reader here. The original keeps its other
readers (the last block's loss) and is dropped when none is left; when some
are left it moves, with the values of its chain nothing else reads, to right
before its first reader.

Why: a value several blocks read is made by one of them (or the main stream)
and read on other streams, so under CUDA graph capture it lives until the join
(`erase_fx.emit.release`): 128 MiB of fp32 on gpt:16:384:256:8, alive through
every block. Made by each block, it is made, read and freed on the block's own
stream, and with Inductor its elementwise chain can fuse into the block's
kernels that read it instead of being written out. The cost is the chain run once
per block: elementwise work on small inputs (that is what the size rule
admits), next to a block's matrix work. The loss tail reads the block's copy
for the same reason: reading the original, it kept the original alive on the
stream that made it (a block's stage, with `stages_on_side`) until the join
while every other block's loss read it from there (gpt-soft:16:384:256:8:
1.37x of stock Inductor's step memory, on an H200). The original left for
the last block's loss is made right before that loss, on the stream that
reads it, so Inductor can fuse its chain into the loss's kernel.

``Tuning.copy_input_values=False`` turns the pass off (the input comes
back unchanged).

Invariants out (`check_input_values_per_block`): a new module (the input
itself when there is nothing to copy: ``modified`` False); no value this
pass would copy is left (each such value is read by the early nodes and the
loss tail of one (block, piece) at most, and only by them); each copy is an
early node of the block whose nodes (early, or its loss tail) read it, and
the large values it reads are that block's.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from erase_fx.errors import GraphInvariantError
from erase_fx.passes.graph import (
    MIN_BYTES,
    clone_module,
    is_view,
    loss_tails,
    made_from_inputs,
    output_node,
    rebuild_in_order,
    returned_values,
    tensor_bytes,
    topo_positions,
    val_of,
)
from erase_fx.passes.node_meta import NodeMeta, Owner, Role, early_owner, is_early, set_meta
from erase_fx.passes.pass_result import DumpFile, PassContext, PassResult, graph_text

PASS_NAME = "copy_input_values_per_block"

#: A copied value must be this many times larger than the graph inputs it is made from, so
#: that making it again costs little next to holding it (a label tensor -> a batch x
#: classes mask; not a cast of a weight, which reads more bytes than it writes).
GROWTH = 4


@dataclasses.dataclass(frozen=True)
class InputValueCopies:
    """Which values each block now makes itself: original name -> the names of its copies,
    one per (block, piece) that reads it, in block order; and the bytes of each such value
    (at its shape's hints). Only the values early nodes read are listed, not the large
    values their copies are made through."""

    copies: dict[str, tuple[str, ...]]
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)

    def render(self, gm: fx.GraphModule) -> tuple[DumpFile, ...]:
        listed = "; ".join(f"{name} -> {', '.join(made)}" for name, made in self.copies.items())
        part = (f"the forward with {len(self.copies)} input-only value(s) copied per block"
                + (f" ({listed})" if listed else ""))
        return (DumpFile(".py", part, graph_text(gm)),)


@dataclasses.dataclass(frozen=True)
class _Analysis:
    """What the pass and its check read of a graph.

    Attributes:
        nodes: the graph's nodes, in order; ``position`` their index.
        from_inputs: the nodes made from graph inputs alone (`made_from_inputs`).
        returned: the nodes the forward returns, or views of them (saved for the backward):
            they live past the join whoever reads them, so they are never copied and a
            chain reads them as it reads graph inputs.
        tails: the forward nodes of a block's loss tail (`loss_tails`), by the (block,
            piece) whose early nodes read their other inputs.
    """

    nodes: list[fx.Node]
    position: dict[fx.Node, int]
    from_inputs: set[fx.Node]
    returned: set[fx.Node]
    tails: dict[fx.Node, Owner]
    #: `holds_large_from_small`'s answers, by node (a copy asks again for each block)
    large: dict[fx.Node, bool] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, graph: fx.Graph) -> _Analysis:
        nodes = list(graph.nodes)
        from_inputs = made_from_inputs(nodes)
        return cls(nodes, topo_positions(graph), from_inputs, returned_values(graph),
                   loss_tails(graph, nodes, from_inputs))

    def is_source(self, node: fx.Node) -> bool:
        """A node a copy reads as it is, never copies: a graph input or a returned value."""
        return node.op in ("placeholder", "get_attr") or node in self.returned

    def values_to_copy(self) -> list[fx.Node]:
        """In graph order: the large input-only values early nodes (or a block's loss tail)
        read that are not theirs alone."""
        found = []
        for node in self.nodes:
            if node not in self.from_inputs or node in self.returned:
                continue
            readers = self.block_readers(node)
            if not readers:
                continue
            alone = len(readers) == 1 and all(self.owner_of(u) for u in node.users)
            if not alone and self.holds_large_from_small(node):
                found.append(node)
        return found

    def owner_of(self, node: fx.Node) -> Owner | None:
        """The (block, piece) an early node or a loss tail's node is of; None for others."""
        owner = early_owner(node)
        return owner if owner is not None else self.tails.get(node)

    def block_readers(self, node: fx.Node) -> dict[Owner, list[fx.Node]]:
        """The early nodes and loss tails' nodes that read ``node``, by (block, piece), each
        list in graph order."""
        readers: dict[Owner, list[fx.Node]] = {}
        for user in node.users:  # NB: users in the order they were added, not the graph's
            owner = self.owner_of(user)
            if owner is not None:
                readers.setdefault(owner, []).append(user)
        return {owner: sorted(users, key=self.position.__getitem__)
                for owner, users in readers.items()}

    def holds_large_from_small(self, node: fx.Node) -> bool:
        """Whether ``node``'s chain (it and the input-only nodes it is made from, down to graph
        inputs and returned values) holds a value of at least `MIN_BYTES` that is `GROWTH`
        times larger than the graph inputs the chain reads (returned values count 0 bytes:
        they are held anyway, and a copy fused into its reader reads them as the shared
        value would be read).

        NB: the chain, not only the node: a small value several blocks read (the row sums of
        a batch x classes mask) drags the large value it is made from into one block (or onto
        the main stream, from where other streams read it) unless it is copied too."""
        if node not in self.large:
            chain, inputs = self.chain_of(node)
            sizes = [0 if i in self.returned else tensor_bytes(val_of(i)) for i in inputs]
            limit = None if None in sizes else max(MIN_BYTES, GROWTH * sum(sizes))
            self.large[node] = limit is not None and any(
                (size := tensor_bytes(val_of(n))) is not None and size >= limit
                for n in chain if not is_view(n))
        return self.large[node]

    def chain_of(self, node: fx.Node) -> tuple[set[fx.Node], set[fx.Node]]:
        """An input-only value's chain (the node and the nodes it is made from) and the sources
        (`is_source`) that chain reads."""
        chain: set[fx.Node] = {node}
        sources: set[fx.Node] = set()
        stack = [node]
        while stack:
            for arg in stack.pop().all_input_nodes:
                if arg in chain or arg in sources:
                    continue
                if self.is_source(arg):
                    sources.add(arg)
                else:
                    chain.add(arg)
                    stack.append(arg)
        return chain, sources


def copy_input_values_per_block(gm: fx.GraphModule,
                                ctx: PassContext) -> PassResult[InputValueCopies]:
    """Give each block its own copy of the shared input-only values; see the module docstring.

    Reads ``ctx.cfg.tuning.copy_input_values``.
    """
    unchanged = PassResult(gm, modified=False, artifact=InputValueCopies({}))
    if not ctx.cfg.tuning.copy_input_values:
        return unchanged
    # NB: the clone is analysed (once) and edited; with nothing to copy the input goes on
    new_gm, _ = clone_module(gm)
    graph = new_gm.graph
    analysis = _Analysis.of(graph)
    to_copy = analysis.values_to_copy()
    if not to_copy:
        return unchanged
    made: dict[Owner, dict[fx.Node, fx.Node]] = {}  # per owner: original -> its copy
    origin: dict[fx.Node, fx.Node] = {}  # copy -> original
    readers = {node: analysis.block_readers(node) for node in to_copy}
    for node in to_copy:
        for owner in readers[node]:
            copy = _copy_chain(analysis, graph, node, owner, made=made.setdefault(owner, {}),
                               origin=origin)
            for user in readers[node][owner]:
                user.replace_input_with(node, copy)
    # NB: an early reader redirected above may itself be a copied value the forward still
    # reads (the merge made a forward node of it): it keeps reading the originals, so that no
    # copy is read outside its block
    for node in to_copy:
        if node.users:
            for arg in node.all_input_nodes:
                if arg in origin:
                    node.replace_input_with(arg, origin[arg])
    _erase_unread(graph, analysis.from_inputs | set(origin))
    copies, sizes = _listed(to_copy, made, set(graph.nodes))
    late = set(origin) | _originals_left(graph, to_copy, analysis)
    new_gm = rebuild_in_order(new_gm, _made_before_readers(graph, late))
    new_gm.graph.lint()
    return PassResult(new_gm, modified=True, artifact=InputValueCopies(copies, sizes))


def _copy_chain(analysis: _Analysis, graph: fx.Graph, node: fx.Node, owner: Owner, *,
                made: dict[fx.Node, fx.Node], origin: dict[fx.Node, fx.Node]) -> fx.Node:
    """``node`` copied for ``owner`` (before the output: `_copies_before_readers` places it),
    with the inputs whose own chains hold a large value; other inputs (the labels, small
    masks made from them, values the forward returns) are read as they are, so the block
    still reads what it read before and launches where it did. Copies made for ``owner``
    already (``made``) are reused; a node redirected to another owner's copy is copied
    from the original (``origin``)."""
    node = origin.get(node, node)
    if node in made:
        return made[node]
    block, piece = owner

    def copied(arg: fx.Node) -> fx.Node:
        arg = origin.get(arg, arg)
        if analysis.is_source(arg):
            return arg
        # NB: a multi-output op goes with the getitem that reads it: segments pass tensors
        if analysis.holds_large_from_small(arg) or isinstance(val_of(arg), (tuple, list)):
            return _copy_chain(analysis, graph, arg, owner, made=made, origin=origin)
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


def _erase_unread(graph: fx.Graph, erasable: set[fx.Node]) -> None:
    """Erase the nodes of ``erasable`` nothing reads any more, until none is left: originals
    whose readers all took copies, and copies whose only reader was such an original."""
    erased = True
    while erased:
        erased = False
        for node in reversed(list(graph.nodes)):
            if node in erasable and not node.users:
                graph.erase_node(node)
                erasable.discard(node)
                erased = True


def _listed(to_copy: list[fx.Node], made: dict[Owner, dict[fx.Node, fx.Node]],
            alive: set[fx.Node]) -> tuple[dict[str, tuple[str, ...]], dict[str, int]]:
    """The artifact's copies and sizes: each copied value's copies still in the graph (a copy
    whose only reader was an original now erased went with it), in (block, piece) order."""
    copies: dict[str, tuple[str, ...]] = {}
    sizes: dict[str, int] = {}
    owners = sorted(made, key=lambda o: (o[0], -1 if o[1] is None else o[1]))
    for node in to_copy:
        kept = tuple(made[o][node].name for o in owners
                     if node in made[o] and made[o][node] in alive)
        if kept:
            copies[node.name] = kept
            sizes[node.name] = tensor_bytes(val_of(node)) or 0
    return copies, sizes


def _originals_left(graph: fx.Graph, to_copy: list[fx.Node],
                    analysis: _Analysis) -> set[fx.Node]:
    """The copied values still read (by nodes of no block: the last block's loss) and the
    values of their chains nothing else reads: made before their first reader, they are
    not held through the forward, and Inductor can fuse them into that reader."""
    left = {node for node in to_copy if node.users}
    for node in reversed(list(graph.nodes)):
        if (node not in left and node in analysis.from_inputs and not analysis.is_source(node)
                and node.users and all(user in left for user in node.users)):
            left.add(node)
    return left


def _made_before_readers(graph: fx.Graph, late: set[fx.Node]) -> list[fx.Node]:
    """The graph's order with each node of ``late`` (the copies, the originals left) moved to
    right before its first reader (its inputs of ``late`` first): as late as it can be made,
    so it lives no longer than its readers need it.

    NB: the originals a copy reads come before that reader: they are in the chain of the
    value the reader read, made before it."""
    order: list[fx.Node] = []
    placed: set[fx.Node] = set()

    def place(node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            if arg in late and arg not in placed:
                place(arg)
        order.append(node)
        placed.add(node)

    for node in graph.nodes:
        if node not in late or not node.users:
            place(node)
    return order


def check_input_values_per_block(result: PassResult[InputValueCopies], ctx: PassContext) -> None:
    """The invariants in the module docstring (none with ``ctx.cfg.tuning.copy_input_values``
    off)."""
    if not ctx.cfg.tuning.copy_input_values:
        return
    analysis = _Analysis.of(result.gm.graph)
    left = analysis.values_to_copy()
    if left:
        raise GraphInvariantError(PASS_NAME, f"{left[0].name} is read by the early nodes of "
                                  "several blocks (or with the forward) and was not copied")
    by_name = {n.name: n for n in analysis.nodes}
    for name in (name for made in result.artifact.copies.values() for name in made):
        copy = by_name.get(name)
        if copy is None or not is_early(copy):
            raise GraphInvariantError(PASS_NAME, f"the copy {name} is not an early node")
        owner = early_owner(copy)
        for user in copy.users:
            if analysis.owner_of(user) != owner:
                raise GraphInvariantError(PASS_NAME, f"the copy {name} of block {owner[0]} "
                                          f"is read by {user.name}, not a node of its block")
        for arg in copy.all_input_nodes:
            if analysis.is_source(arg):
                continue
            own = early_owner(arg) == owner
            if not own and analysis.holds_large_from_small(arg):
                raise GraphInvariantError(PASS_NAME, f"the copy {name} of block {owner[0]} "
                                          f"reads {arg.name}, a large value not its block's own")
