"""find_stop_gradient_blocks on joint graphs traced by AOTAutograd, and its linearity rules."""
import operator

import pytest
import torch
import torch.fx as fx

import erase_fx
from erase_fx.config import EraseConfig
from erase_fx.passes import PassContext, PassResult, RejectReason, run_pass
from erase_fx.passes.pipeline import FIND_STOP_GRADIENT_BLOCKS
from erase_fx.passes.linearity import is_zero_constant, linearity_violation
from graphs import (
    Chain,
    ClippedChain,
    TwoBlock,
    SharedLayerClipped,
    Towers,
    TowersInterleaved,
    TwoBlockNoDetach,
    TwoBlockOneLoss,
    TwoBlockRegularized,
    TwoBlockSharedLayer,
    TwoBlockTwoOutputs,
    chain_inputs,
    targets,
    trace_joint,
    two_block_inputs,
)

aten = torch.ops.aten
CFG = EraseConfig(inner="aot_eager")


def analyse(joint, **kwargs):
    """The analysis of a joint graph, checked (`check_block_analysis`) as the pipeline checks it."""
    found = run_pass(FIND_STOP_GRADIENT_BLOCKS, joint.gm, CFG,
                     num_fwd_outputs=joint.num_fwd_outputs, **kwargs)
    assert found.gm is joint.gm and not found.modified
    return found.artifact


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("stages", [2, 3, 5])
def test_chain_of_k_stages_has_k_minus_1_early_blocks(inner, stages):
    joint = trace_joint(Chain(stages), *chain_inputs(), inner=inner)
    analysis = analyse(joint)
    assert len(analysis.blocks) == stages - 1
    assert [b.id for b in analysis.blocks] == list(range(stages - 1))
    assert [r.reason for r in analysis.rejected] == [RejectReason.LAST_BLOCK]
    # each stage has 6 parameters (2 Linear, LayerNorm) and its head 2
    assert all(len(b.component.grad_outputs) == 8 for b in analysis.blocks)


def test_blocks_are_ordered_by_ready_point_and_name_their_parameters():
    joint = trace_joint(Chain(3), *chain_inputs())
    names = [f"p{i}" for i in range(100)]
    analysis = analyse(joint, primal_names=names)
    positions = {n.name: i for i, n in enumerate(joint.gm.graph.nodes)}
    ready = [positions[b.component.ready_after] for b in analysis.blocks]
    assert ready == sorted(ready)
    first = analysis.blocks[0]
    # primal 0 is x (first used by x.new_zeros), which needs no gradient
    assert len(first.params) == len(set(first.params)) == 8
    assert "p0" not in first.params
    assert set(first.params).isdisjoint(analysis.blocks[1].params)
    assert first.tangent == "tangents_1"


def test_ready_point_is_the_last_forward_producer():
    joint = trace_joint(TwoBlock(), *two_block_inputs())
    (block,) = analyse(joint).blocks
    ready = {n.name: n for n in joint.gm.graph.nodes}[block.component.ready_after]
    # block 1's backward needs the head's output (addmm of head1), which reads tanh
    assert targets(joint.gm, [ready.name]) == ["addmm"]
    assert ready.op == "call_function"


def test_one_loss_without_detach_means_no_early_block():
    joint = trace_joint(TwoBlockOneLoss(), *two_block_inputs())
    analysis = analyse(joint)
    assert analysis.blocks == ()
    assert [r.reason for r in analysis.rejected] == [RejectReason.LAST_BLOCK]
    assert analysis.early_flops == 0
    assert analysis.backward_flops > 0


def explained(model, inputs):
    (report,) = erase_fx.explain(model, *inputs())
    return report


@pytest.mark.parametrize("model, early, joined", [
    # deep supervision: head 1's backward and its part of h1's gradient; block 1 waits
    (TwoBlockNoDetach, [("head1.weight", "head1.bias")],
     ("b1.0.weight", "b1.0.bias", "b1.2.weight", "b1.2.bias")),
    # a layer both blocks use: its gradient parts are summed in the backward
    (TwoBlockSharedLayer, [("b1.0.weight", "b1.0.bias", "head1.weight", "head1.bias")],
     ("b1.2.weight", "b1.2.bias")),
])
def test_loss_terms_meeting_in_gradient_sums_run_their_parts_early(model, early, joined):
    # NB: head 1's part is under the default min_part_share; every part early here
    (report,) = erase_fx.explain(model(), *two_block_inputs(), erase_options={
        "tuning": {"min_part_share": 0.0}})
    assert [b.params for b in report.blocks] == early
    assert [(r.reason, r.params) for r in report.rejected] == [
        ("last_block", ("b2.0.weight", "b2.0.bias", "b2.2.weight", "b2.2.bias")),
        ("joins_blocks", joined)]
    assert report.rejected[1].detail.startswith("adds up the gradient parts of 2 loss terms")


def test_a_part_without_matrix_work_is_not_split_off():
    # the penalty's part (pow, mean: elementwise) is ready before the last loss, but not
    # worth a stream: the last block stays whole, and only block 1 runs early
    report = explained(TwoBlockRegularized(), two_block_inputs)
    assert [b.params for b in report.blocks] == [
        ("b1.0.weight", "b1.0.bias", "b1.2.weight", "b1.2.bias", "head1.weight", "head1.bias")]
    assert [r.reason for r in report.rejected] == ["last_block"]


def test_towers_over_a_shared_front_run_all_but_the_last_early():
    report = explained(Towers(3), chain_inputs)
    assert [b.params for b in report.blocks] == [
        tuple(f"towers.{k}.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")) for k in (0, 1)]
    assert [r.reason for r in report.rejected] == ["last_block", "joins_blocks"]
    assert report.rejected[1].params == ("front.0.weight", "front.0.bias")
    # each tower hands its part of the front output's gradient to the sum
    assert [b.partials for b in report.blocks] == [1, 1]
    assert [b.partials for b in explained(Chain(3), chain_inputs).blocks] == [0, 0]
    # one tangent per tower loss: each part reads its own
    report = explained(Towers(3, as_tuple=True), chain_inputs)
    assert len(report.blocks) == 2


def test_a_rejected_component_says_when_losses_meet_only_in_gradient_sums():
    # block 1's part clips its gradient and block 2's is last: nothing to split off
    (rejected,) = explained(SharedLayerClipped(), two_block_inputs).rejected
    assert rejected.reason == RejectReason.LAST_BLOCK
    assert ("2 loss terms meet in it only in sums of gradients (the losses through head1 and "
            "b2.2 meet in the gradients of b1.2.bias and b1.2.weight, parameters they "
            "share)") in rejected.detail
    # and why neither term's part can run on its own, each by its reason
    assert "the loss through head1: aten.clamp.default is not known to be linear" in (
        rejected.detail)
    assert "the loss through b2.2: its backward is ready only when the forward ends" in (
        rejected.detail)
    # one loss per component: no such note
    assert all("meet in it" not in r.detail
               for r in analyse(trace_joint(Chain(3), *chain_inputs())).rejected)


def test_two_outputs_block_reads_only_the_loss_tangent():
    joint = trace_joint(TwoBlockTwoOutputs(), *two_block_inputs())
    analysis = analyse(joint)
    (block,) = analysis.blocks
    assert block.component.tangents == ("tangents_1",)
    (last,) = analysis.rejected
    assert last.reason is RejectReason.LAST_BLOCK
    assert set(last.component.tangents) == {"tangents_1", "tangents_2"}


class NonScalarLocalOutput(TwoBlock):
    """Block 1's only 'loss' is a tensor output: its backward reads a non-scalar tangent."""

    def forward(self, x, y):
        h1 = self.b1(x)
        local_out = self.head1(h1)
        out = self.b2(h1.detach())
        return torch.nn.functional.cross_entropy(out, y.argmax(-1)), local_out


def test_block_reading_a_non_scalar_tangent_stays_in_the_backward():
    joint = trace_joint(NonScalarLocalOutput(), *two_block_inputs())
    analysis = analyse(joint)
    assert analysis.blocks == ()
    reasons = {r.reason for r in analysis.rejected}
    assert reasons == {RejectReason.NOT_SCALAR_TANGENT, RejectReason.LAST_BLOCK}


def test_gradient_clipping_backward_is_not_linear():
    joint = trace_joint(ClippedChain(3), *chain_inputs())
    analysis = analyse(joint)
    assert len(analysis.blocks) == 1  # stage 1; stage 0 clips, stage 2 is last
    clipped = [r for r in analysis.rejected if r.reason is RejectReason.NOT_LINEAR]
    assert len(clipped) == 1
    assert "clamp" in clipped[0].detail
    assert targets(joint.gm, [clipped[0].node]) == ["clamp"]


def test_a_mutation_in_a_block_keeps_it_in_the_backward():
    joint = trace_joint(Chain(3), *chain_inputs())
    block = analyse(joint).blocks[0]
    graph = joint.gm.graph
    by_name = {n.name: n for n in graph.nodes}
    victim = by_name[block.component.nodes[0]]
    with graph.inserting_after(victim):
        mutation = graph.call_function(aten.mul_.Tensor, (victim, 1.0))
    mutation.meta["val"] = victim.meta["val"]
    user = next(u for u in victim.users if u is not mutation)
    user.replace_input_with(victim, mutation)
    analysis = analyse(joint)
    assert len(analysis.blocks) == 1
    mutated = [r for r in analysis.rejected if r.reason is RejectReason.MUTATION]
    assert [r.node for r in mutated] == [mutation.name]


def test_analysis_leaves_the_graph_untouched():
    joint = trace_joint(Chain(3), *chain_inputs())
    before = joint.gm.code
    analyse(joint)
    assert joint.gm.code == before


# -- linearity, on hand-built graphs ------------------------------------------


def small_graph():
    graph = fx.Graph()
    grad = graph.placeholder("grad")  # depends on the tangent
    other = graph.placeholder("other")  # does not
    mask = graph.placeholder("mask")
    return graph, grad, other, mask


@pytest.mark.parametrize(
    "build, linear",
    [
        (lambda g, d, o, m: g.call_function(aten.mul.Tensor, (d, o)), True),
        (lambda g, d, o, m: g.call_function(aten.mul.Tensor, (d, d)), False),
        (lambda g, d, o, m: g.call_function(aten.mm.default, (o, d)), True),
        (lambda g, d, o, m: g.call_function(aten.add.Tensor, (d, d)), True),
        (lambda g, d, o, m: g.call_function(aten.add.Tensor, (d, 1.0)), False),
        (lambda g, d, o, m: g.call_function(aten.add.Tensor, (d, 0)), True),
        (lambda g, d, o, m: g.call_function(aten.add.Tensor, (d, o)), False),
        (lambda g, d, o, m: g.call_function(aten.sub.Tensor, (d, d)), True),
        (lambda g, d, o, m: g.call_function(aten.div.Tensor, (d, o)), True),
        (lambda g, d, o, m: g.call_function(aten.div.Tensor, (o, d)), False),
        (lambda g, d, o, m: g.call_function(aten.view.default, (d, [4])), True),
        (lambda g, d, o, m: g.call_function(aten.sum.dim_IntList, (d, [0], True)), True),
        (lambda g, d, o, m: g.call_function(aten.clamp.default, (d, -1.0, 1.0)), False),
        (lambda g, d, o, m: g.call_function(aten.abs.default, (d,)), False),
        (lambda g, d, o, m: g.call_function(aten.exp.default, (d,)), False),
        (lambda g, d, o, m: g.call_function(aten.threshold_backward.default, (d, o, 0)), True),
        (lambda g, d, o, m: g.call_function(aten.threshold_backward.default, (o, d, 0)), False),
        (lambda g, d, o, m: g.call_function(aten.where.self, (m, d, g.call_function(
            aten.full.default, ([], 0.0)))), True),
        (lambda g, d, o, m: g.call_function(aten.where.self, (m, d, o)), False),
        (lambda g, d, o, m: g.call_function(aten.where.self, (d, o, o)), False),
        (lambda g, d, o, m: g.call_function(aten.masked_fill.Scalar, (d, m, 0.0)), True),
        (lambda g, d, o, m: g.call_function(aten.masked_fill.Scalar, (d, m, 2.0)), False),
        (lambda g, d, o, m: g.call_function(operator.getitem, (d, 0)), True),
    ],
)
def test_linearity_rules(build, linear):
    graph, grad, other, mask = small_graph()
    node = build(graph, grad, other, mask)
    dependent = {grad}
    why = linearity_violation(node, dependent)
    assert (why is None) == linear, why


def test_nodes_not_reading_the_gradient_are_always_fine():
    graph, grad, other, mask = small_graph()
    node = graph.call_function(aten.exp.default, (other,))
    assert linearity_violation(node, {grad}) is None


@pytest.mark.parametrize(
    "args, zero",
    [
        ((aten.full.default, ([], 0.0)), True),
        ((aten.full.default, ([], 1.0)), False),
        ((aten.zeros.default, ([3],)), True),
        ((aten.scalar_tensor.default, (0,)), True),
        ((aten.scalar_tensor.default, (-1.0,)), False),
    ],
)
def test_zero_constants(args, zero):
    graph = fx.Graph()
    node = graph.call_function(*args)
    assert is_zero_constant(node) == zero


def test_check_block_analysis_catches_a_part_handed_out_unannounced():
    import dataclasses

    from erase_fx.errors import GraphInvariantError
    from erase_fx.passes.find_stop_gradient_blocks import check_block_analysis

    joint = trace_joint(Towers(3), *chain_inputs())
    analysis = analyse(joint)
    first = analysis.blocks[0]
    hidden = dataclasses.replace(first, component=dataclasses.replace(first.component,
                                                                     partials=()))
    broken = dataclasses.replace(analysis, blocks=(hidden, *analysis.blocks[1:]))
    with pytest.raises(GraphInvariantError, match="read outside it only"):
        check_block_analysis(PassResult(joint.gm, False, broken), PassContext.of(CFG))


def test_check_block_analysis_catches_a_block_reading_another_component():
    import dataclasses

    from erase_fx.errors import GraphInvariantError
    from erase_fx.passes.find_stop_gradient_blocks import check_block_analysis

    joint = trace_joint(Towers(3), *chain_inputs())
    analysis = analyse(joint)
    first, rest = analysis.blocks[0], analysis.rejected[-1]
    # the part's first node moved to the rest: the part would read the rest
    moved = first.component.nodes[0]
    part = dataclasses.replace(first.component, nodes=first.component.nodes[1:])
    broken = dataclasses.replace(analysis, blocks=(
        dataclasses.replace(first, component=part), *analysis.blocks[1:]), rejected=(
        *analysis.rejected[:-1], dataclasses.replace(rest, component=dataclasses.replace(
            rest.component, nodes=(moved, *rest.component.nodes)))))
    with pytest.raises(GraphInvariantError, match="reads a node of another component"):
        check_block_analysis(PassResult(joint.gm, False, broken), PassContext.of(CFG))


def test_an_early_component_whose_loss_terms_are_ready_apart_is_cut_in_pieces():
    joint = trace_joint(TowersInterleaved(3), *chain_inputs())
    (block,) = analyse(joint).blocks
    comp = block.component
    assert len(comp.pieces) == len(comp.piece_ready) == 4
    assert sorted(n for piece in comp.pieces for n in piece) == sorted(comp.nodes)
    position = {n.name: i for i, n in enumerate(joint.gm.graph.nodes)}
    ready = [position[r] for r in comp.piece_ready[:3]]
    assert ready == sorted(ready) and len(set(ready)) == 3  # each tower's own ready point
    # the rest adds the parts up: it reads them, they never read it
    rest = set(comp.pieces[-1])
    by_name = {n.name: n for n in joint.gm.graph.nodes}
    for piece in comp.pieces[:-1]:
        assert not any(a.name in rest for n in piece for a in by_name[n].all_input_nodes)
    # a whole block: no parts handed to the backward
    assert comp.partials == ()
    # a chain's blocks are whole
    assert all(not b.component.pieces for b in analyse(trace_joint(Chain(3),
                                                                    *chain_inputs())).blocks)
