"""schedule_dot: a picture of the forward after ``assign_streams``: what runs where, and the syncs.

The forward module after stream assignment holds the forward nodes and the
early-backward nodes, each with its `NodeMeta`. `schedule_dot` draws it as a
Graphviz DOT graph (with ``pydot``, the ``viz`` extra):

- fill colour = stream: the main stream (0) light blue, each side stream its
  own colour (`stream_colour`); graph inputs white, a parameter labelled by
  its qualified name when ``param_names`` gives it (``stages.0.head.weight``,
  not ``primals_9``; the dump passes them);
- shape = role: forward nodes are ellipses, early-backward nodes boxes;
  main-stream nodes that run after the join have a double border;
- one cluster per early block, labelled ``block <b> (stream <s>)``: its head,
  local loss and early backward;
- edges are data flow, top to bottom in program order; an edge that crosses
  streams (an input named in the consumer's ``waits_for``: a sync point) is
  dashed and red.

A legend cluster names the colours and shapes. The function is pure: the same
module gives the same DOT text, byte for byte (nodes in graph order, clusters
by block id). The dump writes it as ``schedule.dot`` next to the numbered
files, and ``schedule.svg`` when Graphviz's ``dot`` is on the PATH
(`render_svg`); by hand: ``dot -Tsvg schedule.dot -o schedule.svg``.
"""
from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping

import pydot
import torch.fx as fx

from erase_fx.passes.node_meta import MAIN_STREAM, Role, get_meta

#: Fill colour of main-stream nodes.
MAIN_STREAM_COLOUR = "#cfe2f3"
#: Fill colours of side streams 1, 2, ... (cycled past the end).
SIDE_STREAM_COLOURS = (
    "#f4cccc", "#d9ead3", "#fff2cc", "#ead1dc", "#fce5cd", "#d0e0e3", "#e6b8af", "#b6d7a8",
)
INPUT_COLOUR = "#ffffff"
SYNC_EDGE_COLOUR = "#cc0000"
DATA_EDGE_COLOUR = "#666666"
FORWARD_SHAPE = "ellipse"
EARLY_BACKWARD_SHAPE = "box"
INPUT_SHAPE = "invhouse"
#: Seconds `render_svg` lets Graphviz run.
SVG_TIMEOUT_S = 120


def stream_colour(stream: int) -> str:
    """The fill colour of a stream's nodes."""
    if stream == MAIN_STREAM:
        return MAIN_STREAM_COLOUR
    return SIDE_STREAM_COLOURS[(stream - 1) % len(SIDE_STREAM_COLOURS)]


def stream_of(node: fx.Node) -> int:
    """The stream a node runs on; nodes erase_fx left alone run on the main stream."""
    meta = get_meta(node)
    return meta.stream if meta is not None and meta.stream is not None else MAIN_STREAM


def is_input(node: fx.Node) -> bool:
    return node.op in ("placeholder", "get_attr")


def op_label(node: fx.Node) -> str:
    """``addmm`` for ``aten.addmm.default``; the node's op for inputs and the output."""
    if node.op != "call_function":
        return "input" if is_input(node) else node.op
    name = getattr(node.target, "__name__", str(node.target))
    return name.removesuffix(".default")


def schedule_dot(gm: fx.GraphModule, param_names: Mapping[str, str] | None = None) -> pydot.Dot:
    """The forward module after ``assign_streams`` as a DOT graph; see the module docstring.

    ``param_names`` maps an input node's name to the label it gets, a
    parameter's qualified name (``{"primals_1": "stages.0.body.0.weight"}``);
    other inputs are labelled with their node name. Node ids stay node names.
    """
    labels = dict(param_names or {})
    dot = pydot.Dot("schedule", graph_type="digraph", rankdir="TB", fontname="Helvetica",
                    label="erase_fx schedule: forward after assign_streams", labelloc="t")
    dot.set_node_defaults(fontname="Helvetica", fontsize="10", style="filled")
    dot.set_edge_defaults(color=DATA_EDGE_COLOUR, arrowsize="0.6")

    nodes = list(gm.graph.nodes)
    blocks: dict[int, list[fx.Node]] = {}
    for node in nodes:
        meta = get_meta(node)
        if meta is not None and meta.block is not None:
            blocks.setdefault(meta.block, []).append(node)
    in_block = {node for members in blocks.values() for node in members}

    for node in nodes:
        if node not in in_block:
            dot.add_node(_dot_node(node, labels))
    # NB: deterministic order please: clusters by block id, members in graph order.
    for block in sorted(blocks):
        members = blocks[block]
        streams = sorted({stream_of(n) for n in members})
        cluster = pydot.Cluster(
            f"block_{block}",
            label=f"block {block} (stream {', '.join(map(str, streams))})",
            style="rounded", color=stream_colour(streams[-1]), penwidth="2",
        )
        for node in members:
            cluster.add_node(_dot_node(node, labels))
        dot.add_subgraph(cluster)

    for node in nodes:
        meta = get_meta(node)
        waits_for = set(meta.waits_for) if meta is not None else set()
        for source in node.all_input_nodes:
            if source.name in waits_for:
                dot.add_edge(pydot.Edge(
                    source.name, node.name, style="dashed", color=SYNC_EDGE_COLOUR,
                    tooltip=f"sync: stream {stream_of(source)} -> {_stream_text(node)}",
                ))
            else:
                dot.add_edge(pydot.Edge(source.name, node.name))

    used = sorted({stream_of(n) for n in nodes if not is_input(n)})
    dot.add_subgraph(_legend(used))
    return dot


def _dot_node(node: fx.Node, labels: Mapping[str, str]) -> pydot.Node:
    meta = get_meta(node)
    if is_input(node):
        label = labels.get(node.name)
        extra = {"tooltip": node.name} if label is not None else {}
        return pydot.Node(node.name, label=label or node.name, shape=INPUT_SHAPE,
                          fillcolor=INPUT_COLOUR, **extra)
    early = meta is not None and meta.role is Role.EARLY_BACKWARD
    attrs = {
        "label": f"{node.name}\n{op_label(node)}",
        "shape": EARLY_BACKWARD_SHAPE if early else FORWARD_SHAPE,
        "fillcolor": stream_colour(stream_of(node)),
    }
    if meta is not None and meta.after_join:
        attrs["peripheries"] = "2"
        attrs["label"] += "\n(after join)"
    return pydot.Node(node.name, **attrs)


def _stream_text(node: fx.Node) -> str:
    return "the output" if node.op == "output" else f"stream {stream_of(node)}"


def _legend(streams: list[int]) -> pydot.Cluster:
    # NB: legend node names hold spaces, which FX node names never do: no clash.
    legend = pydot.Cluster("legend", label="legend", style="rounded", color="#999999")
    for stream in streams:
        kind = "main stream" if stream == MAIN_STREAM else "side stream"
        legend.add_node(pydot.Node(f"legend stream {stream}", label=f"{kind} {stream}",
                                   shape="box", fillcolor=stream_colour(stream)))
    legend.add_node(pydot.Node("legend forward", label="forward node", shape=FORWARD_SHAPE,
                               fillcolor=INPUT_COLOUR))
    legend.add_node(pydot.Node("legend early", label="early backward node",
                               shape=EARLY_BACKWARD_SHAPE, fillcolor=INPUT_COLOUR))
    legend.add_edge(pydot.Edge("legend forward", "legend early", label="cross-stream sync",
                               style="dashed", color=SYNC_EDGE_COLOUR))
    return legend


def render_svg(dot_text: str) -> bytes | None:
    """The picture as SVG through Graphviz's ``dot``; None when ``dot`` is not on the PATH."""
    dot_binary = shutil.which("dot")
    if dot_binary is None:
        return None
    done = subprocess.run([dot_binary, "-Tsvg"], input=dot_text.encode(), capture_output=True,
                          check=True, timeout=SVG_TIMEOUT_S)
    return done.stdout
