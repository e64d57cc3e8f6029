"""merge_common_subexpressions: the joint graph's tangent-free repeats merged before the blocks
are cloned, so that each block keeps its own label mask and the backward saves none."""
import importlib
import operator

import pytest
import torch
import torch.fx as fx
from torch._functorch.compile_utils import fx_graph_cse

from erase_fx.config import EraseConfig
from erase_fx.errors import GraphInvariantError
from erase_fx.passes import get_meta
from erase_fx.passes.find_stop_gradient_blocks import find_stop_gradient_blocks
from erase_fx.passes.graph import clone_module, is_view
from erase_fx.passes.merge_common_subexpressions import (
    MergedSubexpressions,
    check_merged,
    merge_common_subexpressions,
)
from erase_fx.passes.pass_result import PassContext, PassResult
from graphs import Chain, Stages, chain_inputs, trace_joint

partition_module = importlib.import_module("erase_fx.passes.partition_joint_graph")
merge_module = importlib.import_module("erase_fx.passes.merge_common_subexpressions")
aten = torch.ops.aten
CLASSES = 8192  # a batch of 64 x 8192 classes: a 2 MiB label mask per block
BATCH = 64
LARGE = 1 << 20
CTX = PassContext.of(EraseConfig())


def label_only(node: fx.Node) -> bool:
    """Whether ``node`` is a value of at least LARGE bytes made from the labels alone (the
    int64 input) and constants."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.numel() * value.element_size() < LARGE:
        return False
    stack, seen, inputs = [node], set(), set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            inputs.add(current.meta["val"].dtype)
        stack.extend(current.all_input_nodes)
    return inputs == {torch.int64}


def label_only_values_saved(stages: Stages) -> list[str]:
    """The label-only values the backward reads from the forward: what it could make."""
    fw_nodes = {n.name: n for n in stages.fw.graph.nodes}
    return [saved.name for saved in stages.bw.graph.find_nodes(op="placeholder")
            if saved.name in fw_nodes and label_only(fw_nodes[saved.name])]


def wide_chain_stages() -> Stages:
    torch.manual_seed(0)
    return Stages(Chain(3, classes=CLASSES), chain_inputs(batch=BATCH, classes=CLASSES),
                  EraseConfig(inner="inductor"), inner="inductor")


def test_each_block_makes_its_own_label_mask_and_the_backward_saves_none():
    stages = wide_chain_stages()
    assert len(stages.analysis.blocks) == 2
    assert label_only_values_saved(stages) == []
    # each early block makes a batch x classes mask of its own from the labels, read by it alone
    masks = [n for n in stages.fw.graph.nodes if label_only(n) and not is_view(n)]
    owners = [{get_meta(u).block for u in n.users} for n in masks]
    assert owners and all(len(o) == 1 for o in owners) and set().union(*owners) == {0, 1}, owners


def test_merged_after_the_cloning_the_backward_saves_a_mask(monkeypatch):
    """The property above fails in the order before this pass: no merge before the blocks
    are cloned, the stock partitioner's CSE after (``bench``'s ``/late-cse``)."""
    monkeypatch.setattr(merge_module, "_duplicates", lambda graph: [])
    monkeypatch.setattr(partition_module, "PARTITIONER_CSE", True)
    assert label_only_values_saved(wide_chain_stages()) != []


def test_nodes_that_read_a_tangent_stay_apart():
    """Merged too, the blocks' gradients of one summed loss start from one node and the
    whole backward is one component: no early block."""
    joint = trace_joint(Chain(3), *chain_inputs(), inner="inductor")
    merged = merge_common_subexpressions(joint.gm, CTX)
    assert merged.modified and merged.artifact.removed
    given = PassContext.of(EraseConfig(), num_fwd_outputs=joint.num_fwd_outputs)
    found = find_stop_gradient_blocks(merged.gm, given).artifact
    assert len(found.blocks) == 2
    everything, _ = clone_module(joint.gm)
    everything.graph = fx_graph_cse(everything.graph)
    found = find_stop_gradient_blocks(everything, given).artifact
    assert found.blocks == ()


def test_the_input_is_not_touched_and_no_repeat_is_left():
    joint = trace_joint(Chain(3), *chain_inputs(), inner="inductor")
    before = joint.gm.code
    result = merge_common_subexpressions(joint.gm, CTX)
    assert joint.gm.code == before and result.gm is not joint.gm
    check_merged(result, CTX)
    again = merge_common_subexpressions(result.gm, CTX)
    assert not again.modified and again.gm is result.gm


# -- hand-built joints: what is never merged ---------------------------------------------

def joint_graph() -> tuple[fx.Graph, fx.Node, fx.Node]:
    graph = fx.Graph()
    x = graph.placeholder("primals_1")
    x.meta["val"] = torch.empty(4, 4)
    tangent = graph.placeholder("tangents_1")
    tangent.meta["val"] = torch.empty(4, 4)
    return graph, x, tangent


def merged_names(graph: fx.Graph, outputs) -> tuple[str, ...]:
    graph.output(tuple(outputs))
    result = merge_common_subexpressions(fx.GraphModule(torch.nn.Module(), graph), CTX)
    check_merged(result, CTX)
    return result.artifact.removed


def test_a_pure_repeat_merges_with_its_users():
    graph, x, _ = joint_graph()
    a = graph.call_function(aten.relu.default, (x,))
    b = graph.call_function(aten.relu.default, (x,))
    a2 = graph.call_function(aten.mul.Tensor, (a, 2.0))
    b2 = graph.call_function(aten.mul.Tensor, (b, 2.0))
    c = graph.call_function(aten.mul.Tensor, (b, 2))  # NB: an int is not a float
    assert merged_names(graph, [graph.call_function(aten.add.Tensor, (a2, b2)), c]) == (
        b.name, b2.name)


def test_random_ops_tangent_readers_and_returned_values_stay_apart():
    graph, x, tangent = joint_graph()
    drops = [graph.call_function(aten.native_dropout.default, (x, 0.5, True)) for _ in range(2)]
    kept = [graph.call_function(operator.getitem, (d, 0)) for d in drops]
    grads = [graph.call_function(aten.mul.Tensor, (tangent, x)) for _ in range(2)]
    returned = [graph.call_function(aten.sin.default, (x,)) for _ in range(2)]
    empties = [graph.call_function(aten.empty.memory_format, ([4],)) for _ in range(2)]
    assert merged_names(graph, [*kept, *grads, *returned, *empties]) == ()


def test_nothing_merges_across_a_mutation():
    graph, x, _ = joint_graph()
    before = graph.call_function(aten.cos.default, (x,))
    graph.call_function(aten.copy_.default, (x, before))
    after = graph.call_function(aten.cos.default, (x,))
    total = graph.call_function(aten.add.Tensor, (before, after))
    assert merged_names(graph, [total]) == ()


def test_the_check_rejects_a_repeat_left():
    graph, x, _ = joint_graph()
    a = graph.call_function(aten.relu.default, (x,))
    b = graph.call_function(aten.relu.default, (x,))
    graph.output((graph.call_function(aten.add.Tensor, (a, b)),))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    unmerged = PassResult(gm, True, MergedSubexpressions((), ("primals_1", "tangents_1"), 1))
    with pytest.raises(GraphInvariantError, match="common subexpressions are left"):
        check_merged(unmerged, CTX)


def test_the_stock_partitioner_reads_its_cse_setting_at_each_call():
    """Pins the torch internal `partition_joint_graph` relies on: ``min_cut``'s CSE is
    ``torch._functorch.config.cse``, read when it runs (torch 2.11-2.14)."""
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    joint = trace_joint(Chain(3), *chain_inputs(), inner="inductor")
    sizes = {}
    for cse in (False, True):
        gm, _ = clone_module(joint.gm)
        with functorch_config.patch(cse=cse):
            fw, bw = min_cut_rematerialization_partition(
                gm, joint.joint_inputs, num_fwd_outputs=joint.num_fwd_outputs, **joint.kwargs)
        sizes[cse] = len(fw.graph.nodes) + len(bw.graph.nodes)
    assert sizes[True] < sizes[False]


def test_a_higher_order_op_is_taken_for_a_mutation_and_size_arithmetic_is_not():
    graph, x, _ = joint_graph()
    size = graph.call_function(torch.ops.aten.sym_size.int, (x, 0))
    doubled = graph.call_function(operator.mul, (size, 2))
    before = graph.call_function(aten.cos.default, (x,))
    again = graph.call_function(aten.cos.default, (x,))
    assert merged_names(graph, [graph.call_function(aten.add.Tensor, (before, again)),
                                doubled]) == (again.name,)
    graph, x, _ = joint_graph()
    before = graph.call_function(aten.cos.default, (x,))
    graph.call_function(torch.ops.higher_order.run_and_save_rng_state, (aten.rand.default, [4]))
    after = graph.call_function(aten.cos.default, (x,))
    assert merged_names(graph, [graph.call_function(aten.add.Tensor, (before, after))]) == ()
