"""split_segments: launch order, one stream per segment, same values as the unsplit forward."""
import importlib
import re
import unittest.mock

import torch

import pytest

from erase_fx.config import EraseConfig, Tuning
from erase_fx.passes import MAIN_STREAM
from erase_fx.passes.node_meta import NodeMeta, Role, is_early
from erase_fx.passes.split_segments import forward_first
from graphs import (
    Chain,
    Stages,
    TowersInterleaved,
    TwoBlock,
    assert_outputs_close,
    chain_inputs,
    real_values,
    two_block_inputs,
)


@pytest.fixture(scope="module")
def chain():
    """The classic layout: every stage on the main stream."""
    return Stages(Chain(3), chain_inputs(),
                  EraseConfig(inner="aot_eager", streams=4, tuning=Tuning(stages_on_side=False)))


@pytest.fixture(scope="module")
def chain_stages_on_side():
    return Stages(Chain(3), chain_inputs(),
                  EraseConfig(inner="aot_eager", streams=4, tuning=Tuning(stages_on_side=True)))


def test_blocks_launch_between_forward_segments(chain):
    segments = chain.segmented.segments
    assert [(s.stream, s.block) for s in segments] == [
        (0, None), (1, 0), (0, None), (2, 1), (0, None), (0, None),
    ]
    assert segments[-1].name.endswith("_after_join")
    assert {chain.segmented.segment(w).stream for w in segments[-1].waits_for} == {1, 2}
    for segment in segments:
        assert re.fullmatch(r"seg_\d+(_block_\d+)?_stream_\d+(_after_join)?", segment.name)


def test_block_segments_wait_for_the_main_segment_before_them(chain):
    segments = chain.segmented.segments
    for i, segment in enumerate(segments):
        if segment.stream != MAIN_STREAM:
            assert segment.waits_for
            assert segment.waits_for[-1] == segments[i - 1].name
        elif not segment.name.endswith("_after_join"):
            assert all(chain.segmented.segment(w).stream == MAIN_STREAM for w in segment.waits_for)


def test_with_stages_on_side_each_block_runs_its_stage_then_its_head_on_one_stream(
        chain_stages_on_side):
    segmented = chain_stages_on_side.segmented
    segments = segmented.segments
    assert [(s.stream, s.block, s.stage) for s in segments] == [
        (1, 0, True), (1, 0, False), (2, 1, True), (2, 1, False), (0, None, False),
        (0, None, False),
    ]
    names = [s.name for s in segments]
    assert re.fullmatch(r"seg_0_block_0_stage_stream_1", names[0])
    # a stage waits for the stage before it, not for that block's backward; so does the
    # last stage, on the main stream; the loss sum waits for the blocks' backwards
    assert segments[2].waits_for == (names[0],)
    assert segments[4].waits_for == (names[2],)
    assert set(segments[5].waits_for) == {names[1], names[3]}
    for segment in segments:
        assert all(segmented.segment(w).stream != segment.stream for w in segment.waits_for)


def test_every_segment_returns_a_tuple(chain):
    for segment in chain.segmented.segments:
        sub = getattr(chain.segmented.gm, segment.name)
        out = next(n for n in sub.graph.nodes if n.op == "output")
        assert isinstance(out.args[0], tuple)


@pytest.mark.parametrize("model, inputs", [(Chain(3), chain_inputs), (TwoBlock(), two_block_inputs),
                                           (TowersInterleaved(3), chain_inputs)])
@pytest.mark.parametrize("stages_on_side", [False, True])
def test_split_module_computes_what_the_forward_computes(model, inputs, stages_on_side):
    stages = Stages(model, inputs(), EraseConfig(inner="aot_eager",
                                                 tuning=Tuning(stages_on_side=stages_on_side)))
    for _ in range(2):
        values = real_values(stages.fw)
        args = [values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")]
        expected = list(stages.fw(*args))
        assert_outputs_close(list(stages.segmented.gm(*args)), expected)


@pytest.mark.parametrize("layout", ["chain", "chain_stages_on_side"])
def test_nodes_are_partitioned_exactly_once(layout, request):
    stages = request.getfixturevalue(layout)
    # NB: split_segments' input, after recompute_boundary_values added its copies
    fw_nodes = {n.name for n in stages.recomputed.gm.graph.nodes
                if n.op not in ("placeholder", "output")}
    in_segments = [name for s in stages.segmented.segments for name in s.nodes]
    assert len(in_segments) == len(fw_nodes)


def test_a_block_in_pieces_launches_each_piece_when_it_is_ready_on_one_stream():
    stages = Stages(TowersInterleaved(3), chain_inputs(), EraseConfig(inner="aot_eager"))
    (block,) = stages.analysis.blocks
    assert len(block.component.pieces) == 4  # three towers' parts, then their sum's backward
    segments = stages.segmented.segments
    # each tower's part right after that tower's forward; the rest after the last part
    assert [(s.stream, s.block) for s in segments] == [
        (0, None), (1, 0), (0, None), (1, 0), (0, None), (1, 0), (1, 0), (0, None), (0, None)]
    assert [re.sub(r"seg_\d+_", "", s.name) for s in segments if s.block is not None] == [
        f"block_0_piece_{k}_stream_1" for k in range(4)]
    # one stream orders the pieces: no piece waits for another
    pieces = {s.name for s in segments if s.block is not None}
    assert not any(set(s.waits_for) & pieces for s in segments if s.block is not None)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_batchnorm_statistics_updates_do_not_cut_a_stage_into_pieces(inner):
    """BatchNorm's running-statistics updates (main-stream nodes that only feed the ``copy_``
    writing the buffers back) sit between a stage's nodes in the forward's order; they run
    right before that write instead, so each stage stays one segment."""
    from test_stock_inductor import DetachedConvStages

    inputs = (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
    stages = Stages(DetachedConvStages(), inputs,
                    EraseConfig(inner=inner, tuning=Tuning(stages_on_side=True)), inner=inner)
    segments = stages.segmented.segments
    assert [(s.stream, s.block, s.stage) for s in segments] == [
        (1, 0, True), (1, 0, False), (2, 1, True), (2, 1, False), (0, None, False),
        (0, None, False),
    ]
    values = real_values(stages.fw)
    args = [values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")]
    assert_outputs_close(list(stages.segmented.gm(*args)), list(stages.fw(*args)))


def late_forward_nodes(stages: Stages) -> list[list[str]]:
    """Per block segment, the forward nodes that read no early node yet come after the first
    early node (in the partitioner's order: the block's loss value)."""
    late = []
    for segment in stages.segmented.segments:
        if segment.block is None or segment.stage:
            continue
        nodes = [n for n in getattr(stages.segmented.gm, segment.name).graph.nodes
                 if n.op == "call_function"]
        first_early = min(i for i, n in enumerate(nodes) if is_early(n))
        reads_early = set()
        for n in nodes:
            if is_early(n) or any(a in reads_early for a in n.all_input_nodes):
                reads_early.add(n)
        late.append([n.name for n in nodes[first_early:] if n not in reads_early])
    return late


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_blocks_loss_value_comes_before_its_early_backward(inner):
    """Computed after the early backward, the loss value is the logits' last reader and
    keeps them alive through the backward (Inductor cannot write their gradient over
    them); the partitioner's order puts it there, each block segment must not."""
    def stages():
        torch.manual_seed(0)
        return Stages(Chain(3), chain_inputs(), EraseConfig(inner=inner), inner=inner)

    module = importlib.import_module("erase_fx.passes.split_segments")
    with unittest.mock.patch.object(module, "forward_first", lambda nodes: nodes):
        partitioner_order = late_forward_nodes(stages())
    assert len(partitioner_order) == 2 and all(partitioner_order), partitioner_order
    assert late_forward_nodes(stages()) == [[], []]


def _node(graph, target, role, *args):
    node = graph.call_function(target, args)
    node.meta["erase_fx"] = NodeMeta(role, block=0)
    return node


def test_forward_first_moves_forward_nodes_but_keeps_random_ops_in_program_order():
    """Random ops draw from one generator in program order under aot_eager: they keep their
    order among themselves (an early one before a forward one), other nodes move."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    late = _node(graph, torch.ops.aten.neg.default, Role.EARLY_BACKWARD, x)
    plain = _node(graph, torch.ops.aten.relu.default, Role.FORWARD, x)
    assert forward_first([late, plain]) == [plain, late]

    early_noise = _node(graph, torch.ops.aten.rand_like.default, Role.EARLY_BACKWARD, x)
    forward_noise = _node(graph, torch.ops.aten.rand_like.default, Role.FORWARD, x)
    assert forward_first([early_noise, forward_noise, plain]) == [
        plain, early_noise, forward_noise]
    uses_noise = _node(graph, torch.ops.aten.add.Tensor, Role.FORWARD, forward_noise, x)
    assert forward_first([early_noise, late, forward_noise, uses_noise]) == [
        early_noise, forward_noise, uses_noise, late]


def test_forward_first_moves_the_loss_value_ahead_of_a_cudnn_attention_backward():
    """On an H200 gpt's attention runs as cuDNN attention, whose backward is tagged as drawing
    random numbers: a block holding it still computes its loss value first (a rule that
    kept such blocks as they were changed nothing on the GPU)."""
    backward = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    assert torch.Tag.nondeterministic_seeded in backward.tags
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    attention_grad = _node(graph, backward, Role.EARLY_BACKWARD, x)
    loss_value = _node(graph, torch.ops.aten.sum.default, Role.FORWARD, x)
    assert forward_first([attention_grad, loss_value]) == [loss_value, attention_grad]
