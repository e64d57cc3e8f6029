"""assign_streams: which stream each forward-graph node runs on.

What: each early block runs on side stream ``1 + block % cfg.streams``
(round-robin in ready-point order, so consecutive blocks overlap each other
as well as the forward), and so does the part of the forward only that block
needs: its local head and loss, the loss's tail included (the gather, mean
and scaling that Inductor's decompositions leave after a saved log-softmax),
so that only the scalar loss crosses to the main stream. With
``cfg.tuning.stages_on_side`` (by default when there are more early blocks than
side streams: `stages_go_to_side_streams`) the block's own **stage** runs
there too, before its head: the forward nodes block ``b`` needs that no block
launched before it needs (`NodeMeta.stage`). Everything else runs on the main
stream (0). Main-stream nodes that read a block's value (not its stage's),
such as the sum of the local losses, run *after the join*
(``NodeMeta.after_join``): once the main stream has waited for the side
streams. Every edge from a node on one stream to a node on another is a sync
point, recorded in the consumer's ``NodeMeta.waits_for``; the output node
waits for every side-stream value it returns.

Which node is whose is decided once, by `decide_ownership`
(`passes/ownership.py`), from a stated cost: the bytes a value read across
streams holds until the join, a block never waiting for main-stream matrix
work, the critical path kept to the stages; its module docstring lists the
claims and their reasons. This pass writes that decision into the nodes'
meta and adds the sync points; its artifact (`StreamAssignment`) keeps the
owner and the reason of each node.

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
living until the join; the main stream makes them otherwise. The main
stream waits for a block only at the join, and a block's head and backward
never wait for another block's.

Invariants out (`check_stream_assignment`, which `passes/pipeline.py` runs): a
new module; every node but the output has a stream; a main-stream node reads
a block's values (other than its stage's) only if it runs after the join,
and after-join nodes feed only after-join nodes and the output; a side node
reads main-stream nodes (not after the join), stage nodes and nodes of its
own block; a stage node reads no block's head or backward; ``waits_for``
lists exactly the inputs produced on another stream.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.errors import GraphInvariantError
from erase_fx.passes.graph import clone_module
from erase_fx.passes.node_meta import (
    MAIN_STREAM,
    NodeMeta,
    Role,
    get_meta,
    is_early,
    set_meta,
    update_meta,
)
from erase_fx.passes.ownership import Ownership, OwnerReason, decide_ownership
from erase_fx.passes.pass_result import DumpFile, PassContext, PassResult, graph_text

PASS_NAME = "assign_streams"


@dataclasses.dataclass(frozen=True)
class StreamAssignment:
    """Each node's owner (a block's id, None for the main stream) and why (`OwnerReason`), by
    node name; the streams and sync points are in the nodes' meta."""

    owners: Mapping[str, tuple[int | None, OwnerReason]]

    def render(self, gm: fx.GraphModule) -> tuple[DumpFile, ...]:
        return (DumpFile(".py", "the module the pass returned", graph_text(gm)),)


def stream_of_block(block: int, cfg: EraseConfig) -> int:
    """The side stream a block runs on: round-robin over ``cfg.streams`` (with none, the main)."""
    return 1 + block % cfg.streams if cfg.streams else MAIN_STREAM


def assign_streams(gm: fx.GraphModule, ctx: PassContext) -> PassResult[StreamAssignment]:
    """Annotate a forward module with streams and sync points; see the module docstring.

    Reads ``ctx.cfg.streams`` and ``ctx.cfg.tuning.stages_on_side`` (`decide_ownership`).
    """
    new_gm, _ = clone_module(gm)
    nodes = list(new_gm.graph.nodes)
    ownership = decide_ownership(nodes, ctx.cfg)
    for node in nodes:
        if node.op != "output":
            _write_stream(node, ownership, ctx.cfg)
    for node in nodes:
        consumer = MAIN_STREAM if node.op == "output" else get_meta(node).stream
        waits = tuple(a.name for a in node.all_input_nodes if get_meta(a).stream != consumer)
        update_meta(node, stream=None if node.op == "output" else consumer, waits_for=waits)
    new_gm.recompile()
    return PassResult(new_gm, modified=True, artifact=StreamAssignment(ownership.named()))


def _write_stream(node: fx.Node, ownership: Ownership, cfg: EraseConfig) -> None:
    """A node's meta with its stream: the main stream (after the join or not), its block's
    stage, its block's early backward, or its block's head or loss."""
    block = ownership.owner[node]
    if block is None:
        set_meta(node, NodeMeta(Role.FORWARD, stream=MAIN_STREAM,
                                after_join=node in ownership.after_join))
    elif node in ownership.stage:
        set_meta(node, NodeMeta(Role.FORWARD, block=block, stream=stream_of_block(block, cfg),
                                stage=True))
    elif is_early(node):
        update_meta(node, stream=stream_of_block(block, cfg))
    else:
        set_meta(node, NodeMeta(Role.FORWARD, block=block, stream=stream_of_block(block, cfg)))


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
