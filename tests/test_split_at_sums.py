"""split_at_sums on hand-built backward graphs: which sums join loss terms, and each term's part."""
import pytest
import torch
import torch.fx as fx

from erase_fx.errors import GraphInvariantError
from erase_fx.passes.graph import topo_positions
from erase_fx.passes.split_at_sums import (
    TermSplit,
    check_term_split,
    module_path,
    split_at_sums,
)

aten = torch.ops.aten
N = 4


class Backward:
    """A backward graph written by hand, every node with a real example value.

    ``tangents_1`` and two forward values ``x``, ``w``; ``seed = expand(T)``.
    """

    def __init__(self):
        self.graph = fx.Graph()
        self.values: dict[fx.Node, torch.Tensor] = {}
        self.tangent = self.placeholder("tangents_1", torch.ones(()))
        self.x = self.placeholder("x", torch.randn(N, N))
        self.w = self.placeholder("w", torch.randn(N, N))
        self.seed = self.op(aten.expand.default, self.tangent, [N, N])

    def placeholder(self, name: str, value: torch.Tensor) -> fx.Node:
        node = self.graph.placeholder(name)
        node.meta["val"] = self.values[node] = value
        return node

    def op(self, target, *args) -> fx.Node:
        node = self.graph.call_function(target, args)
        values = fx.node.map_arg(args, self.values.__getitem__)
        node.meta["val"] = self.values[node] = target(*values)
        return node

    def term(self, start: fx.Node, blocks: int) -> tuple[fx.Node, list[fx.Node]]:
        """A loss term through ``blocks`` two-branch blocks: each block's input gradient
        is the sum of its branches' (``mm``); returns the last sum and all sums."""
        grad, sums = self.op(aten.mul.Tensor, start, self.x), []
        for _ in range(blocks):
            grad = self.op(aten.add.Tensor, self.op(aten.mm.default, grad, self.w),
                           self.op(aten.mm.default, grad, self.w))
            sums.append(grad)
        return grad, sums

    def split(self, result: fx.Node) -> TermSplit | None:
        self.graph.output((result,))
        members = [n for n in self.graph.nodes
                   if n.op == "call_function" and n is not self.seed]
        return split_at_sums(members, {self.seed}, {self.x, self.w}, topo_positions(self.graph))


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_a_terms_own_branch_sums_are_part_of_it_not_joins(blocks):
    g = Backward()
    main, own_sums = g.term(g.seed, blocks)  # the main loss through the trunk's blocks
    aux = g.op(aten.mm.default, g.op(aten.mul.Tensor, g.seed, g.w), g.w)  # an auxiliary head
    join = g.op(aten.add.Tensor, main, aux)  # the branch point's gradient
    after = g.op(aten.mm.default, join, g.w)  # the trunk before the branch point
    split = g.split(after)
    assert split is not None and split.joins == (join,)
    assert split.rest == {join, after}
    assert len(split.terms) == 2 and split.parts == (0, 1) and split.held == ()
    (main_part,) = [t for t in split.terms if main in t]
    assert set(own_sums) <= main_part
    assert split.reach[join] == {0, 1} and all(len(split.reach[s]) == 1 for s in own_sums)


def test_a_term_without_matrix_work_is_held_in_the_rest():
    g = Backward()
    main, _ = g.term(g.seed, 2)
    penalty = g.op(aten.mul.Tensor, g.seed, g.x)  # elementwise only
    join = g.op(aten.add.Tensor, main, penalty)
    split = g.split(g.op(aten.mm.default, join, g.w))
    (held,) = split.held
    assert held == (next(i for i, t in enumerate(split.terms) if penalty in t), None)
    assert penalty in split.rest and len(split.parts) == 1


def test_a_term_read_other_than_through_a_sum_is_held_with_its_reader():
    g = Backward()
    main, _ = g.term(g.seed, 1)
    aux = g.op(aten.mm.default, g.op(aten.mul.Tensor, g.seed, g.w), g.w)
    cat = g.op(aten.cat.default, [main, aux])  # the backward of a split: not a sum
    split = g.split(g.op(aten.mm.default, cat, g.w))
    assert split.joins == () and split.parts == ()
    assert [reader for _, reader in split.held] == [cat, cat]


def test_one_loss_term_is_no_split():
    g = Backward()
    main, _ = g.term(g.seed, 2)
    assert g.split(g.op(aten.mm.default, main, g.w)) is None


def test_check_term_split_catches_a_part_the_rest_reads_other_than_through_a_sum():
    g = Backward()
    main, _ = g.term(g.seed, 1)
    aux = g.op(aten.mm.default, g.op(aten.mul.Tensor, g.seed, g.w), g.w)
    join = g.op(aten.add.Tensor, main, aux)
    after = g.op(aten.mm.default, join, aux)  # reads the aux part directly too
    split = g.split(after)
    assert split.held and aux in split.rest  # so the aux term stays in the rest
    forced = TermSplit(split.terms, (0, 1), (), frozenset({join, after}), split.joins,
                       split.reach)
    with pytest.raises(GraphInvariantError, match="other than through a sum"):
        check_term_split(forced, frozenset(split.reach))


@pytest.mark.parametrize("raw, path", [
    ("L['self'].inc4.1.b2", "inc4.1.b2"),
    ("L['self']._modules['inc4']._modules['1']", "inc4.1"),
    ("L['self'].towers[0]", "towers.0"),
    ("L['self']", None),
])
def test_module_path_is_the_modules_qualified_name(raw, path):
    node = fx.Graph().placeholder("x")
    node.meta["fwd_nn_module_stack"] = {"root": ("L['self']", object), "leaf": (raw, object)}
    assert module_path(node) == path
