"""Op-by-op linearity in the loss gradient: the cases Inductor's decompositions produce."""
import pytest
import torch
import torch._inductor.inductor_prims  # noqa: F401 - registers prims.fma
import torch.fx as fx

from erase_fx.passes.linearity import linearity_violation

aten, prims = torch.ops.aten, torch.ops.prims


def op(target, *args):
    """A graph with placeholders g (tangent-dependent), x, y and one call; returns (call, {g})."""
    graph = fx.Graph()
    names = {name: graph.placeholder(name) for name in ("g", "x", "y", "i")}
    call = graph.call_function(target, tuple(names.get(a, a) if isinstance(a, str) else a
                                             for a in args))
    return call, {names["g"]}


@pytest.mark.parametrize("args, linear", [
    (("g", "x", "y"), False),   # g * x + y: affine
    (("g", "x", "g"), True),    # g * x + g
    (("x", "g", 0.0), True),    # x * g + 0
    (("g", "g", "y"), False),   # quadratic
    (("x", "y", "g"), False),   # x * y + g: affine
])
def test_fma_is_linear_when_one_factor_and_the_addend_depend(args, linear):
    node, dependent = op(prims.fma.default, *args)
    assert (linearity_violation(node, dependent) is None) == linear


@pytest.mark.parametrize("target", [aten.cat.default, aten.stack.default])
def test_concatenation_along_a_nonzero_dim_is_linear(target):
    graph = fx.Graph()
    g, h = graph.placeholder("g"), graph.placeholder("h")
    node = graph.call_function(target, ([g, h], 2))
    assert linearity_violation(node, {g, h}) is None
    assert linearity_violation(node, {g}) is not None  # h is a constant: affine


def test_add_of_a_nonzero_scalar_is_affine():
    node, dependent = op(aten.add.Tensor, "g", 2.0)
    assert "affine" in linearity_violation(node, dependent)
    node, dependent = op(aten.add.Tensor, "g", 0)
    assert linearity_violation(node, dependent) is None


def test_masked_index_put_accumulate_is_linear_in_self_and_values():
    graph = fx.Graph()
    g, mask, index, values = (graph.placeholder(n) for n in ("g", "mask", "index", "values"))
    zeros = graph.call_function(aten.zeros.default, ([10, 4],))
    node = graph.call_function(aten._unsafe_masked_index_put_accumulate.default,
                               (zeros, mask, [index], g))
    assert linearity_violation(node, {g}) is None
    node = graph.call_function(aten._unsafe_masked_index_put_accumulate.default,
                               (values, mask, [index], g))
    assert "non-zero" in linearity_violation(node, {g})
    node = graph.call_function(aten._unsafe_masked_index_put_accumulate.default,
                               (values, mask, [g], values))
    assert "non-linear position" in linearity_violation(node, {g})


@pytest.mark.parametrize("target, args", [
    (aten.new_zeros.default, ("g", [3])),
    (aten.zeros_like.default, ("g",)),
])
def test_zeros_shaped_like_the_gradient_are_linear(target, args):
    node, dependent = op(target, *args)
    assert linearity_violation(node, dependent) is None


def test_ones_shaped_like_the_gradient_are_not_known_linear():
    node, dependent = op(aten.ones_like.default, "g")
    assert linearity_violation(node, dependent) is not None
