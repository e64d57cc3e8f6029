"""Node orders erase_fx does not use, for A/B rows of the benchmark (``/forward-first``).

`launch_order_forward_first` is `split_segments`' launch order with each block's
side-stream nodes reordered by `forward_first`: a block's forward nodes (its
head, its loss value) as early as their inputs allow, ahead of the early
backward nodes that do not read them. Why it exists: on the H200, gpt:16's
side segments compute the loss value, which reads the block's logits, as
their last kernel, so the logits live through the block's whole backward and
its gradient cannot be written over them. That order is the partitioner's: the
loss value is a forward output, the early backward is placed at the block's
ready point. Reordered this way, the FX graph Inductor receives computes the
loss value first, yet the H200 still ran it last
(`bench/results/2026-12-03-b-NOTES.md`). The row keeps the experiment
repeatable with Inductor's scheduler IR (``bench.memory_profile --keep-ir``),
without a second order in erase_fx itself.
"""
from __future__ import annotations

import heapq
import importlib

import torch.fx as fx

from erase_fx.passes.graph import draws_random_numbers
from erase_fx.passes.node_meta import get_meta, is_early

# NB: erase_fx.passes exports the pass function under the module's name
_split_segments = importlib.import_module("erase_fx.passes.split_segments")
#: The launch order erase_fx uses (taken at import, before any row patches it).
STOCK_LAUNCH_ORDER = _split_segments._launch_order


def launch_order_forward_first(gm: fx.GraphModule) -> list[fx.Node]:
    """`split_segments`' launch order, each run of one block piece's side nodes reordered
    by `forward_first` (the runs stay where they are)."""
    order = STOCK_LAUNCH_ORDER(gm)
    piece_of = _split_segments.pieces_of_side_nodes(list(gm.graph.nodes))
    result: list[fx.Node] = []
    run: list[fx.Node] = []
    key = None
    for node in order + [None]:
        side = node is not None and node in piece_of
        node_key = (get_meta(node).block, piece_of[node]) if side else None
        if run and node_key != key:
            result.extend(forward_first(run))
            run = []
        if side:
            run.append(node)
            key = node_key
        elif node is not None:
            result.append(node)
    return result


def forward_first(nodes: list[fx.Node]) -> list[fx.Node]:
    """``nodes`` (one block's side-stream nodes, in graph order) with each forward node as
    early as its inputs allow: before the early backward nodes it does not read. Forward
    nodes keep their order among themselves, early nodes theirs; a block with a random op
    keeps its order (random ops draw in program order under ``aot_eager``)."""
    if any(draws_random_numbers(n) for n in nodes):
        return nodes
    members = set(nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waiting = {n: sum(1 for a in n.all_input_nodes if a in members) for n in nodes}
    ready = [(is_early(n), index[n]) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        node = nodes[heapq.heappop(ready)[1]]
        ordered.append(node)
        for user in node.users:
            if user in members:
                waiting[user] -= 1
                if waiting[user] == 0:
                    heapq.heappush(ready, (is_early(user), index[user]))
    return ordered
