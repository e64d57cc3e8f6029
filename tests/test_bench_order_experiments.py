"""bench.order_experiments: the ``/forward-first`` row's order of a block's side segment."""
import pytest
import torch

from bench.harness import Variant
from bench.order_experiments import forward_first
from erase_fx.config import EraseConfig
from erase_fx.passes.node_meta import NodeMeta, Role, is_early
from graphs import Chain, Stages, chain_inputs


def late_forward_nodes(stages: Stages) -> list[list[str]]:
    """Per block segment, the forward nodes that read no early node yet come after the first
    early node (the block's loss value, in the partitioner's order)."""
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
def test_forward_first_puts_each_blocks_loss_value_before_its_early_backward(inner):
    def stages():
        torch.manual_seed(0)
        return Stages(Chain(3), chain_inputs(), EraseConfig(inner=inner), inner=inner)

    stock = late_forward_nodes(stages())
    assert len(stock) == 2 and all(stock), stock  # the partitioner's order: loss value last
    with Variant.parse("erase+step/forward-first").patched():
        reordered = late_forward_nodes(stages())
    assert reordered == [[], []], reordered


def test_forward_first_keeps_a_blocks_order_where_it_has_a_random_op():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    late = graph.call_function(torch.ops.aten.neg.default, (x,))
    late.meta["erase_fx"] = NodeMeta(Role.EARLY_BACKWARD, block=0)
    noise = graph.call_function(torch.ops.aten.rand_like.default, (x,))
    noise.meta["erase_fx"] = NodeMeta(Role.FORWARD, block=0)
    assert forward_first([late, noise]) == [late, noise]
    plain = graph.call_function(torch.ops.aten.relu.default, (x,))
    plain.meta["erase_fx"] = NodeMeta(Role.FORWARD, block=0)
    assert forward_first([late, plain]) == [plain, late]
