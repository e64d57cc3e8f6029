"""Which stream owns each node of a forward with early blocks, and why: decided once.

What: `decide_ownership(nodes, cfg)` returns an immutable `Ownership`: each
node is the main stream's (``None``) or one early block's (it runs on that
block's side stream), with the `OwnerReason`; which nodes are a block's **stage**;
which main nodes run **after the join**. `assign_streams` writes it into the
nodes' meta and adds the sync points; nothing after it moves a node.

The cost it weighs, per node:

- **bytes held across streams**: a value made on one stream and read on
  another is held by the stream that made it until the reader's stream has
  waited for it (a block's value read on the main stream: until the join;
  under CUDA graph capture `erase_fx.emit.release` frees it only then). A
  scalar loss crossing holds nothing; a large value (`MIN_BYTES`: a batch x
  classes log-softmax, soft targets) is memory held through the forward.
- **a block waiting**: a block launches after the last main node it reads,
  its **launch point**. No decision may move a launch point past main-stream
  matrix work (the next stage's product): a block never waits for more of
  the forward.
- **the critical path**: the main stream runs stage to stage; forward work
  that only one block needs (its head, its local loss) runs on the block's
  stream instead.

Under the constraints that make streams exact: a block reads only main
values, stage values and its own; the main stream reads a block's value only
after the join; a multi-output op and its ``getitem``s share a stream
(segments pass tensors, never tuples).

The claims, each with its reason, in the order one depends on the one before
(a node has one owner and one reason in the result):

1. ``EARLY``: a node of a block's early backward is the block's, but
   ``SHARED``: one the main stream or another block reads is made on the main
   stream for all of them, with its inputs (`merge_common_subexpressions`
   makes a block's ``t(w)`` the forward's). A block's copy of a value made
   from the inputs alone (`copy_input_values_per_block`) that its loss tail
   reads stays the block's: the tail joins the block (3) or runs after the
   join.
2. ``HEAD``: a forward node that only one block reads (with the returned
   loss, and main nodes that only feed it) is the block's: off the critical
   path. Not for a block at the graph's end: the main stream reads its loss
   and never waits for its backward.
3. ``LOSS_TAIL``: a node that only feeds the returned loss and reads one
   block's values (a cross-entropy's gather and mean after the saved
   log-softmax) is the block's, so that only the scalar crosses the join: on
   the main stream it would hold the block's large values until the join. It
   may read main values made after the launch point only where it saves
   bytes (it reads a large value of the block), only values made from the
   inputs alone, and with no matrix work in between.
4. ``INPUT_VALUE``: a large value made from the inputs alone that a head
   claimed (2) but a main node reads too (soft targets the last block's
   loss reads) is the main stream's, with the head's nodes it is made from:
   held by the block, the main node would read it after the join. Not where
   that makes the block wait for matrix work.
5. ``STAGE`` (`stages_go_to_side_streams`): the main nodes block ``b`` needs
   that no block launched before it needs are its stage, run on its stream
   before its head: the activations its backward reads never cross.
6. ``WITH_PRODUCER``: a ``getitem`` is where its multi-output op is, in the
   op's stage or not, whatever claimed it before.

``MAIN``: everything else, the forward's own path. A main node that reads a
block's value (not its stage's) runs after the join, and so does a main node
that reads an after-join node.
"""
from __future__ import annotations

import dataclasses
import enum
import operator
import types
from collections.abc import Mapping, Sequence

import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.passes.flops import node_flops
from erase_fx.passes.graph import (
    MIN_BYTES,
    draws_random_numbers,
    feeds_returns_only,
    loss_tails,
    made_from_inputs,
    returned_to_the_user,
    tensor_bytes,
    val_of,
)
from erase_fx.passes.node_meta import get_meta, is_early

#: A node's owner: an early block's id, or None for the main stream.
Owners = Mapping[fx.Node, "int | None"]


class OwnerReason(str, enum.Enum):
    """Why a node has its owner (module docstring, claims 1-6)."""

    MAIN = "main"  # the forward's own path
    EARLY = "early"  # a node of the block's early backward
    SHARED = "shared"  # an early value another stream reads: made on the main stream
    HEAD = "head"  # only the block reads it
    LOSS_TAIL = "loss_tail"  # feeds the returned loss, reads the block's values
    INPUT_VALUE = "input_value"  # large, made from the inputs alone, a main node reads it
    STAGE = "stage"  # the block's own stage (`stages_go_to_side_streams`)
    WITH_PRODUCER = "with_producer"  # a getitem, where its multi-output op is


@dataclasses.dataclass(frozen=True)
class Ownership:
    """Each node's owner (a block's id, None for the main stream) and the reason; the stage
    nodes (``owner`` maps each to its block); the main nodes that run after the join."""

    owner: Owners
    reason: Mapping[fx.Node, OwnerReason]
    stage: frozenset[fx.Node]
    after_join: frozenset[fx.Node]

    def named(self) -> dict[str, tuple[int | None, OwnerReason]]:
        """(owner, reason) by node name, for reports and tests."""
        return {node.name: (block, self.reason[node]) for node, block in self.owner.items()
                if node.op != "output"}


def stages_go_to_side_streams(cfg: EraseConfig, num_blocks: int) -> bool:
    """Whether blocks' stages run on their side streams (`Tuning.stages_on_side`).

    ``None`` (auto): when there are more early blocks than side streams, so
    that a side stream runs several blocks and reuses the memory of one
    block's activations for the next. With a block per stream nothing is
    reused, and per-stream memory pools and the extra events only cost
    (measured on an H200: DGL ResNet-18, 3 blocks on 4 streams, 5% slower and
    9% more step memory than with its stages on the main stream, when
    BatchNorm's statistics updates still cut each stage into three segments;
    that is fixed in split_segments, not re-measured).
    """
    if cfg.streams < 2:
        return False  # NB: a block's stage would queue behind the block before it
    if cfg.tuning.stages_on_side is None:
        return num_blocks > cfg.streams
    return cfg.tuning.stages_on_side


def graph_end_blocks(nodes: Sequence[fx.Node]) -> set[int]:
    """The blocks that run at the graph's end (`NodeMeta.at_graph_end`)."""
    return {get_meta(n).block for n in nodes if is_early(n) and get_meta(n).at_graph_end}


def decide_ownership(nodes: Sequence[fx.Node], cfg: EraseConfig) -> Ownership:
    """The owner of every node of a forward graph, in graph order; see the module docstring.

    Reads ``cfg.streams`` and ``cfg.tuning.stages_on_side`` (claim 5)."""
    nodes = list(nodes)
    decided = _Decided.early(nodes)
    from_inputs = made_from_inputs(nodes)
    matrix_work = frozenset(n for n in nodes if node_flops(n) > 0)
    at_end = graph_end_blocks(nodes)
    kept = _loss_tail_copies(nodes, decided.owner, from_inputs)
    decided = decided.claim(OwnerReason.SHARED, _shared_early_values(nodes, decided.owner, kept))
    returned = returned_to_the_user(nodes[-1].graph)
    if returned is not None:  # NB: without output descriptors, nothing moves: the safe schedule
        on_main = {node for node, block in decided.owner.items() if block is None}
        feeds = feeds_returns_only(nodes, returned, on_main.__contains__)
        decided = decided.claim(OwnerReason.HEAD, _heads(nodes, decided.owner, feeds, at_end))
        decided = decided.claim(OwnerReason.LOSS_TAIL,
                                _tails(nodes, decided.owner, feeds, from_inputs, matrix_work))
    decided = decided.claim(OwnerReason.INPUT_VALUE,
                            _input_values(nodes, decided.owner, from_inputs, matrix_work))
    stage: frozenset[fx.Node] = frozenset()
    blocks = {get_meta(n).block for n in nodes if is_early(n)} - at_end
    if stages_go_to_side_streams(cfg, len(blocks)):
        claims = _stages(nodes, decided.owner, at_end)
        decided, stage = decided.claim(OwnerReason.STAGE, claims), frozenset(claims)
    claims, stage = _getitems(nodes, decided.owner, stage)
    decided = decided.claim(OwnerReason.WITH_PRODUCER, claims, every=True)
    return Ownership(types.MappingProxyType(decided.owner),
                     types.MappingProxyType(decided.reason), stage,
                     _after_join(nodes, decided.owner, stage))


@dataclasses.dataclass(frozen=True)
class _Decided:
    """The owners and reasons so far; each claim makes a new one."""

    owner: Owners
    reason: Mapping[fx.Node, OwnerReason]

    @classmethod
    def early(cls, nodes: list[fx.Node]) -> _Decided:
        """Claim 1's start: each early node its block's, every other node the main stream's."""
        owner = {node: get_meta(node).block if is_early(node) else None for node in nodes}
        return cls(owner, {node: OwnerReason.MAIN if block is None else OwnerReason.EARLY
                           for node, block in owner.items()})

    def claim(self, why: OwnerReason, claims: Mapping[fx.Node, int | None], *,
              every: bool = False) -> _Decided:
        """These owners, with ``claims`` (node -> its new owner) taken, for ``why``: a claim
        that leaves a node's owner as it was keeps its reason, unless ``every`` (a getitem's
        place is its op's, whoever owned it)."""
        changed = {n: b for n, b in claims.items() if every or self.owner[n] != b}
        return _Decided({**self.owner, **changed}, {**self.reason,
                                                    **{n: why for n in changed}})


def _holds_memory(node: fx.Node) -> bool:
    """Whether a value held across streams costs memory worth a decision (`MIN_BYTES`)."""
    return (tensor_bytes(val_of(node)) or 0) >= MIN_BYTES


def _waits_for_matrix_work(main_matrix_work: list[int], since: int, until: int) -> bool:
    """Whether a launch point moved from ``since`` to ``until`` passes main matrix work."""
    return any(since < at <= until for at in main_matrix_work)


def _loss_tail_copies(nodes: list[fx.Node], owner: Owners,
                      from_inputs: set[fx.Node]) -> set[tuple[fx.Node, fx.Node]]:
    """(early value, forward reader): a block's copy of a value made from the inputs alone
    (`copy_input_values_per_block`: soft targets) read by that block's loss tail
    (`loss_tails`: ``mul(soft_targets, log_softmax)``). The copy stays in its block: its
    reader joins the block (claim 3), or else runs after the join."""
    return {(arg, tail) for tail, (block, _) in loss_tails(nodes[-1].graph, nodes,
                                                          from_inputs).items()
            for arg in tail.all_input_nodes
            if arg in from_inputs and is_early(arg) and owner[arg] == block}


def _shared_early_values(nodes: list[fx.Node], owner: Owners,
                         kept: set[tuple[fx.Node, fx.Node]]) -> dict[fx.Node, None]:
    """Claim 1: the early nodes read by the main stream or another block (but for the reads
    in ``kept``), with their inputs: the main stream's."""
    owner = dict(owner)
    shared: dict[fx.Node, None] = {}
    # NB: reverse order, so that a node moved to the main stream moves its own
    # inputs too when they are visited later.
    for node in reversed(nodes):
        if node.op == "output":
            continue
        for arg in node.all_input_nodes:
            if owner[arg] is not None and owner[arg] != owner[node] and (arg, node) not in kept:
                owner[arg] = shared[arg] = None
    return shared


def _heads(nodes: list[fx.Node], owner: Owners, feeds: set[fx.Node],
           at_end: set[int]) -> dict[fx.Node, int]:
    """Claim 2: the main nodes whose readers are one block's nodes, the output, or main nodes
    that only feed what the forward returns (``feeds``); none for a block at the graph's
    end (``at_end``)."""
    owner = dict(owner)
    heads: dict[fx.Node, int] = {}
    # NB: reverse order: a node's readers are decided before the node.
    for node in reversed(nodes):
        if node.op != "call_function" or owner[node] is not None or node.is_impure():
            continue
        blocks = {owner[user] for user in node.users if owner.get(user) is not None}
        if len(blocks) != 1 or blocks & at_end:
            continue
        if all(owner.get(user) is not None or user.op == "output" or user in feeds
               for user in node.users):
            owner[node] = heads[node] = blocks.pop()
    return heads


@dataclasses.dataclass(frozen=True)
class _Timeline:
    """Where nodes are in the forward's order, for launch points."""

    position: Mapping[fx.Node, int]

    @classmethod
    def of(cls, nodes: list[fx.Node]) -> _Timeline:
        return cls({node: i for i, node in enumerate(nodes)})

    def launch_points(self, owner: Owners) -> dict[int, int]:
        """Each block's launch point: the position of the last main node its nodes read."""
        launch_point: dict[int, int] = {}
        for node in self.position:
            if owner.get(node) is not None:
                for arg in node.all_input_nodes:
                    if owner[arg] is None:
                        launch_point[owner[node]] = max(launch_point.get(owner[node], -1),
                                                        self.position[arg])
        return launch_point

    def main_matrix_work(self, matrix_work: frozenset[fx.Node], owner: Owners) -> list[int]:
        """The positions of the main nodes with matrix work."""
        return [self.position[n] for n in matrix_work if owner.get(n) is None]


def _tails(nodes: list[fx.Node], owner: Owners, feeds: set[fx.Node], from_inputs: set[fx.Node],
           matrix_work: frozenset[fx.Node]) -> dict[fx.Node, int]:
    """Claim 3: the main nodes that only feed what the forward returns (``feeds``) and read
    one block's values (`_sole_block_read`), in forward order: a tail of several nodes
    joins node by node."""
    owner = dict(owner)
    timeline = _Timeline.of(nodes)
    main_matrix_work = timeline.main_matrix_work(matrix_work, owner)
    launch_point = timeline.launch_points(owner)
    late: set[fx.Node] = set()  # main nodes that read a block's value: after the join
    tails: dict[fx.Node, int] = {}
    for node in nodes:
        if (node.op == "call_function" and owner[node] is None and not node.is_impure()
                and node in feeds):
            block = _sole_block_read(node, owner, late, timeline, launch_point, from_inputs,
                                     main_matrix_work)
            if block is not None:
                owner[node] = tails[node] = block
        if owner[node] is None and _reads_a_block(node, owner, late):
            late.add(node)
    return tails


def _sole_block_read(node: fx.Node, owner: Owners, late: set[fx.Node], timeline: _Timeline,
                     launch_point: dict[int, int], from_inputs: set[fx.Node],
                     main_matrix_work: list[int]) -> int | None:
    """The block whose values ``node`` reads, if it reads one block's values and otherwise
    only main values made before that block's launch point, or, where it reads a large
    value of the block (bytes the join would hold), after it from the graph inputs alone
    with no matrix work in between (the launch point then moves there); None: stay on
    main."""
    computed = [a for a in node.all_input_nodes if a.op not in ("placeholder", "get_attr")]
    blocks = {owner[a] for a in computed if owner[a] is not None}
    if len(blocks) != 1:
        return None
    block = blocks.pop()
    limit = launch_point.get(block, -1)
    later = [a for a in computed
             if owner[a] != block and (a in late or timeline.position[a] > limit)]
    if any(a in late or a not in from_inputs for a in later):
        return None
    if later and not any(_holds_memory(a) for a in computed if owner[a] == block):
        return None  # NB: only scalars or small values would cross: the launch point stays
    moved = max((timeline.position[a] for a in later), default=limit)
    if _waits_for_matrix_work(main_matrix_work, limit, moved):
        return None
    launch_point[block] = moved
    return block


def _input_values(nodes: list[fx.Node], owner: Owners, from_inputs: set[fx.Node],
                  matrix_work: frozenset[fx.Node]) -> dict[fx.Node, None]:
    """Claim 4: a large value of a block's head made from the graph inputs alone that a main
    node reads, with the head's nodes it is made from: the main stream's.

    Why: soft targets that one early block's loss and the last block's loss both read
    are claimed by the early block's head (the last block's loss only feeds the loss sum),
    and the last block's loss would read them across streams after the join, held there
    until it. Made on the main stream they are read by the block instead, and the last
    block's loss runs before the join. (With `copy_input_values_per_block` the early
    block's loss reads its own copy, and what its head claimed is the original's chain,
    made for the last block's loss alone right before it, claimed as a loss tail through a
    small label mask the block's copy reads too.) The block's launch point moves to the
    last of them the block still reads (the mask, not the chain made after the next
    stage's matrix product) only where no node with matrix work lies in between.
    """
    owner = dict(owner)
    timeline = _Timeline.of(nodes)
    main_matrix_work = timeline.main_matrix_work(matrix_work, owner)
    launch_point = timeline.launch_points(owner)
    on_main: dict[fx.Node, None] = {}
    for node in reversed(nodes):
        block = owner.get(node)
        if (block is None or is_early(node) or node not in from_inputs
                or not _holds_memory(node)
                or not any(owner.get(u) is None and u.op != "output" for u in node.users)):
            continue
        chain = [node]
        for member in chain:
            chain += [a for a in member.all_input_nodes
                      if owner.get(a) == block and a not in chain and not is_early(a)]
        moved = {**owner, **{member: None for member in chain}}
        # NB: the block reads the members it read (not those only the chain and main nodes
        # read: `copy_input_values_per_block` makes the value right before its main reader)
        launch_after = timeline.launch_points(moved)
        if _waits_for_matrix_work(main_matrix_work, launch_point.get(block, -1),
                                  launch_after.get(block, -1)):
            continue
        owner = moved
        on_main.update((member, None) for member in chain)
        launch_point = launch_after  # NB: the block reads them now
    return on_main


def _stages(nodes: list[fx.Node], owner: Owners, at_end: set[int]) -> dict[fx.Node, int]:
    """Claim 5: each block's own stage, the main nodes that block ``b`` needs (directly or
    through other main nodes) and no block launched before it needs.

    For a chain of detached stages these are exactly stage ``b``'s nodes:
    the values block ``b``'s early backward saves are then made on its side
    stream and read there only, and the next stage reads stage ``b``'s
    output once it exists. Blocks launch in id order (ids follow ready
    points), so "launched before" is a smaller id. Impure nodes stay on the
    main stream (unless only random, `draws_random_numbers`: stage nodes keep
    their place in the forward's order, so random ops are launched in the
    order they would be on the main stream and draw the same numbers, the
    generator's offset advancing at launch whatever the stream), and so do the
    stages of blocks in pieces (each piece has its own launch point; moving
    the trunk they share would serialize them) and of blocks at the graph's
    end (``at_end``: the main stream reads their loss and must not wait for
    their backward).
    """
    pieced = {get_meta(n).block for n in nodes
              if owner.get(n) is not None and get_meta(n) is not None
              and get_meta(n).piece is not None}
    needed_by: dict[fx.Node, int] = {}  # main node -> the first block that needs it
    # NB: reverse order: a node's readers are decided before the node.
    for node in reversed(nodes):
        if node.op != "call_function" or owner[node] is not None:
            continue
        readers = [owner[u] if owner.get(u) is not None else needed_by.get(u)
                   for u in node.users]
        blocks = [b for b in readers if b is not None]
        if blocks:
            needed_by[node] = min(blocks)
    return {node: block for node, block in needed_by.items()
            if block not in pieced and block not in at_end
            and (not node.is_impure() or draws_random_numbers(node))}


def _getitems(nodes: list[fx.Node], owner: Owners, stage: frozenset[fx.Node]
              ) -> tuple[dict[fx.Node, int | None], frozenset[fx.Node]]:
    """Claim 6: an element of a multi-output op is where the op is, in the op's stage or not;
    returns the claims and the stage nodes.

    A tuple-valued node (``_scaled_dot_product_flash_attention`` returns the
    output and the logsumexp) cannot cross a segment boundary: segments
    return tensors. When only its backward reads one element, the stock
    partitioner leaves that ``getitem`` among the block's nodes; it goes to
    the op's stream, and the block reads the element from there.
    """
    owner, stage = dict(owner), set(stage)
    claims: dict[fx.Node, int | None] = {}
    for node in nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            producer = node.args[0]
            if isinstance(producer, fx.Node) and producer.op == "call_function":
                owner[node] = claims[node] = owner[producer]
                if producer in stage:
                    stage.add(node)
                else:
                    stage.discard(node)
    return claims, frozenset(stage)


def _reads_a_block(node: fx.Node, owner: Owners, after_join: set[fx.Node],
                   stage: frozenset[fx.Node] = frozenset()) -> bool:
    """A main node that reads a block's value (not its stage's: that exists once the stage has
    run), or a node that runs after the join, runs after the join."""
    return any((owner[a] is not None and a not in stage) or a in after_join
               for a in node.all_input_nodes)


def _after_join(nodes: list[fx.Node], owner: Owners,
                stage: frozenset[fx.Node]) -> frozenset[fx.Node]:
    """The main nodes that run after the join (`_reads_a_block`), in graph order."""
    after_join: set[fx.Node] = set()
    for node in nodes:
        if node.op != "output" and owner[node] is None and _reads_a_block(node, owner,
                                                                          after_join, stage):
            after_join.add(node)
    return frozenset(after_join)
