"""assign_streams: which stream each forward-graph node runs on.

What: every forward node runs on the main stream (0); each early block runs
on side stream ``1 + block % cfg.streams`` (round-robin in ready-point order,
so consecutive blocks overlap each other as well as the forward). Every edge
from a node on one stream to a node on another is a sync point, recorded in
the consumer's ``NodeMeta.waits_for``; the output node (the join at the end
of the forward) waits for every side-stream value it returns.

Why the main stream keeps the forward: the forward is the critical path;
early work only fills what it leaves idle. An early node that the main
stream or another block reads (the stock partitioner's CSE can merge a
block's ``t(w)`` with the forward's, or two blocks' seed constants) moves to
the main stream, so the main stream never waits for a side stream before the
join and blocks never wait for each other.

Invariants out (`check_stream_assignment`): a new module; every node but the
output has a stream; a main-stream node reads only main-stream nodes; a side
node reads only main-stream nodes and nodes of its own block; ``waits_for``
lists exactly the inputs produced on another stream.
"""
from __future__ import annotations

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

    # NB: reverse order, so that a node moved to the main stream moves its own
    # inputs too when they are visited later.
    for node in reversed(nodes):
        if node.op == "output":
            continue
        for arg in node.all_input_nodes:
            if owner[arg] is not None and owner[arg] != owner[node]:
                owner[arg] = None

    for node in nodes:
        if node.op == "output":
            continue
        block = owner[node]
        if block is None:
            set_meta(node, NodeMeta(Role.FORWARD, stream=MAIN_STREAM))
        else:
            update_meta(node, stream=stream_of_block(block, cfg))
    for node in nodes:
        consumer = MAIN_STREAM if node.op == "output" else get_meta(node).stream
        waits = tuple(a.name for a in node.all_input_nodes if get_meta(a).stream != consumer)
        update_meta(node, stream=None if node.op == "output" else consumer, waits_for=waits)
    new_gm.recompile()
    check_stream_assignment(new_gm)
    return PassResult(new_gm, modified=True)


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
            if crosses and meta.stream != 0 and arg_meta.stream != 0:
                raise GraphInvariantError(PASS_NAME, "two side streams depend on each other",
                                          node=node.name)
            if crosses and meta.stream == 0:
                raise GraphInvariantError(PASS_NAME, "the main stream reads a side-stream value",
                                          node=node.name)
            if crosses != (arg.name in meta.waits_for):
                raise GraphInvariantError(PASS_NAME, f"sync point missing for {arg.name}",
                                          node=node.name)
