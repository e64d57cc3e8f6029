"""schedule_dot: colour by stream, cluster by block, dashed cross-stream syncs; schedule.dot."""
import logging
import os
import stat
import sys

import pytest
import torch
import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.instruments import DumpInstrument
from erase_fx.passes import MAIN_STREAM, get_meta
from erase_fx.passes.node_meta import NodeMeta, Role, set_meta
from graphs import Chain, Stages, chain_inputs

pydot = pytest.importorskip("pydot")  # the viz extra
from erase_fx.schedule_picture import (  # noqa: E402 - needs pydot
    EARLY_BACKWARD_SHAPE,
    FORWARD_SHAPE,
    SYNC_EDGE_COLOUR,
    schedule_dot,
    stream_colour,
)

# NB: pydot's DOT parser (used here to check the text parses) warns about pyparsing names.
pytestmark = pytest.mark.filterwarnings("ignore:.*setParseAction.*")
aten = torch.ops.aten


def tiny_schedule():
    """x -> relu (main) -> neg (block 0 backward, stream 1) and mul (block 1 head, stream 2)
    -> add (main, after the join) -> output."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.create_node("call_function", aten.relu.default, (x,), name="relu")
    b = graph.create_node("call_function", aten.neg.default, (a,), name="neg")
    c = graph.create_node("call_function", aten.mul.Tensor, (a, a), name="mul")
    d = graph.create_node("call_function", aten.add.Tensor, (b, c), name="add")
    out = graph.output((d, b))
    set_meta(x, NodeMeta(Role.FORWARD, stream=MAIN_STREAM))
    set_meta(a, NodeMeta(Role.FORWARD, stream=MAIN_STREAM))
    set_meta(b, NodeMeta(Role.EARLY_BACKWARD, block=0, stream=1, waits_for=("relu",)))
    set_meta(c, NodeMeta(Role.FORWARD, block=1, stream=2, waits_for=("relu",)))
    set_meta(d, NodeMeta(Role.FORWARD, stream=MAIN_STREAM, waits_for=("neg", "mul"),
                         after_join=True))
    set_meta(out, NodeMeta(Role.FORWARD, waits_for=("neg",)))
    return fx.GraphModule(torch.nn.Module(), graph)


def dot_nodes(dot):
    """Every node of the graph and its clusters (legend left out), by name."""
    found = {}
    for graph in [dot] + dot.get_subgraph_list():
        if graph.get_name() == "cluster_legend":
            continue
        for node in graph.get_node_list():
            if node.get_name() not in ("node", "edge", "graph"):
                found[node.get_name().strip('"')] = node
    return found


def dashed_edges(dot):
    return {(e.get_source(), e.get_destination()) for e in dot.get_edge_list()
            if e.get("style") == "dashed"}


def attr(node, key):
    value = node.get(key)
    return value.strip('"') if isinstance(value, str) else value


def test_nodes_are_coloured_by_stream_and_early_backward_nodes_are_boxes():
    nodes = dot_nodes(schedule_dot(tiny_schedule()))
    assert {name: attr(n, "fillcolor") for name, n in nodes.items() if name != "x"} == {
        "relu": stream_colour(0), "neg": stream_colour(1), "mul": stream_colour(2),
        "add": stream_colour(0), "output": stream_colour(0),
    }
    assert len({stream_colour(s) for s in range(4)}) == 4
    assert attr(nodes["neg"], "shape") == EARLY_BACKWARD_SHAPE
    assert attr(nodes["mul"], "shape") == FORWARD_SHAPE
    assert attr(nodes["add"], "peripheries") == "2"  # after the join


def test_blocks_are_clusters_labelled_with_their_stream():
    dot = schedule_dot(tiny_schedule())
    clusters = {g.get_name(): g for g in dot.get_subgraph_list()}
    assert set(clusters) == {"cluster_block_0", "cluster_block_1", "cluster_legend"}
    assert [n.get_name() for n in clusters["cluster_block_0"].get_node_list()] == ["neg"]
    assert [n.get_name() for n in clusters["cluster_block_1"].get_node_list()] == ["mul"]
    assert attr(clusters["cluster_block_1"], "label") == "block 1 (stream 2)"


def test_exactly_the_cross_stream_edges_are_dashed():
    dot = schedule_dot(tiny_schedule())
    assert dashed_edges(dot) == {
        ("relu", "neg"), ("relu", "mul"), ("neg", "add"), ("mul", "add"), ("neg", "output"),
    }
    solid = {(e.get_source(), e.get_destination()) for e in dot.get_edge_list()
             if e.get("style") != "dashed"}
    assert solid == {("x", "relu"), ("add", "output")}
    assert all(attr(e, "color") == SYNC_EDGE_COLOUR for e in dot.get_edge_list()
               if e.get("style") == "dashed")


def test_the_dot_text_is_deterministic_and_parses():
    gm = tiny_schedule()
    text = schedule_dot(gm).to_string()
    assert text == schedule_dot(gm).to_string() == schedule_dot(tiny_schedule()).to_string()
    (parsed,) = pydot.graph_from_dot_data(text)
    assert parsed.get_name() == "schedule"


def test_inputs_are_labelled_with_the_names_given_and_keep_their_node_ids():
    nodes = dot_nodes(schedule_dot(tiny_schedule(), {"x": "stages.0.0.weight"}))
    assert attr(nodes["x"], "label") == "stages.0.0.weight"
    assert attr(nodes["x"], "tooltip") == "x"
    assert attr(nodes["relu"], "label") == "relu\nrelu"  # other nodes as before
    assert attr(dot_nodes(schedule_dot(tiny_schedule()))["x"], "label") == "x"


@pytest.fixture(scope="module")
def chain_stages():
    return Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager"))


def test_a_real_forward_colours_every_node_by_its_stream_and_dashes_every_sync(chain_stages):
    gm = chain_stages.assigned.gm
    dot = schedule_dot(gm)
    nodes = dot_nodes(dot)
    syncs = set()
    for node in gm.graph.nodes:
        meta = get_meta(node)
        syncs |= {(source, node.name) for source in meta.waits_for}
        if node.op == "placeholder":
            continue
        stream = meta.stream if meta.stream is not None else MAIN_STREAM
        assert attr(nodes[node.name], "fillcolor") == stream_colour(stream), node.name
        expected_shape = EARLY_BACKWARD_SHAPE if meta.role is Role.EARLY_BACKWARD else FORWARD_SHAPE
        assert attr(nodes[node.name], "shape") == expected_shape, node.name
    assert syncs and dashed_edges(dot) == syncs
    clusters = {g.get_name() for g in dot.get_subgraph_list()}
    assert clusters == {"cluster_block_0", "cluster_block_1", "cluster_legend"}


# -- in the dump ---------------------------------------------------------------


def test_the_dump_writes_schedule_dot_after_assign_streams(chain_stages, tmp_path):
    dump = DumpInstrument(tmp_path, 0)
    dump.before_pass("assign_streams", ())
    dump.after_pass("assign_streams", chain_stages.assigned, 0.1)
    text = (tmp_path / "graph_0" / "schedule.dot").read_text()
    assert text.startswith("// erase_fx dump: the forward after assign_streams (step 00)")
    assert "dot -Tsvg schedule.dot -o schedule.svg" in text
    assert str(tmp_path) not in text
    (parsed,) = pydot.graph_from_dot_data(text)
    assert parsed.get_name() == "schedule"


def test_without_graphviz_there_is_no_svg(chain_stages, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    DumpInstrument(tmp_path, 0).after_pass("assign_streams", chain_stages.assigned, 0.1)
    assert (tmp_path / "graph_0" / "schedule.dot").exists()
    assert not (tmp_path / "graph_0" / "schedule.svg").exists()


def fake_graphviz(tmp_path, monkeypatch, script):
    """Put a stand-in for Graphviz's ``dot`` first on the PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_dot = bin_dir / "dot"
    fake_dot.write_text("#!/bin/sh\n" + script)
    fake_dot.chmod(fake_dot.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + os.environ.get("PATH", ""))


def test_with_graphviz_on_the_path_the_dump_renders_svg(chain_stages, tmp_path, monkeypatch):
    # checks its arguments and its input, answers a tiny SVG
    fake_graphviz(tmp_path, monkeypatch, '[ "$1" = "-Tsvg" ] || exit 3\n'
                  'grep -q "digraph schedule" || exit 4\necho "<svg>schedule</svg>"\n')
    DumpInstrument(tmp_path, 0).after_pass("assign_streams", chain_stages.assigned, 0.1)
    assert (tmp_path / "graph_0" / "schedule.svg").read_bytes() == b"<svg>schedule</svg>\n"


def test_a_failing_graphviz_costs_the_svg_only(chain_stages, tmp_path, monkeypatch, caplog):
    fake_graphviz(tmp_path, monkeypatch, "echo 'syntax error' >&2\nexit 1\n")
    DumpInstrument(tmp_path, 0).after_pass("assign_streams", chain_stages.assigned, 0.1)
    assert (tmp_path / "graph_0" / "schedule.dot").exists()
    assert not (tmp_path / "graph_0" / "schedule.svg").exists()
    assert any("syntax error" in r.getMessage() for r in caplog.records)


def test_without_pydot_the_dump_skips_the_picture_with_one_info_line(
        chain_stages, tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pydot", None)  # import pydot raises ImportError
    with caplog.at_level(logging.INFO, logger="erase_fx"):
        DumpInstrument(tmp_path, 0).after_pass("assign_streams", chain_stages.assigned, 0.1)
    assert not (tmp_path / "graph_0" / "schedule.dot").exists()
    assert (tmp_path / "graph_0" / "00_assign_streams.py").exists()
    lines = [r.getMessage() for r in caplog.records if "pydot" in r.getMessage()]
    assert len(lines) == 1 and "pip install erase-fx[viz]" in lines[0]


def test_the_dumps_picture_labels_parameters_with_their_names(tmp_path):
    torch.compile(Chain(2), backend="erase",
                  options={"inner": "aot_eager", "dump_dir": str(tmp_path)})(*chain_inputs())
    (graph,) = tmp_path.iterdir()
    (parsed,) = pydot.graph_from_dot_data((graph / "schedule.dot").read_text())
    labels = {attr(node, "label") for sub in [parsed] + parsed.get_subgraph_list()
              for node in sub.get_node_list() if attr(node, "shape") == "invhouse"}
    params = {name for name, _ in Chain(2).named_parameters()}
    assert params <= labels
    # what is left of the inputs, the batch and the labels, are not parameters
    assert len([label for label in labels if label.startswith("primals_")]) == 2


def test_no_picture_for_other_passes(chain_stages, tmp_path):
    DumpInstrument(tmp_path, 0).after_pass("split_segments", chain_stages.segmented, 0.1)
    assert not (tmp_path / "graph_0" / "schedule.dot").exists()
