"""split_segments: the forward module as an ordered list of per-stream segments.

What: groups the stream-annotated forward graph into segments, each a run of
nodes on one stream that the emitter compiles as one unit, and returns the
split module (torch's ``split_module``) whose top-level graph calls the
segments in launch order, plus a `Segment` record for each.

Order: main-stream nodes keep their order, and so do the nodes of blocks'
stages (`NodeMeta.stage`: the forward itself, on a block's side stream),
each stage a segment of its own; each block's other nodes (its head, local
loss and early backward, the forward ones first: `forward_first`) form
one segment, launched right after the segment that ends with the
block's launch point (the last main or stage node it reads); a block in
pieces (``NodeMeta.piece``) launches a segment per piece, each at its own
launch point and never before the piece before it (one stream runs them in
order); main nodes that run after the join (the loss sum) form the last
segment. So the main stream is cut only where a block becomes ready::

    seg_0_stream_0              stage 0 forward
    seg_1_block_0_stream_1      head 0, loss 0, block 0's backward   (side stream 1)
    seg_2_stream_0              stage 1 forward
    seg_3_block_1_stream_2      head 1, loss 1, block 1's backward   (side stream 2)
    seg_4_stream_0              the rest of the forward
    seg_5_stream_0_after_join   waits for the side streams; the loss sum
    output                      join: the main stream waits for every side stream

With the stages on side streams (``Tuning.stages_on_side``)::

    seg_0_block_0_stage_stream_1    stage 0 forward                     (side stream 1)
    seg_1_block_0_stream_1          head 0, loss 0, block 0's backward  (side stream 1)
    seg_2_block_1_stage_stream_2    stage 1 forward, after seg_0's event
    seg_3_block_1_stream_2          head 1, loss 1, block 1's backward
    seg_4_stream_0                  the last stage, after seg_2's event
    seg_5_stream_0_after_join       the loss sum

Why a stable reorder first: the stock partitioner (min-cut) may leave
a block's nodes interleaved with forward nodes; moving them next to their
launch point keeps one segment per block (fewer compiled calls) and is legal
because a block reads nothing of the main stream (or of a stage) after its
launch point, and the main stream reads a block only after the join
(assign_streams).

Invariants out (`check_segments`, which `passes/pipeline.py` runs): a new
split module, computing the same outputs as the input; segments in topological
order; every segment runs on one stream and returns a tuple; a segment's
``waits_for`` names exactly the earlier segments on other streams whose
outputs it reads.
"""
from __future__ import annotations

import dataclasses
import heapq
import json
import operator

import torch.fx as fx
from torch.fx.passes.split_module import split_module

from erase_fx.errors import GraphInvariantError
from erase_fx.passes.graph import draws_random_numbers, output_descriptors, rebuild_in_order
from erase_fx.passes.node_meta import MAIN_STREAM, get_meta, is_early
from erase_fx.passes.pass_result import DumpFile, PassContext, PassResult, graph_text

PASS_NAME = "split_segments"


def in_main_order(node: fx.Node) -> bool:
    """Whether a node keeps its place in the forward's order: a main-stream node, or a node of a
    block's stage (`NodeMeta.stage`: the forward itself, moved to the block's side stream)."""
    meta = get_meta(node)
    return meta.stream == MAIN_STREAM or meta.stage


@dataclasses.dataclass(frozen=True)
class Segment:
    """One compiled unit of the forward.

    Attributes:
        name: the submodule's name in the split module (``seg_<k>_...``).
        stream: the stream it runs on (0 = main).
        block: the early block it runs (or whose stage it runs), or None for forward
            segments.
        nodes: names of the forward-graph nodes it computes.
        waits_for: names of earlier segments on other streams whose outputs it reads.
        stage: it runs the block's own stage (`NodeMeta.stage`), not its head and backward.
        at_graph_end: it runs a block at the graph's end (`NodeMeta.at_graph_end`): the
            program may leave it to the backward, and the main stream does not wait for it
            at the forward's end.
    """

    name: str
    stream: int
    block: int | None
    nodes: tuple[str, ...]
    waits_for: tuple[str, ...]
    stage: bool = False
    at_graph_end: bool = False


@dataclasses.dataclass(frozen=True)
class Segments:
    """The artifact of split_segments: the segments of the split module, in launch order; renders
    the split module, each segment and the segments as data."""

    segments: tuple[Segment, ...]

    def render(self, gm: fx.GraphModule) -> tuple[DumpFile, ...]:
        files = [DumpFile(".py", "the split module: one call per segment, in launch order",
                          graph_text(gm))]
        for segment in self.segments:
            files.append(DumpFile(f".{segment.name}.py",
                                  f"segment {segment.name} of the split module",
                                  graph_text(getattr(gm, segment.name))))
        files.append(DumpFile(".segments.json", "the segments, as data", json.dumps(
            [dataclasses.asdict(s) for s in self.segments], indent=2) + "\n"))
        return tuple(files)


@dataclasses.dataclass(frozen=True)
class SegmentedForward(PassResult[Segments]):
    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.artifact.segments

    def segment(self, name: str) -> Segment:
        return next(s for s in self.segments if s.name == name)


def split_segments(gm: fx.GraphModule, ctx: PassContext) -> SegmentedForward:
    """Split a stream-annotated forward module; see the module docstring.

    Reads nothing from ``ctx``: the streams are in each node's meta.
    """
    ordered = _launch_order(gm)
    reordered = rebuild_in_order(gm, ordered)
    piece_of = pieces_of_side_nodes(list(reordered.graph.nodes))
    pieced: dict[int | None, bool] = {}
    for node, piece in piece_of.items():
        block = get_meta(node).block
        pieced[block] = pieced.get(block, False) or piece > 0

    key_of: dict[str, str] = {}
    segment_of_key: dict[str, tuple[int, int | None, bool, int | None, bool]] = {}
    index = -1
    previous = None
    for node in reordered.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        meta = get_meta(node)
        side = meta.stream != MAIN_STREAM
        group = (meta.stream, meta.block if side else None, meta.after_join,
                 piece_of.get(node) if side and pieced.get(meta.block) else None, meta.stage)
        if group != previous:
            index += 1
            previous = group
        key = str(index)
        key_of[node.name] = key
        segment_of_key[key] = group

    split = split_module(
        reordered, None, lambda node: key_of[node.name], keep_original_order=True
    )
    segments = _name_and_box_segments(split, segment_of_key)
    split.graph.lint()
    split.recompile()
    return SegmentedForward(split, modified=True, artifact=Segments(segments))


def pieces_of_side_nodes(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """The piece of each side-stream node: its own (`NodeMeta.piece`), else the first piece
    that reads it (a block's head runs with the first piece that needs it), else the last
    piece it reads, else 0; and never before a piece it reads (a node merged by
    `merge_common_subexpressions` may be shared between pieces)."""
    piece: dict[fx.Node, int | None] = {}
    for node in reversed(nodes):
        meta = get_meta(node)
        if node.op == "output" or in_main_order(node):
            continue
        readers = [piece[u] for u in node.users if piece.get(u) is not None]
        piece[node] = meta.piece if meta.piece is not None else min(readers, default=None)
    for node in nodes:
        if node in piece:
            inputs = [piece[a] for a in node.all_input_nodes if a in piece]
            piece[node] = max([p for p in (piece[node], *inputs) if p is not None], default=0)
    return piece


def _launch_order(gm: fx.GraphModule) -> list[fx.Node]:
    """Main nodes in order; each block's nodes (each piece of a block in pieces) right after
    its launch point; after-join nodes last."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    piece_of = pieces_of_side_nodes(nodes)
    block_nodes: dict[tuple[int, int], list[fx.Node]] = {}
    launch_after: dict[tuple[int, int], int] = {}
    for node in nodes:
        meta = get_meta(node)
        if node.op == "output" or in_main_order(node):
            continue
        key = (meta.block, piece_of[node])
        block_nodes.setdefault(key, []).append(node)
        # NB: a block that reads only graph inputs launches before any forward node.
        main_inputs = [a for a in node.all_input_nodes
                       if a.op != "placeholder" and in_main_order(a)]
        if any(get_meta(a).after_join for a in main_inputs):
            raise GraphInvariantError(PASS_NAME, "a side node reads an after-join value",
                                      node=node.name)
        launch = max((position[a] for a in main_inputs), default=-1)
        launch_after[key] = max(launch_after.get(key, -1), launch)
    # NB: a block's pieces launch in order: one stream runs them one after another
    for block, piece in sorted(block_nodes):
        if piece > 0 and (block, piece - 1) in launch_after:
            launch_after[(block, piece)] = max(launch_after[(block, piece)],
                                               launch_after[(block, piece - 1)])

    block_nodes = {key: forward_first(members) for key, members in block_nodes.items()}
    launches: dict[int, list[tuple[int, int]]] = {}
    for block in sorted(block_nodes):
        launches.setdefault(launch_after[block], []).append(block)
    ordered = [n for n in nodes if n.op == "placeholder"]
    for block in launches.get(-1, []):
        ordered.extend(block_nodes[block])
    # NB: the elements of a multi-output op stay right after it, in its segment.
    elements: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        if _is_element(node) and in_main_order(node):
            elements.setdefault(node.args[0], []).append(node)
    deferred = _feeding_mutations_only(nodes) if any(
        get_meta(n) is not None and get_meta(n).stage for n in nodes) else set()
    emitted: set[fx.Node] = set()

    def with_deferred_inputs(node: fx.Node) -> list[fx.Node]:
        found = []
        for arg in node.all_input_nodes:
            if arg in deferred and arg not in emitted:
                found.extend(with_deferred_inputs(arg))
                emitted.add(arg)
                found.append(arg)
        return found

    after_join = []
    for node in nodes:
        if node.op in ("placeholder", "output") or node in deferred:
            continue
        meta = get_meta(node)
        if not in_main_order(node) or (_is_element(node) and node.args[0] in elements):
            continue
        here = [*with_deferred_inputs(node), node, *elements.get(node, [])]
        if meta.after_join:
            after_join.extend(here)
            continue
        ordered.extend(here)
        for launch_point in here:
            for block in launches.get(position[launch_point], []):
                ordered.extend(block_nodes[block])
    rest = [n for n in nodes if n in deferred and n not in emitted]
    return ordered + rest + after_join + [n for n in nodes if n.op == "output"]


def forward_first(nodes: list[fx.Node]) -> list[fx.Node]:
    """``nodes`` (one block piece's side-stream nodes, in graph order) with each forward node
    as early as its inputs allow: ahead of the early backward nodes it does not read.

    Why: the partitioner leaves a block's loss *value* (the scalar its local loss
    returns, which the early backward does not read) after the block's whole early
    backward. Inductor then computes it last in the segment, reading the logits at
    each row's target, so the logits live through the backward and their gradient
    cannot be written over them (two batch x vocabulary values at once on a side
    stream: 2 x 64 MiB a block on gpt:16:384:256:8). Computed first, the loss value
    leaves the gradient kernel the logits' last reader.

    Forward nodes keep their order among themselves, early nodes theirs, and the
    ops that draw random numbers (`draws_random_numbers`: dropout, and attention
    kernels that take a seed, cuDNN's backward among them) keep theirs among all
    nodes: under ``aot_eager`` they draw from one generator in program order.
    """
    members = set(nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waiting = {n: sum(1 for a in n.all_input_nodes if a in members) for n in nodes}
    random = [n for n in nodes if draws_random_numbers(n)]
    next_random = dict(zip(random, random[1:]))
    for node in random[1:]:
        waiting[node] += 1
    ready = [(is_early(n), index[n]) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        node = nodes[heapq.heappop(ready)[1]]
        ordered.append(node)
        followers = [u for u in node.users if u in members]
        if node in next_random:
            followers.append(next_random[node])
        for follower in followers:
            waiting[follower] -= 1
            if waiting[follower] == 0:
                heapq.heappush(ready, (is_early(follower), index[follower]))
    if len(ordered) != len(nodes):
        raise GraphInvariantError(PASS_NAME, "a block's side nodes are not in topological order")
    return ordered


def _feeding_mutations_only(nodes: list[fx.Node]) -> set[fx.Node]:
    """Main-stream nodes that only feed in-place updates of inputs (BatchNorm's running
    statistics and batch count, written back by ``copy_`` at the end of the forward).

    With stages on side streams such a node sits between a stage's nodes in
    the forward's order and would cut the stage into several segments, each
    an extra launch and sync; it is emitted right before the update that
    reads it instead (nothing else waits for it).
    """
    written_back = _returned_as_input_mutations_only(nodes[-1].graph)
    feeds: set[fx.Node] = set()
    for node in reversed(nodes):
        meta = get_meta(node)
        if (node.op != "call_function" or meta is None or meta.stream != MAIN_STREAM
                or meta.stage or meta.after_join or node.is_impure() or not node.users
                or _is_element(node) or any(_is_element(u) for u in node.users)):
            continue
        if all(u in feeds or (u.op == "output" and node in written_back)
               or (u.op == "call_function" and u.is_impure()
                   and get_meta(u).stream == MAIN_STREAM) for u in node.users):
            feeds.add(node)
    return feeds


def _returned_as_input_mutations_only(graph: fx.Graph) -> set[fx.Node]:
    """Output values that are only new values of mutated inputs (AOTAutograd writes them
    back after the forward, when the graph does not do it itself with ``copy_``)."""
    from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput

    kinds: dict[fx.Node, set[bool]] = {}
    for value, desc in output_descriptors(graph) or ():
        if isinstance(value, fx.Node):
            kinds.setdefault(value, set()).add(isinstance(desc, InputMutationAOTOutput))
    return {value for value, mutation in kinds.items() if mutation == {True}}


def _is_element(node: fx.Node) -> bool:
    """A ``getitem`` of a multi-output op (not of a graph input)."""
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "call_function")


def _name_and_box_segments(
    split: fx.GraphModule,
    segment_of_key: dict[str, tuple[int, int | None, bool, int | None, bool]],
) -> tuple[Segment, ...]:
    """Give segments greppable names and make each return a tuple."""
    graph = split.graph
    producer: dict[fx.Node, str] = {}
    segments: list[Segment] = []
    for k, call in enumerate([n for n in graph.nodes if n.op == "call_module"]):
        key = str(call.target).removeprefix("submod_")
        stream, block, after_join, piece, stage = segment_of_key[key]
        sub = getattr(split, call.target)
        at_graph_end = block is not None and not stage and any(
            get_meta(n) is not None and get_meta(n).at_graph_end for n in sub.graph.nodes)
        if block is not None:
            part = f"_piece_{piece}" if piece is not None else ("_stage" if stage else "")
            part += "_graph_end" if at_graph_end else ""
            name = f"seg_{k}_block_{block}{part}_stream_{stream}"
        else:
            name = f"seg_{k}_stream_{stream}" + ("_after_join" if after_join else "")
        delattr(split, call.target)
        setattr(split, name, sub)
        call.target = name
        _box_outputs(graph, call, sub)
        stream_of = {s.name: s.stream for s in segments}
        waits = sorted(
            {producer[a] for a in call.all_input_nodes
             if a in producer and stream_of[producer[a]] != stream}
        )
        for user in call.users:
            producer[user] = name
        segments.append(Segment(
            name=name,
            stream=stream,
            block=block,
            stage=stage,
            nodes=tuple(n.name for n in sub.graph.nodes if n.op not in ("placeholder", "output")),
            waits_for=tuple(waits),
            at_graph_end=at_graph_end,
        ))
    return tuple(segments)


def _box_outputs(graph: fx.Graph, call: fx.Node, sub: fx.GraphModule) -> None:
    """A segment that returns one value returns a 1-tuple, read through getitem."""
    out = next(n for n in sub.graph.nodes if n.op == "output")
    if isinstance(out.args[0], (tuple, list)):
        return
    out.args = ((out.args[0],),)
    sub.recompile()
    users = list(call.users)
    with graph.inserting_after(call):
        item = graph.call_function(operator.getitem, (call, 0))
    item.meta = dict(call.meta)
    for user in users:
        user.replace_input_with(call, item)


def check_segments(result: SegmentedForward, ctx: PassContext) -> None:
    split = result.gm
    seen: set[str] = set()
    for call in [n for n in split.graph.nodes if n.op == "call_module"]:
        seg = result.segment(call.target)
        streams = {get_meta(n).stream for n in getattr(split, call.target).graph.nodes
                   if n.op not in ("placeholder", "output") and get_meta(n) is not None}
        if streams - {seg.stream}:
            raise GraphInvariantError(PASS_NAME, "a segment mixes streams", node=seg.name)
        if not set(seg.waits_for) <= seen:
            raise GraphInvariantError(PASS_NAME, "a segment waits for a later one", node=seg.name)
        seen.add(seg.name)
