"""schedule_early_backward and partition_joint_graph: structure, purity, and exactness on real values."""
import pytest
import torch

from erase_fx.config import EraseConfig, Tuning
from erase_fx.passes import Role, get_meta, schedule_early_backward
from erase_fx.passes.graph import is_tangent, output_values
from erase_fx.passes.pass_result import PassContext, PassResult
from erase_fx.passes.schedule_early_backward import check_early_schedule
from graphs import (
    Chain,
    Stages,
    Towers,
    TowersInterleaved,
    TwoBlock,
    assert_outputs_close,
    chain_inputs,
    real_values,
    run_joint,
    targets,
    two_block_inputs,
)

aten = torch.ops.aten


def after_analysis(stages):
    """What schedule_early_backward and its check read: the config and the analysis found."""
    found = PassResult(stages.joint.gm, False, stages.analysis)
    return PassContext.of(stages.cfg, {"find_stop_gradient_blocks": found})


@pytest.fixture(scope="module")
def two_block():
    return Stages(TwoBlock(), two_block_inputs(), EraseConfig(inner="aot_eager"))


def early_nodes(gm, block=None):
    return [
        n for n in gm.graph.nodes
        if (m := get_meta(n)) and m.role is Role.EARLY_BACKWARD and (block is None or m.block == block)
    ]


def test_input_graph_is_not_mutated():
    stages = Stages(TwoBlock(), two_block_inputs(), EraseConfig(inner="aot_eager"))
    code = stages.joint.gm.code
    again = schedule_early_backward(stages.joint.gm, after_analysis(stages))
    check_early_schedule(again, after_analysis(stages))
    assert stages.joint.gm.code == code
    assert again.gm is not stages.joint.gm and again.modified


def test_early_block_starts_with_the_seed_right_after_its_ready_point(two_block):
    gm = two_block.scheduled.gm
    (block,) = two_block.analysis.blocks
    nodes = list(gm.graph.nodes)
    ready = next(i for i, n in enumerate(nodes) if n.name == block.component.ready_after)
    seed = nodes[ready + 1]
    assert seed.target is aten.full.default and seed.args == ([], 1.0)
    assert get_meta(seed).role is Role.EARLY_BACKWARD and get_meta(seed).block == 0
    # the clones follow the seed without a gap, and none reads a tangent
    clones = early_nodes(gm)
    assert nodes[ready + 1: ready + 1 + len(clones)] == clones
    assert not any(is_tangent(a) for n in clones for a in n.all_input_nodes)


def test_early_grads_are_returned_scaled_by_the_loss_tangent(two_block):
    gm = two_block.scheduled.gm
    num_fwd = two_block.joint.num_fwd_outputs
    (block,) = two_block.analysis.blocks
    grads = output_values(gm.graph)[num_fwd:]
    for primal_index, _ in block.component.grad_outputs:
        grad = grads[primal_index]
        assert grad.target is aten.mul.Tensor
        early, scale = grad.args
        assert get_meta(early).grad_of == primal_index
        assert scale.name == "tangents_1"


def test_seed_other_than_one_rescales_by_tangent_over_seed():
    cfg = EraseConfig(inner="aot_eager", seed=1024.0)
    stages = Stages(TwoBlock(), two_block_inputs(), cfg)
    gm = stages.scheduled.gm
    seeds = [n for n in early_nodes(gm) if n.target is aten.full.default]
    assert [s.args[1] for s in seeds] == [1024.0]
    num_fwd = stages.joint.num_fwd_outputs
    grad = output_values(gm.graph)[num_fwd + stages.analysis.blocks[0].component.grad_outputs[0][0]]
    scale = grad.args[1]
    assert scale.target is aten.div.Tensor and scale.args == (scale.args[0], 1024.0)
    assert scale.args[0].name == "tangents_1"


@pytest.mark.parametrize("seed", [1.0, 1024.0])
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_rewritten_joint_graph_computes_the_same_values(seed, inner):
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner=inner, seed=seed), inner=inner)
    for _ in range(3):
        values = real_values(stages.joint.gm)
        values["tangents_1"] = torch.randn(())  # not 1: the rescaling matters
        expected = run_joint(stages.joint.gm, values)
        assert_outputs_close(run_joint(stages.scheduled.gm, values), expected)


def test_partition_keeps_early_matrix_work_in_the_forward(two_block):
    fw_nodes = early_nodes(two_block.fw)
    assert {get_meta(n).block for n in fw_nodes} == {0}
    assert "mm" in targets(two_block.fw, [n.name for n in fw_nodes])
    assert not any(targets(two_block.bw, [n.name])[0] == "mm" for n in early_nodes(two_block.bw))
    # the backward reads each early grad and multiplies it by the tangent
    bw_inputs = [n.name for n in two_block.bw.graph.find_nodes(op="placeholder")]
    assert bw_inputs[-1] == "tangents_1"


@pytest.mark.parametrize("partitioner", ["min_cut", "default"])
def test_forward_then_backward_modules_equal_the_joint_graph(partitioner):
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager",
                                                          tuning=Tuning(partitioner=partitioner)))
    fw, bw = stages.fw, stages.bw
    num_fwd = stages.joint.num_fwd_outputs
    values = real_values(stages.joint.gm)
    values["tangents_1"] = torch.tensor(2.5)
    expected = run_joint(stages.joint.gm, values)
    primal_values = [values[n.name] for n in fw.graph.find_nodes(op="placeholder")]
    fw_out = list(fw(*primal_values))
    saved = fw_out[num_fwd:]
    grads = list(bw(*saved, values["tangents_1"]))
    assert_outputs_close(fw_out[:num_fwd] + grads, expected)


def test_check_early_schedule_catches_a_tangent_read_by_an_early_node(two_block):
    from erase_fx.errors import GraphInvariantError
    from erase_fx.passes.graph import clone_module
    from erase_fx.passes.node_meta import update_meta

    gm, _ = clone_module(two_block.scheduled.gm)
    tangent = next(n for n in gm.graph.nodes if is_tangent(n))
    update_meta(tangent, role=Role.EARLY_BACKWARD, block=0)
    with pytest.raises(GraphInvariantError, match="reads a tangent"):
        check_early_schedule(PassResult(gm, True), after_analysis(two_block))


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_parts_of_a_shared_gradient_reach_the_sums_scaled_and_compute_the_same_values(inner):
    stages = Stages(Towers(3), chain_inputs(), EraseConfig(inner=inner), inner=inner)
    gm = stages.scheduled.gm
    blocks = stages.analysis.blocks
    assert len(blocks) == 2 and all(b.component.partials for b in blocks)
    parts = [n for n in gm.graph.nodes if (m := get_meta(n)) and m.role is Role.PARTIAL_SCALE]
    assert len(parts) == sum(len(b.component.partials) for b in blocks)
    for part in parts:
        early, scale = part.args
        assert get_meta(early).role is Role.EARLY_BACKWARD
        assert get_meta(early).block == get_meta(part).block
        assert scale.name == "tangents_1"
        assert all(user.target is aten.add.Tensor for user in part.users)
    for _ in range(2):
        values = real_values(stages.joint.gm)
        values["tangents_1"] = torch.randn(())
        assert_outputs_close(run_joint(gm, values), run_joint(stages.joint.gm, values))
    # the partition keeps the parts' work in the forward (else check_partition raises)
    assert {get_meta(n).block for n in early_nodes(stages.fw)} == {0, 1}


def test_check_early_schedule_catches_an_unscaled_part():
    from erase_fx.errors import GraphInvariantError
    from erase_fx.passes.graph import clone_module

    stages = Stages(Towers(3), chain_inputs(), EraseConfig(inner="aot_eager"))
    gm, _ = clone_module(stages.scheduled.gm)
    part = next(n for n in gm.graph.nodes if (m := get_meta(n)) and m.role is Role.PARTIAL_SCALE)
    part.args = (part.args[0], 1.0)
    with pytest.raises(GraphInvariantError, match="unscaled or unread"):
        check_early_schedule(PassResult(gm, True), after_analysis(stages))


def test_a_block_in_pieces_clones_each_piece_after_its_ready_point():
    stages = Stages(TowersInterleaved(3), chain_inputs(), EraseConfig(inner="aot_eager"))
    gm = stages.scheduled.gm
    (block,) = stages.analysis.blocks
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    clones = early_nodes(gm)
    pieces = [[n for n in clones if get_meta(n).piece == k] for k in range(4)]
    assert all(pieces) and sum(map(len, pieces)) == len(clones)
    for k, ready in enumerate(block.component.piece_ready):
        first = min(position[n] for n in pieces[k])
        assert first > position[by_name[ready]]
        if k:
            assert first > max(position[n] for n in pieces[k - 1])
    for _ in range(2):
        values = real_values(stages.joint.gm)
        values["tangents_1"] = torch.randn(())
        assert_outputs_close(run_joint(gm, values), run_joint(stages.joint.gm, values))
