"""recompute_boundary_values: a block's head and early backward recompute the cheap elementwise
values they read from the forward, instead of reading them across a segment boundary.

What: every value a block's segment (its head, local loss and early
backward: the side-stream nodes of one block that are not its stage; a
block in pieces is left as it is) reads from outside that segment is written
out by the segment that made it and read back, and lives until the block has
run. Where such a value is the end of a chain of elementwise ops and views
(`recomputable`: pure aten or prims ops tagged ``pointwise``, views, and
constant factories; never an op that draws random numbers, mutates, does
matrix work or returns several values) over values the segment can read
more cheaply, the segment computes the chain itself (a copy of it, marked as
the block's, placed before the segment's first reader) and reads the
chain's inputs instead. The rule (`_Planner.next_recompute`), greedy in
graph order until nothing changes: a value is recomputed when the bytes of
its chain's inputs that the segment does not read yet are fewer than its
own; or, where none pays alone, a group is: the values that such new inputs
(with what the segment reads already) suffice to make, when they hold more
bytes than the new inputs (a tanh GELU's three fp32 pieces, made from one
fp32 matrix product). Inputs the segment reads already, graph inputs, and
values the forward returns cost nothing: they exist anyway; bytes are memory
(a view holds none of its own, a new view holds its base). A value that
matrix work in the segment reads is never recomputed (a product needs its
operand written out: recomputed, it would be written again by a kernel of
its own). New inputs come only from streams the segment reads
from already (its own, where its stage runs, or the main stream), so no
segment waits for a stream it did not wait for. A chain of more than
`MAX_CHAIN` nodes is not copied. Originals nothing reads any more are dropped.

Why: stock Inductor compiles a forward and its backward as two graphs cut by
the min-cut partitioner, which saves few values and recomputes elementwise
ones in the backward, fused into the kernels that read them. erase_fx cuts
the forward into segments, one compiled unit each, and a cut passes every
value that crosses it: on gpt:8:768:1024:6 a block's stage handed its
backward the GELU's fp32 pieces (tanh, its argument, the products: four
batch x 4d tensors, 100 MB each) and LayerNorm's normalized inputs, written
and read again. The segmented program ran 1.10x of stock's time on one
stream, where the same program compiled as one graph ran 1.01x (H200, step
API; `python -m bench.segment_cost` measures it). Recomputed, such a value costs
an elementwise pass over a smaller input, fused into the block's kernels, and
the value is never held.

``Tuning.recompute_boundary_values=False`` turns the pass off (the
input comes back unchanged).

Invariants out (`check_boundary_values`): the stream assignment's
(`check_stream_assignment`); every copy is a node of the block segment it was
made for, read only by that segment, and recomputable; no value is left that
the rule would recompute (the pass ran to its fixpoint).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.fx as fx

from erase_fx.errors import GraphInvariantError
from erase_fx.passes.assign_streams import check_stream_assignment
from erase_fx.passes.flops import node_flops
from erase_fx.passes.graph import (
    EFFECT_DECLARING_NAMESPACES,
    clone_module,
    draws_random_numbers,
    is_view,
    returned_values,
    tensor_bytes,
    topo_positions,
    val_of,
)
from erase_fx.passes.node_meta import MAIN_STREAM, NodeMeta, Role, get_meta, set_meta
from erase_fx.passes.pass_result import DumpFile, PassContext, PassResult, graph_text
from erase_fx.passes.split_segments import pieces_of_side_nodes

PASS_NAME = "recompute_boundary_values"

#: The most nodes one recomputed value brings along into a block's segment (it and the
#: elementwise ops and views it is made through): a longer chain is read as it is.
MAX_CHAIN = 32
#: Ops with no tensor input that make a constant: recomputed anywhere for free.
CONSTANT_FACTORIES = frozenset({
    torch.ops.aten.full.default,
    torch.ops.aten.scalar_tensor.default,
    torch.ops.aten.arange.default,
    torch.ops.aten.arange.start,
    torch.ops.aten.arange.start_step,
    torch.ops.prims.iota.default,
})

#: A block segment: (side stream, block, piece or None).
SegmentKey = tuple[int, int, "int | None"]


@dataclasses.dataclass(frozen=True)
class BoundaryRecomputes:
    """What each block segment now computes itself.

    Attributes:
        recomputed: per block segment (``"block 0"``, ``"block 1 piece 0"``), the values it
            read across its boundary and now recomputes, in graph order.
        bytes_before: per block segment, the bytes of the values it read from outside
            (graph inputs and values the forward returns left out), before the pass.
        bytes_after: the same, after.
    """

    recomputed: dict[str, tuple[str, ...]]
    bytes_before: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_after: dict[str, int] = dataclasses.field(default_factory=dict)

    def render(self, gm: fx.GraphModule) -> tuple[DumpFile, ...]:
        lines = [f"{where}: {len(names)} value(s) recomputed ({', '.join(names)}); reads "
                 f"{_mib(self.bytes_before.get(where))} -> {_mib(self.bytes_after.get(where))} "
                 "across its boundary" for where, names in self.recomputed.items()]
        part = ("the forward with each block segment's cheap boundary values recomputed"
                + (": " + "; ".join(lines) if lines else ": none"))
        return (DumpFile(".py", part, graph_text(gm)),)


def _mib(size: int | None) -> str:
    return "?" if size is None else f"{size / 2**20:.2f} MiB"


def recomputable(node: fx.Node) -> bool:
    """Whether a copy of ``node`` computes what it computed, cheaply and alone: one tensor out
    of a pure aten or prims op without matrix work that draws no random numbers and mutates
    nothing, which is elementwise (tagged ``pointwise``), a view, or a constant factory."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if (target.namespace not in EFFECT_DECLARING_NAMESPACES or node.is_impure()
            or target._schema.is_mutable or draws_random_numbers(node)
            or not isinstance(val_of(node), torch.Tensor) or node_flops(node) != 0):
        return False
    return (torch.Tag.pointwise in target.tags or target.is_view
            or target in CONSTANT_FACTORIES)


@dataclasses.dataclass
class _Segment:
    """One block segment while the pass edits it: its nodes and what it reads from outside."""

    key: SegmentKey
    members: set[fx.Node]
    reads: set[fx.Node]

    def streams_read(self, free) -> frozenset[int]:
        """Its own stream and those it reads values from already: a copy reads new inputs
        only from these, so that no segment waits for a stream it did not wait for."""
        return frozenset({self.key[0], *(get_meta(v).stream for v in self.reads
                                         if not free(v) and get_meta(v) is not None)})

    @property
    def label(self) -> str:
        _, block, piece = self.key
        return f"block {block}" + ("" if piece is None else f" piece {piece}")


def block_segments(graph: fx.Graph) -> list[_Segment]:
    """The block segments of a stream-annotated forward (a block's side-stream nodes that are
    not its stage's), in graph order of their first node, each with the nodes it reads from
    outside. A block in pieces (`NodeMeta.piece`) is left out: its pieces read each other's
    values and are cut where `split_segments` derives them, which a copy would move."""
    nodes = list(graph.nodes)
    piece_of = pieces_of_side_nodes(nodes)
    pieced = {get_meta(n).block for n, piece in piece_of.items() if piece > 0}
    found: dict[SegmentKey, _Segment] = {}
    for node in nodes:
        meta = get_meta(node)
        if node.op in ("placeholder", "output") or meta is None or meta.stage:
            continue
        if meta.stream in (None, MAIN_STREAM) or meta.block is None:
            continue
        if meta.block in pieced or meta.piece is not None:
            continue
        key = (meta.stream, meta.block, None)
        found.setdefault(key, _Segment(key, set(), set())).members.add(node)
    for segment in found.values():
        segment.reads = {a for n in segment.members for a in n.all_input_nodes
                         if a not in segment.members}
    return list(found.values())


class _Planner:
    """The rule of the module docstring over one graph: which chain each boundary value
    would be recomputed through, and whether that pays."""

    def __init__(self, graph: fx.Graph):
        self.position = topo_positions(graph)
        self.returned = returned_values(graph)

    def free(self, node: fx.Node) -> bool:
        """A value a segment reads at no cost: a graph input or a value the forward returns
        (it exists past the join anyway)."""
        return node.op in ("placeholder", "get_attr") or node in self.returned

    def chain_of(self, value: fx.Node, reads: set[fx.Node]
                 ) -> tuple[list[fx.Node], set[fx.Node]] | None:
        """``value`` and the recomputable nodes it is made through, down to values the segment
        reads already, free values and nodes that are not recomputable (the chain's
        inputs); in graph order. None if it is longer than `MAX_CHAIN`."""
        chain: set[fx.Node] = {value}
        inputs: set[fx.Node] = set()
        stack = [value]
        while stack:
            for arg in stack.pop().all_input_nodes:
                if arg in chain or arg in inputs:
                    continue
                if arg in reads or self.free(arg) or not recomputable(arg):
                    inputs.add(arg)
                    continue
                chain.add(arg)
                if len(chain) > MAX_CHAIN:
                    return None
                stack.append(arg)
        return sorted(chain, key=self.position.__getitem__), inputs

    def pays(self, value: fx.Node, reads: set[fx.Node],
             members: set[fx.Node] = frozenset()) -> list[fx.Node] | None:
        """The chain to copy if recomputing ``value`` alone in a segment (``members``) that
        reads ``reads`` makes it read fewer bytes across its boundary, else None."""
        found = self._chain_and_new_inputs(value, reads, members)
        if found is None or not self._gains([value], found[1], reads):
            return None
        return found[0]

    def _chain_and_new_inputs(self, value: fx.Node, reads: set[fx.Node],
                              members: set[fx.Node], streams: frozenset[int] | None = None
                              ) -> tuple[list[fx.Node], list[fx.Node]] | None:
        """``value``'s chain and the inputs of it the segment does not read yet (free values
        left out); None for a value that is free, not recomputable or too long a chain, or
        that matrix work in the segment reads (the product needs it written out: recomputed,
        it would be written again, by a kernel of its own, to save only the holding; a
        weight's cast read by its gradient's product)."""
        if self.free(value) or not recomputable(value):
            return None
        found = self.chain_of(value, reads)
        if found is None:
            return None
        chain, inputs = found
        if any(node_flops(u) > 0 for u in value.users if u in members):
            return None
        new = sorted((i for i in inputs if i not in reads and not self.free(i)),
                     key=self.position.__getitem__)
        if streams is not None and any(get_meta(i).stream not in streams for i in new):
            return None
        return chain, new

    def next_recompute(self, segment: _Segment) -> list[fx.Node] | None:
        """The values (in graph order) to recompute next in the segment: the first value it
        reads that pays alone (`pays`); else the first whose chain's new inputs, read
        instead, let it recompute values of more bytes in all: every value it reads that
        those inputs, with what it reads already, suffice to make (a GELU's three fp32
        pieces made from one fp32 matrix product, none of which pays alone)."""
        ordered = sorted(segment.reads, key=self.position.__getitem__)
        streams = segment.streams_read(self.free)
        for value in ordered:
            found = self._chain_and_new_inputs(value, segment.reads, segment.members, streams)
            if found is not None and self._gains([value], found[1], segment.reads):
                return [value]
        for value in ordered:
            found = self._chain_and_new_inputs(value, segment.reads, segment.members, streams)
            if found is None or not found[1]:
                continue
            new = found[1]
            widened = segment.reads | set(new)
            group = [w for w in ordered
                     if (made := self._chain_and_new_inputs(w, widened, segment.members,
                                                            streams)) is not None
                     and not made[1]]
            if self._gains(group, new, segment.reads):
                return group
        return None

    def base_of(self, node: fx.Node) -> fx.Node:
        """The value whose memory ``node`` is (itself, or the base of the views it is)."""
        while is_view(node):
            node = node.all_input_nodes[0]
        return node

    def _gains(self, values: list[fx.Node], new: list[fx.Node], reads: set[fx.Node]) -> bool:
        """Whether ``values`` hold more bytes than the new inputs ``new`` they are made from,
        in memory: a view holds none of its own; a new view holds its base unless that is
        free or read already."""
        saved = [0 if is_view(v) else tensor_bytes(val_of(v)) for v in values]
        held = {self.base_of(i) for i in new}
        read = {self.base_of(r) for r in reads}
        added = [tensor_bytes(val_of(b)) for b in held if not self.free(b) and b not in read]
        return None not in saved and None not in added and sum(saved) > sum(added)

    def boundary_bytes(self, segment: _Segment) -> int:
        """The bytes of memory the segment reads from outside: each value's base once, free
        values (graph inputs, returned values, views of them) left out."""
        bases = {self.base_of(v) for v in segment.reads}
        return sum(tensor_bytes(val_of(b)) or 0 for b in bases if not self.free(b))


def plan_recomputes(graph: fx.Graph) -> list[tuple[str, str]]:
    """(block segment, value) for every value the rule would still recompute: empty on the
    pass's output."""
    planner = _Planner(graph)
    left = []
    for segment in block_segments(graph):
        found = planner.next_recompute(segment)
        if found is not None:
            left.append((segment.label, found[0].name))
    return left


def recompute_boundary_values(gm: fx.GraphModule,
                              ctx: PassContext) -> PassResult[BoundaryRecomputes]:
    """Recompute each block segment's cheap boundary values in it; see the module docstring.

    Reads ``ctx.cfg.tuning.recompute_boundary_values``.
    """
    unchanged = PassResult(gm, modified=False, artifact=BoundaryRecomputes({}))
    if not ctx.cfg.tuning.recompute_boundary_values:
        return unchanged
    new_gm, _ = clone_module(gm)
    graph = new_gm.graph
    segments = block_segments(graph)
    planner = _Planner(graph)
    recomputed: dict[str, tuple[str, ...]] = {}
    before: dict[str, int] = {}
    after: dict[str, int] = {}
    originals: set[fx.Node] = set()
    for segment in segments:
        names = []
        before[segment.label] = planner.boundary_bytes(segment)
        while (values := planner.next_recompute(segment)) is not None:
            for value in values:
                # NB: each value's chain is taken again: the copies before it read new inputs
                found = planner.chain_of(value, segment.reads)
                if found is None or value not in segment.reads:
                    continue
                chain, _ = found
                _copy_into(graph, segment, value, chain, planner)
                originals.update(chain)
                names.append(value.name)
        if names:
            recomputed[segment.label] = tuple(names)
        after[segment.label] = planner.boundary_bytes(segment)
    if not recomputed:
        return unchanged
    _erase_unread(graph, originals)
    graph.lint()
    new_gm.recompile()
    return PassResult(new_gm, modified=True,
                      artifact=BoundaryRecomputes(recomputed, before, after))


def _copy_into(graph: fx.Graph, segment: _Segment, value: fx.Node, chain: list[fx.Node],
               planner: _Planner) -> None:
    """Copy ``chain`` (ending at ``value``) into ``segment``, right before its first reader of
    ``value``, and point the segment's readers at the copy."""
    readers = sorted((u for u in value.users if u in segment.members),
                     key=planner.position.__getitem__)
    first = readers[0]
    reader_meta = get_meta(first)
    _, block, _ = segment.key
    copies: dict[fx.Node, fx.Node] = {}
    for original in chain:
        args, kwargs = fx.node.map_arg((original.args, original.kwargs),
                                       lambda a: copies.get(a, a))
        with graph.inserting_before(first):
            copy = graph.create_node(original.op, original.target, args, kwargs,
                                     name=f"{original.name}_recomputed_block_{block}")
        copy.meta = dict(original.meta)
        set_meta(copy, NodeMeta(Role.FORWARD, block=block, stream=reader_meta.stream,
                                piece=reader_meta.piece,
                                waits_for=_waits(copy, reader_meta.stream)))
        copies[original] = copy
        segment.members.add(copy)
    for reader in readers:
        reader.replace_input_with(value, copies[value])
        meta = get_meta(reader)
        set_meta(reader, dataclasses.replace(meta, waits_for=_waits(reader, meta.stream)))
    segment.reads = {a for n in segment.members for a in n.all_input_nodes
                     if a not in segment.members}
    planner.position = topo_positions(graph)


def _waits(node: fx.Node, stream: int) -> tuple[str, ...]:
    """The names of ``node``'s inputs made on another stream (`NodeMeta.waits_for`)."""
    return tuple(a.name for a in node.all_input_nodes if get_meta(a).stream != stream)


def _erase_unread(graph: fx.Graph, candidates: Iterable[fx.Node]) -> None:
    """Erase the originals nothing reads any more (a value made only for a block's backward),
    until none is left."""
    erasable = set(candidates)
    erased = True
    while erased:
        erased = False
        for node in reversed(list(graph.nodes)):
            if node in erasable and not node.users:
                graph.erase_node(node)
                erasable.discard(node)
                erased = True


def check_boundary_values(result: PassResult[BoundaryRecomputes], ctx: PassContext) -> None:
    """The invariants in the module docstring (none with
    ``ctx.cfg.tuning.recompute_boundary_values`` off)."""
    if not ctx.cfg.tuning.recompute_boundary_values:
        return
    graph = result.gm.graph
    check_stream_assignment(result, ctx)
    segment_of = {n: s for s in block_segments(graph) for n in s.members}
    for node in graph.nodes:
        if "_recomputed_block_" not in node.name:
            continue
        segment = segment_of.get(node)
        if segment is None:
            raise GraphInvariantError(PASS_NAME, "a recomputed copy is not in a block segment",
                                      node=node.name)
        if not recomputable(node):
            raise GraphInvariantError(PASS_NAME, "a copy of a node that is not recomputable",
                                      node=node.name)
        for user in node.users:
            if user.op != "output" and segment_of.get(user) is not segment:
                raise GraphInvariantError(PASS_NAME, f"the copy is read by {user.name}, "
                                          f"outside {segment.label}", node=node.name)
    left = plan_recomputes(graph)
    if left:
        where, name = left[0]
        raise GraphInvariantError(PASS_NAME, f"{where} still reads {name}, which pays to "
                                  "recompute")

