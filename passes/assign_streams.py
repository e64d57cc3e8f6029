"""assign_streams: which stream each forward-graph node runs on.

What: each early block runs on side stream ``1 + block % cfg.streams``
(round-robin in ready-point order, so consecutive blocks overlap each other
as well as the forward), and so does the part of the forward only that block
needs: its local head and loss, the loss's tail included (the gather, mean
and scaling that Inductor's decompositions leave after a saved log-softmax),
so that only the scalar loss crosses to the main stream. Everything else runs
on the main stream (0).
Main-stream nodes that read a side-stream value, such as the sum of the local
losses, run *after the join* (``NodeMeta.after_join``): once the main stream
has waited for the side streams. Every edge from a node on one stream to a
node on another is a sync point, recorded in the consumer's
``NodeMeta.waits_for``; the output node waits for every side-stream value it
returns.

Why: the main stream carries the critical path, stage to stage; a block's
head, loss and backward are off it, so the next stage's forward starts as
soon as the stage's output exists. Before::

    main:   stage 0 -> head 0 -> loss 0 -> stage 1 -> head 1 -> loss 1 -> sum
    side 1:                    block 0 backward

After::

    main:   stage 0 -> stage 1 -> ... -> join -> sum
    side 1:        head 0 -> loss 0 -> block 0 backward
    side 2:                   head 1 -> loss 1 -> block 1 backward

A forward node joins block ``b`` only if every reader of it is a node of
block ``b``, the output, or a node that only feeds the output through such
nodes (the loss sum); an early node that the main stream or another block
reads (the stock partitioner's CSE can merge a block's ``t(w)`` with the
forward's, or two blocks' seed constants) moves to the main stream. So the
main stream waits for side streams only at the join, and blocks never wait
for each other.

Invariants out (`check_stream_assignment`, which `passes/pipeline.py` runs): a
new module; every node but the output has a stream; a main-stream node reads
side-stream values only if it runs after the join, and after-join nodes feed
only after-join nodes and the output; a side node reads only main-stream nodes
(not after the join) and nodes of its own block; ``waits_for`` lists exactly
the inputs produced on another stream.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.errors import GraphInvariantError
from erase_fx.passes.graph import clone_module
from erase_fx.passes.node_meta import MAIN_STREAM, NodeMeta, Role, get_meta, set_meta, update_meta
from erase_fx.passes.pass_result import PassResult

PASS_NAME = "assign_streams"


def stream_of_block(block: int, cfg: EraseConfig) -> int:
    """The side stream a block runs on: round-robin over ``cfg.streams``."""
    return 1 + block % cfg.streams


def assign_streams(gm: fx.GraphModule, cfg: EraseConfig) -> PassResult:
    """Annotate a forward module with streams and sync points; see the module docstring."""
    new_gm, _ = clone_module(gm)
    nodes = list(new_gm.graph.nodes)
    owner: dict[fx.Node, int | None] = {}  # block id, None for the main stream
    for node in nodes:
        meta = get_meta(node)
        owner[node] = meta.block if meta is not None and meta.role is Role.EARLY_BACKWARD else None
    _move_shared_early_nodes_to_main(nodes, owner)
    _pull_heads_into_blocks(nodes, owner)
    _keep_getitems_with_producers(nodes, owner)

    after_join: set[fx.Node] = set()
    for node in nodes:
        if node.op == "output":
            continue
        block = owner[node]
        if block is None:
            late = _reads_a_block(node, owner, after_join)
            if late:
                after_join.add(node)
            set_meta(node, NodeMeta(Role.FORWARD, stream=MAIN_STREAM, after_join=late))
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


def _move_shared_early_nodes_to_main(nodes: list[fx.Node], owner: dict) -> None:
    """An early node read by the main stream or another block moves to main, with its inputs."""
    # NB: reverse order, so that a node moved to the main stream moves its own
    # inputs too when they are visited later.
    for node in reversed(nodes):
        if node.op == "output":
            continue
        for arg in node.all_input_nodes:
            if owner[arg] is not None and owner[arg] != owner[node]:
                owner[arg] = None


def _pull_heads_into_blocks(nodes: list[fx.Node], owner: dict) -> None:
    """Forward nodes only one block needs (its head and local loss) join that block."""
    returned = _returned_to_the_user(nodes[-1])
    if returned is None:
        return  # NB: without output descriptors, nothing moves: the safe schedule
    feeds_output_only = _feeds_output_only(nodes, owner, returned)
    # NB: reverse order: a node's readers are decided before the node.
    for node in reversed(nodes):
        if node.op != "call_function" or owner[node] is not None or node.is_impure():
            continue
        blocks = {owner[user] for user in node.users if owner.get(user) is not None}
        if len(blocks) != 1:
            continue
        if all(owner.get(user) is not None or user.op == "output" or user in feeds_output_only
               for user in node.users):
            owner[node] = blocks.pop()
    _pull_loss_tails_into_blocks(nodes, owner, feeds_output_only)


def _feeds_output_only(nodes: list[fx.Node], owner: dict, returned: set[fx.Node]) -> set[fx.Node]:
    """Main nodes that only feed what the forward returns to the user (the loss sum), not
    tensors saved for the backward: they may run after the join."""
    feeds: set[fx.Node] = set()
    for node in reversed(nodes):
        if node.op == "call_function" and owner[node] is None and node.users and all(
            (user.op == "output" and node in returned) or user in feeds
            for user in node.users
        ):
            feeds.add(node)
    return feeds


def _pull_loss_tails_into_blocks(nodes: list[fx.Node], owner: dict,
                                 feeds_output_only: set[fx.Node]) -> None:
    """The tail of a local loss (a cross-entropy's gather, mean and scaling, after the
    partitioner saved the log-softmax) joins its block: only the scalar crosses the join.

    A node that only feeds the loss sum and reads values of one block alone
    (besides graph inputs, constants and main-stream values computed before
    the block's launch point, such as the labels) would otherwise run on the
    main stream after the join, holding every block's head activations (a
    batch x vocabulary log-softmax each) until the end of the forward. The
    block's launch point (the last main node it reads) does not move.
    Forward order: a tail of several nodes joins node by node.
    """
    position = {node: i for i, node in enumerate(nodes)}
    launch_point: dict[int, int] = {}
    for node in nodes:
        if owner.get(node) is not None:
            for arg in node.all_input_nodes:
                if owner[arg] is None:
                    launch_point[owner[node]] = max(launch_point.get(owner[node], -1),
                                                    position[arg])
    late: set[fx.Node] = set()  # main nodes that read a block's value: after the join
    for node in nodes:
        if (node.op == "call_function" and owner[node] is None and not node.is_impure()
                and node in feeds_output_only):
            owner[node] = _sole_block_read(node, owner, late, position, launch_point)
        if owner[node] is None and _reads_a_block(node, owner, late):
            late.add(node)


def _reads_a_block(node: fx.Node, owner: dict, after_join: set[fx.Node]) -> bool:
    """A main node that reads a block's value, or a node that runs after the join, runs after
    the join."""
    return any(owner[a] is not None or a in after_join for a in node.all_input_nodes)


def _sole_block_read(node: fx.Node, owner: dict, late: set[fx.Node], position: dict,
                     launch_point: dict[int, int]) -> int | None:
    """The block whose values ``node`` reads, if it reads one block's values and otherwise
    only main values made before that block's launch point (None: stay on main)."""
    computed = [a for a in node.all_input_nodes if a.op not in ("placeholder", "get_attr")]
    blocks = {owner[a] for a in computed if owner[a] is not None}
    if len(blocks) != 1:
        return None
    block = blocks.pop()
    limit = launch_point.get(block, -1)
    if all(owner[a] == block or (a not in late and position[a] <= limit) for a in computed):
        return block
    return None


def _keep_getitems_with_producers(nodes: list[fx.Node], owner: dict) -> None:
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


def _returned_to_the_user(output: fx.Node) -> set[fx.Node] | None:
    """The output values that are forward returns, not saved for the backward (None: unknown)."""
    from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput

    descs = output.meta.get("desc")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    if descs is None or len(descs) != len(values):
        return None
    return {v for v, d in zip(values, descs)
            if isinstance(v, fx.Node) and not isinstance(d, SavedForBackwardsAOTOutput)}


def check_stream_assignment(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
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
            if crosses and meta.stream != MAIN_STREAM and arg_meta.stream != MAIN_STREAM:
                raise GraphInvariantError(PASS_NAME, "two side streams depend on each other",
                                          node=node.name)
            if crosses and meta.stream == MAIN_STREAM and not meta.after_join:
                raise GraphInvariantError(PASS_NAME, "the main stream reads a side-stream value "
                                          "before the join", node=node.name)
            if arg_meta.after_join and not meta.after_join:
                raise GraphInvariantError(PASS_NAME, "a node reads an after-join value before "
                                          "the join", node=node.name)
            if crosses != (arg.name in meta.waits_for):
                raise GraphInvariantError(PASS_NAME, f"sync point missing for {arg.name}",
                                          node=node.name)
