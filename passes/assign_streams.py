"""assign_streams: which stream each forward-graph node runs on.

What: each early block runs on side stream ``1 + block % cfg.streams``
(round-robin in ready-point order, so consecutive blocks overlap each other
as well as the forward), and so does the part of the forward only that block
needs: its local head and loss, the loss's tail included (the gather, mean
and scaling that Inductor's decompositions leave after a saved log-softmax),
so that only the scalar loss crosses to the main stream. With
``cfg.tuning.stages_on_side`` (by default when there are more early blocks than
side streams: `stages_go_to_side_streams`) the block's own **stage** runs
there too, before its head: the forward nodes
block ``b`` needs that no block launched before it needs
(`_pull_stages_into_blocks`, `NodeMeta.stage`). Everything else runs on the
main stream (0).
Main-stream nodes that read a block's value (not its stage's), such as the
sum of the local losses, run *after the join* (``NodeMeta.after_join``):
once the main stream has waited for the side streams. Every edge from a node
on one stream to a node on another is a sync point, recorded in the
consumer's ``NodeMeta.waits_for``; the output node waits for every
side-stream value it returns.

Why: the critical path runs stage to stage; a block's head, loss and
backward are off it, so the next stage's forward starts as soon as the
stage's output exists. Before::

    main:   stage 0 -> head 0 -> loss 0 -> stage 1 -> head 1 -> loss 1 -> stage 2 -> sum
    side 1:                    block 0 backward

After, stages on the main stream (``stages_on_side=False``)::

    main:   stage 0 -> stage 1 -> stage 2 -> join -> sum
    side 1:        head 0 -> loss 0 -> block 0 backward
    side 2:                   head 1 -> loss 1 -> block 1 backward

After, stages on side streams (``stages_on_side``)::

    side 1: stage 0 -> head 0 -> loss 0 -> block 0 backward
    side 2:        stage 1 -> head 1 -> loss 1 -> block 1 backward
    main:                  stage 2 -> join -> sum

Each arrow down the page is an event: a stage waits for the stage before it,
never for that block's backward. The activations block ``b``'s backward
reads are then made and read on one stream, so under CUDA graph capture they
are freed right after that backward (`erase_fx.emit.release`) instead of
living until the join; the main stream makes them otherwise.

A forward node joins block ``b``'s head only if every reader of it is a node
of block ``b``, the output, or a node that only feeds the output through such
nodes (the loss sum), and a large one made from the inputs alone that a main
node reads after all (soft targets the last block's loss reads too) goes back
to the main stream (`_return_shared_input_values_to_main`); an early node
that the main stream or another block reads (`merge_common_subexpressions`
makes a block's ``t(w)`` the forward's, as the stock partitioner's CSE
would) moves to the main stream (and from there to the stage of the first
block that needs it), but for a block's copy of a value made from the inputs
alone that its loss tail reads (`copy_input_values_per_block` gives the
tail, ``mul(soft_targets, log_softmax)``, the block's copy): the tail joins
the block (`_loss_tail_copies`). So the main stream
waits for a block only at the join, and a block's head and backward never
wait for another block's.

Invariants out (`check_stream_assignment`, which `passes/pipeline.py` runs): a
new module; every node but the output has a stream; a main-stream node reads
a block's values (other than its stage's) only if it runs after the join,
and after-join nodes feed only after-join nodes and the output; a side node
reads main-stream nodes (not after the join), stage nodes and nodes of its
own block; a stage node reads no block's head or backward; ``waits_for``
lists exactly the inputs produced on another stream.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.errors import GraphInvariantError
from erase_fx.passes.flops import node_flops
from erase_fx.passes.graph import (
    MIN_BYTES,
    clone_module,
    draws_random_numbers,
    feeds_returns_only,
    loss_tails,
    made_from_inputs,
    returned_to_the_user,
    tensor_bytes,
    val_of,
)
from erase_fx.passes.node_meta import (
    MAIN_STREAM,
    NodeMeta,
    Role,
    get_meta,
    is_early,
    set_meta,
    update_meta,
)
from erase_fx.passes.pass_result import PassContext, PassResult

PASS_NAME = "assign_streams"


def stream_of_block(block: int, cfg: EraseConfig) -> int:
    """The side stream a block runs on: round-robin over ``cfg.streams`` (with none, the main)."""
    return 1 + block % cfg.streams if cfg.streams else MAIN_STREAM


def assign_streams(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Annotate a forward module with streams and sync points; see the module docstring.

    Reads ``ctx.cfg.streams`` and ``ctx.cfg.tuning.stages_on_side``.
    """
    cfg = ctx.cfg
    new_gm, _ = clone_module(gm)
    nodes = list(new_gm.graph.nodes)
    owner: dict[fx.Node, int | None] = {}  # block id, None for the main stream
    for node in nodes:
        meta = get_meta(node)
        owner[node] = meta.block if meta is not None and meta.role is Role.EARLY_BACKWARD else None
    from_inputs = made_from_inputs(nodes)
    _move_shared_early_nodes_to_main(nodes, owner, _loss_tail_copies(nodes, owner, from_inputs))
    matrix_work = {n for n in nodes if node_flops(n) > 0}
    at_end = graph_end_blocks(nodes)
    _pull_heads_into_blocks(nodes, owner, from_inputs, matrix_work, at_end)
    _return_shared_input_values_to_main(nodes, owner, from_inputs, matrix_work)
    stage: set[fx.Node] = set()
    blocks = {get_meta(n).block for n in nodes if is_early(n)} - at_end
    if stages_go_to_side_streams(cfg, len(blocks)):
        stage = _pull_stages_into_blocks(nodes, owner, at_end)
    _keep_getitems_with_producers(nodes, owner, stage)

    after_join: set[fx.Node] = set()
    for node in nodes:
        if node.op == "output":
            continue
        block = owner[node]
        if block is None:
            late = _reads_a_block(node, owner, after_join, stage)
            if late:
                after_join.add(node)
            set_meta(node, NodeMeta(Role.FORWARD, stream=MAIN_STREAM, after_join=late))
        elif node in stage:
            # NB: an early node that several blocks read came back to the main stream above
            set_meta(node, NodeMeta(Role.FORWARD, block=block, stream=stream_of_block(block, cfg),
                                    stage=True))
        elif get_meta(node) is not None and get_meta(node).role is Role.EARLY_BACKWARD:
            update_meta(node, stream=stream_of_block(block, cfg))
        else:
            set_meta(node, NodeMeta(Role.FORWARD, block=block, stream=stream_of_block(block, cfg)))
    for node in nodes:
        consumer = MAIN_STREAM if node.op == "output" else get_meta(node).stream
        waits = tuple(a.name for a in node.all_input_nodes if get_meta(a).stream != consumer)
        update_meta(node, stream=None if node.op == "output" else consumer, waits_for=waits)
    new_gm.recompile()
    return PassResult(new_gm, modified=True)


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


def _move_shared_early_nodes_to_main(nodes: list[fx.Node], owner: dict,
                                     tail_reads: set[tuple[fx.Node, fx.Node]]) -> None:
    """An early node read by the main stream or another block moves to main, with its inputs;
    but for the reads in ``tail_reads`` (`_loss_tail_copies`)."""
    # NB: reverse order, so that a node moved to the main stream moves its own
    # inputs too when they are visited later.
    for node in reversed(nodes):
        if node.op == "output":
            continue
        for arg in node.all_input_nodes:
            if (owner[arg] is not None and owner[arg] != owner[node]
                    and (arg, node) not in tail_reads):
                owner[arg] = None


def _loss_tail_copies(nodes: list[fx.Node], owner: dict,
                      from_inputs: set[fx.Node]) -> set[tuple[fx.Node, fx.Node]]:
    """(early value, forward reader): a block's copy of a value made from the inputs alone
    (`copy_input_values_per_block`: soft targets) read by that block's loss tail
    (`loss_tails`, the one definition both passes use: ``mul(soft_targets, log_softmax)``).
    The copy stays in its block: its reader joins the block (`_pull_loss_tails_into_blocks`),
    or else runs after the join."""
    return {(arg, tail) for tail, (block, _) in loss_tails(nodes[-1].graph, nodes,
                                                          from_inputs).items()
            for arg in tail.all_input_nodes
            if arg in from_inputs and is_early(arg) and owner[arg] == block}


def graph_end_blocks(nodes: list[fx.Node]) -> set[int]:
    """The blocks that run at the graph's end (`NodeMeta.at_graph_end`)."""
    return {get_meta(n).block for n in nodes if is_early(n) and get_meta(n).at_graph_end}


def _pull_heads_into_blocks(nodes: list[fx.Node], owner: dict, from_inputs: set[fx.Node],
                            matrix_work: set[fx.Node], at_end: set[int]) -> None:
    """Forward nodes only one block needs (its head and local loss) join that block; but for
    a block at the graph's end (``at_end``): its loss stays on the main stream, which then
    never waits for its backward (that runs while what follows the graph runs)."""
    returned = returned_to_the_user(nodes[-1].graph)
    if returned is None:
        return  # NB: without output descriptors, nothing moves: the safe schedule
    feeds_output_only = _feeds_output_only(nodes, owner, returned)
    # NB: reverse order: a node's readers are decided before the node.
    for node in reversed(nodes):
        if node.op != "call_function" or owner[node] is not None or node.is_impure():
            continue
        blocks = {owner[user] for user in node.users if owner.get(user) is not None}
        if len(blocks) != 1 or blocks & at_end:
            continue
        if all(owner.get(user) is not None or user.op == "output" or user in feeds_output_only
               for user in node.users):
            owner[node] = blocks.pop()
    _pull_loss_tails_into_blocks(nodes, owner, feeds_output_only, from_inputs, matrix_work)


def _return_shared_input_values_to_main(nodes: list[fx.Node], owner: dict,
                                        from_inputs: set[fx.Node],
                                        matrix_work: set[fx.Node]) -> None:
    """A large value of a block's head made from the graph inputs alone that a main node
    reads goes back to the main stream, with the head's nodes it is made from.

    Why: soft targets that one early block's loss and the last block's loss both read
    join the early block's head (the last block's loss only feeds the loss sum), and the
    last block's loss then reads them across streams after the join, held there until
    it. Made on the main stream they are read by the block instead, and the last block's
    loss runs before the join. (With `copy_input_values_per_block` the early block's
    loss reads its own copy, and what lands in its head is the original's chain, made
    for the last block's loss alone right before it, that joined as a loss tail through
    a small label mask the block's copy reads too.) The block's launch point moves to
    the last of them the block still reads (the mask, not the chain made after the next
    stage's matrix product) only where no node with matrix work lies in between (the
    block never waits for the next stage).
    """
    position = {node: i for i, node in enumerate(nodes)}
    main_matrix_work = _main_positions(matrix_work, owner, position)
    launch_point = _launch_points(nodes, owner, position)
    for node in reversed(nodes):
        block = owner.get(node)
        if (block is None or is_early(node) or node not in from_inputs
                or (tensor_bytes(val_of(node)) or 0) < MIN_BYTES
                or not any(owner.get(u) is None and u.op != "output" for u in node.users)):
            continue
        chain = [node]
        for member in chain:
            chain += [a for a in member.all_input_nodes
                      if owner.get(a) == block and a not in chain and not is_early(a)]
        before = launch_point.get(block, -1)
        moved = dict(owner)
        moved.update((member, None) for member in chain)
        # NB: the block reads the members it read (not those only the chain and main nodes
        # read: `copy_input_values_per_block` makes the value right before its main reader)
        after = _launch_points(nodes, moved, position).get(block, -1)
        if any(before < at <= after for at in main_matrix_work):
            continue
        owner.update(moved)
        launch_point = _launch_points(nodes, owner, position)  # NB: the block reads them now


def _feeds_output_only(nodes: list[fx.Node], owner: dict, returned: set[fx.Node]) -> set[fx.Node]:
    """Main nodes that only feed what the forward returns to the user (the loss sum), not
    tensors saved for the backward: they may run after the join."""
    return feeds_returns_only(nodes, returned, lambda node: owner[node] is None)


def _pull_loss_tails_into_blocks(nodes: list[fx.Node], owner: dict,
                                 feeds_output_only: set[fx.Node], from_inputs: set[fx.Node],
                                 matrix_work: set[fx.Node]) -> None:
    """The tail of a local loss (a cross-entropy's gather, mean and scaling, after the
    partitioner saved the log-softmax) joins its block: only the scalar crosses the join.

    A node that only feeds the loss sum and reads values of one block alone
    (besides graph inputs, constants and main-stream values computed before
    the block's launch point, such as the labels) would otherwise run on the
    main stream after the join, holding every block's head activations (a
    batch x vocabulary log-softmax each) until the end of the forward. The
    block's launch point (the last main node it reads) moves only for a node
    that reads a large value of the block (`MIN_BYTES`: the log-softmax, not a
    loss's per-sample terms), only past values made from the graph inputs
    alone (`made_from_inputs`: soft targets made from the labels, which the
    first block's loss may read a few nodes after its launch point once
    `copy_input_values_per_block` gave its backward a copy of its own), and
    never past a node with matrix work (the next stage): the block never
    waits for more of the forward.
    Forward order: a tail of several nodes joins node by node.
    """
    position = {node: i for i, node in enumerate(nodes)}
    main_matrix_work = _main_positions(matrix_work, owner, position)
    launch_point = _launch_points(nodes, owner, position)
    late: set[fx.Node] = set()  # main nodes that read a block's value: after the join
    for node in nodes:
        if (node.op == "call_function" and owner[node] is None and not node.is_impure()
                and node in feeds_output_only):
            owner[node] = _sole_block_read(node, owner, late, position, launch_point,
                                           from_inputs, main_matrix_work)
        if owner[node] is None and _reads_a_block(node, owner, late):
            late.add(node)


def _launch_points(nodes: list[fx.Node], owner: dict, position: dict) -> dict[int, int]:
    """Each block's launch point: the position of the last main node its nodes read."""
    launch_point: dict[int, int] = {}
    for node in nodes:
        if owner.get(node) is not None:
            for arg in node.all_input_nodes:
                if owner[arg] is None:
                    launch_point[owner[node]] = max(launch_point.get(owner[node], -1),
                                                    position[arg])
    return launch_point


def _main_positions(among: set[fx.Node], owner: dict, position: dict) -> list[int]:
    """The positions of the main-stream nodes ``among`` (those with matrix work, say)."""
    return [position[n] for n in among if owner.get(n) is None]


def _reads_a_block(node: fx.Node, owner: dict, after_join: set[fx.Node],
                   stage: set[fx.Node] = frozenset()) -> bool:
    """A main node that reads a block's value (not its stage's: that exists once the stage has
    run), or a node that runs after the join, runs after the join."""
    return any((owner[a] is not None and a not in stage) or a in after_join
               for a in node.all_input_nodes)


def _pull_stages_into_blocks(nodes: list[fx.Node], owner: dict,
                             at_end: set[int] = frozenset()) -> set[fx.Node]:
    """Each block's own stage joins the block: the main nodes that block ``b`` needs (directly
    or through other main nodes) and no block launched before it needs.

    For a chain of detached stages these are exactly stage ``b``'s nodes:
    the values block ``b``'s early backward saves are then made on its side
    stream and read there only, and the next stage reads stage ``b``'s
    output once it exists. Blocks launch in id order (ids follow ready
    points), so "launched before" is a smaller id. Impure nodes stay on the
    main stream (unless only random, `draws_random_numbers`: stage nodes keep
    their place in the forward's order, so random ops are launched in the
    order they would be on the main stream and draw the same numbers, the
    generator's offset advancing at launch whatever the stream), and so do the
    stages of blocks in pieces (each piece has
    its own launch point; moving the trunk they share would serialize them)
    and of blocks at the graph's end (``at_end``: the main stream reads their
    loss and must not wait for their backward).
    Returns the stage nodes; ``owner`` maps each to its block.
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
    stage: set[fx.Node] = set()
    for node, block in needed_by.items():
        if block not in pieced and block not in at_end and (
                not node.is_impure() or draws_random_numbers(node)):
            owner[node] = block
            stage.add(node)
    return stage


def _sole_block_read(node: fx.Node, owner: dict, late: set[fx.Node], position: dict,
                     launch_point: dict[int, int], from_inputs: set[fx.Node],
                     matrix_work: list[int]) -> int | None:
    """The block whose values ``node`` reads, if it reads one block's values and otherwise
    only main values made before that block's launch point, or, where it reads a large
    value of the block, after it from the graph inputs alone with no matrix work in between
    (the launch point then moves there); None: stay on main."""
    computed = [a for a in node.all_input_nodes if a.op not in ("placeholder", "get_attr")]
    blocks = {owner[a] for a in computed if owner[a] is not None}
    if len(blocks) != 1:
        return None
    block = blocks.pop()
    limit = launch_point.get(block, -1)
    later = [a for a in computed if owner[a] != block and (a in late or position[a] > limit)]
    if any(a in late or a not in from_inputs for a in later):
        return None
    if later and max((tensor_bytes(val_of(a)) or 0 for a in computed if owner[a] == block),
                     default=0) < MIN_BYTES:
        return None  # NB: only scalars or small values would cross: the launch point stays
    moved = max((position[a] for a in later), default=limit)
    if any(limit < at <= moved for at in matrix_work):
        return None
    launch_point[block] = moved
    return block


def _keep_getitems_with_producers(nodes: list[fx.Node], owner: dict, stage: set[fx.Node]) -> None:
    """An element of a multi-output op runs where the op runs.

    A tuple-valued node (``_scaled_dot_product_flash_attention`` returns the
    output and the logsumexp) cannot cross a segment boundary: segments
    return tensors. When only its backward reads one element, the stock
    partitioner leaves that ``getitem`` among the block's nodes; it moves to
    the op's stream, and the block reads the element from there.
    """
    for node in nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            producer = node.args[0]
            if isinstance(producer, fx.Node) and producer.op == "call_function":
                owner[node] = owner[producer]
                if producer in stage:
                    stage.add(node)
                else:
                    stage.discard(node)


def check_stream_assignment(result: PassResult, ctx: PassContext) -> None:
    """The invariants out (module docstring); raises GraphInvariantError."""
    for node in result.gm.graph.nodes:
        meta = get_meta(node)
        if meta is None:
            raise GraphInvariantError(PASS_NAME, "node has no erase_fx meta", node=node.name)
        if node.op == "output":
            continue
        if meta.stream is None:
            raise GraphInvariantError(PASS_NAME, "node has no stream", node=node.name)
        for arg in node.all_input_nodes:
            arg_meta = get_meta(arg)
            crosses = arg_meta.stream != meta.stream
            if meta.stage and arg_meta.stream != MAIN_STREAM and not arg_meta.stage:
                raise GraphInvariantError(PASS_NAME, "a stage reads a block's head or backward",
                                          node=node.name)
            if crosses and arg_meta.stage:
                pass  # a stage's values exist once it has run: an event orders the reader
            elif crosses and meta.stream != MAIN_STREAM and arg_meta.stream != MAIN_STREAM:
                raise GraphInvariantError(PASS_NAME, "two side streams depend on each other",
                                          node=node.name)
            elif crosses and meta.stream == MAIN_STREAM and not meta.after_join:
                raise GraphInvariantError(PASS_NAME, "the main stream reads a side-stream value "
                                          "before the join", node=node.name)
            if arg_meta.after_join and not meta.after_join:
                raise GraphInvariantError(PASS_NAME, "a node reads an after-join value before "
                                          "the join", node=node.name)
            if crosses != (arg.name in meta.waits_for):
                raise GraphInvariantError(PASS_NAME, f"sync point missing for {arg.name}",
                                          node=node.name)
