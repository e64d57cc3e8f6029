"""defer_grad_scaling (the backward pass) and ScaledBackward (its runtime), on CPU."""
import copy

import pytest
import torch
import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.emit import scale_grads
from erase_fx.emit.scale_grads import ScaledBackward, is_dense, scale_unless_one_
from erase_fx.passes import (
    NodeMeta,
    PassContext,
    Role,
    ScaledGrad,
    defer_grad_scaling,
    get_meta,
    pipeline,
    run_pass,
)
from erase_fx.passes.defer_grad_scaling import VIEW_OPS, check_deferred_scaling
from erase_fx.passes.graph import is_tangent, output_values
from erase_fx.passes.node_meta import set_meta
from graphs import (
    Chain,
    Stages,
    assert_same_grads,
    attention_chain,
    attention_inputs,
    chain_inputs,
    check_parity,
    real_values,
)

aten = torch.ops.aten
CFG = EraseConfig(inner="aot_eager")


def deferred_of(bw):
    """defer_grad_scaling's result, checked (`check_deferred_scaling`) as the pipeline checks it."""
    return run_pass(pipeline.DEFER_GRAD_SCALING, bw, CFG)


@pytest.fixture(scope="module")
def chain():
    return Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager"))


def test_early_grads_leave_unscaled_with_one_scale_per_tangent(chain):
    code = chain.bw.code
    deferred = deferred_of(chain.bw)
    assert chain.bw.code == code  # the input is not touched
    early = {i for b in chain.analysis.blocks for i, _ in b.component.grad_outputs}
    assert {e.grad_index for e in deferred.artifact.scaled} == early
    outputs = output_values(deferred.gm.graph)
    assert len(outputs) == deferred.artifact.num_grads + 1  # one loss, one tangent: one scale
    assert is_tangent(outputs[-1])
    placeholders = list(deferred.gm.graph.find_nodes(op="placeholder"))
    for entry in deferred.artifact.scaled:
        node = outputs[entry.grad_index]
        while node.op == "call_function":
            assert node.target in VIEW_OPS
            node = node.args[0]
        assert node is placeholders[entry.saved_index] and not is_tangent(node)
    assert not any(n.target is aten.mul.Tensor for n in deferred.gm.graph.nodes)
    check_deferred_scaling(deferred, PassContext.of(CFG))


def test_deferred_grads_times_their_scale_equal_the_original_backward(chain):
    deferred = deferred_of(chain.bw)
    values = real_values(chain.bw)
    values = {k: (v * 3 if k.startswith("tangents") else v) for k, v in values.items()}
    args = [values[n.name] for n in chain.bw.graph.find_nodes(op="placeholder")]
    expected = chain.bw(*args)
    actual = deferred.gm(*args)
    num_grads = deferred.artifact.num_grads
    grads, scales = list(actual[:num_grads]), actual[num_grads:]
    for entry in deferred.artifact.scaled:
        grads[entry.grad_index] = grads[entry.grad_index] * scales[entry.scale_index]
    for got, want in zip(grads, expected):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def _backward_graph(saved_has_another_user: bool) -> fx.GraphModule:
    graph = fx.Graph()
    saved = graph.placeholder("saved")
    other = graph.placeholder("other")
    tangent = graph.placeholder("tangents_1")
    for node, shape in ((saved, (3, 2)), (other, (3,)), (tangent, ())):
        node.meta["val"] = torch.empty(shape)
    viewed = graph.call_function(aten.t.default, (saved,))
    scaled = graph.call_function(aten.mul.Tensor, (viewed, tangent))
    set_meta(scaled, NodeMeta(Role.GRAD_SCALE, block=0, grad_of=0))
    uses = graph.call_function(aten.sum.default, (saved if saved_has_another_user else other,))
    other_grad = graph.call_function(aten.mul.Tensor, (other, uses))
    graph.output((scaled, other_grad))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_view_chain_of_a_saved_tensor_is_deferred():
    deferred = deferred_of(_backward_graph(saved_has_another_user=False))
    assert deferred.artifact.scaled == (ScaledGrad(grad_index=0, scale_index=0, saved_index=0),)
    out = output_values(deferred.gm.graph)
    assert out[0].target is aten.t.default and out[2].name == "tangents_1"


def test_a_saved_tensor_the_backward_also_reads_stays_scaled_in_the_graph():
    bw = _backward_graph(saved_has_another_user=True)
    deferred = deferred_of(bw)
    assert not deferred.modified and deferred.gm is bw


# -- ScaledBackward ----------------------------------------------------------------


@pytest.fixture
def in_backward(monkeypatch):
    """Calls below are made outside autograd's engine: say the graph is not kept."""
    monkeypatch.setattr(scale_grads, "backward_keeps_graph", lambda: False)


def passthrough(args):
    """A compiled backward: grad 0 computed, grad 1 = the saved tensor, then the scale."""
    saved, other, tangent = args
    args.clear()
    return [other * tangent, saved, tangent]


SCALED = (ScaledGrad(grad_index=1, scale_index=0, saved_index=0),)


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_early_grad_is_scaled_in_place_and_handed_out_as_an_alias(in_backward, scale):
    saved, other = torch.randn(4, 3).t(), torch.randn(5)
    expected = saved * scale
    grads = ScaledBackward(passthrough, 2, SCALED)([saved, other, torch.tensor(scale)])
    assert torch.equal(grads[1], expected) and torch.equal(grads[0], other * scale)
    assert grads[1].data_ptr() == saved.data_ptr() and grads[1] is not saved


def test_a_kept_graph_is_scaled_out_of_place(monkeypatch):
    monkeypatch.setattr(scale_grads, "backward_keeps_graph", lambda: True)
    saved = torch.randn(3)
    before = saved.clone()
    grads = ScaledBackward(passthrough, 2, SCALED)([saved, torch.randn(3), torch.tensor(3.0)])
    assert torch.equal(saved, before) and torch.equal(grads[1], 3 * before)


def test_memory_shared_with_another_input_is_scaled_out_of_place(in_backward):
    base = torch.randn(6)
    saved, other = base[:3], base[3:]
    before = base.clone()
    grads = ScaledBackward(passthrough, 2, SCALED)([saved, other, torch.tensor(2.0)])
    assert torch.equal(base, before) and torch.equal(grads[1], 2 * before[:3])


def test_a_gradient_proven_private_is_scaled_in_place_without_reading_any_memory(
        in_backward, monkeypatch):
    def unread(values):
        raise AssertionError("the memory of a proven gradient was read")

    monkeypatch.setattr(scale_grads, "_storage_ptrs", unread)
    saved, other = torch.randn(4, 3).t(), torch.randn(5)
    expected = saved * 3.0
    backward = ScaledBackward(passthrough, 2, SCALED, private={(1, 0)})
    assert backward.checked == (False,)
    grads = backward([saved, other, torch.tensor(3.0)])
    assert torch.equal(grads[1], expected) and grads[1].data_ptr() == saved.data_ptr()


def test_a_gradient_proven_private_but_not_dense_is_scaled_out_of_place(in_backward):
    base = torch.randn(4, 6)
    saved = base[:, :3]
    before = base.clone()
    grads = ScaledBackward(passthrough, 2, SCALED, private={(1, 0)})(
        [saved, torch.randn(5), torch.tensor(2.0)])
    assert torch.equal(base, before) and torch.equal(grads[1], 2 * before[:, :3])


def test_a_proof_for_another_saved_tensor_does_not_count(in_backward):
    base = torch.randn(6)
    saved, other = base[:3], base[3:]
    before = base.clone()
    backward = ScaledBackward(passthrough, 2, SCALED, private={(1, 1)})
    assert backward.checked == (True,)
    grads = backward([saved, other, torch.tensor(2.0)])
    assert torch.equal(base, before) and torch.equal(grads[1], 2 * before[:3])


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_chains_whole_early_gradients_are_scaled_without_a_memory_check(inner, monkeypatch):
    """The compilation hands ScaledBackward its proofs: a chain's early gradients are all
    whole, so no call reads the memory of the backward's inputs; the gradients stay eager's."""
    reads = []
    original = scale_grads._storage_ptrs
    monkeypatch.setattr(scale_grads, "_storage_ptrs",
                        lambda values: reads.append(len(values)) or original(values))
    check_parity(Chain(3), chain_inputs, options={"inner": inner}, steps=2,
                 rtol=1e-5, atol=1e-6)
    assert reads == []


def test_is_dense_agrees_with_torch():
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    base = torch.randn(4, 6, 5)
    cases = [base, base.permute(2, 0, 1), base.t() if base.dim() == 2 else base.transpose(0, 2),
             base[:, ::2], base[:, :3], base.expand(2, 4, 6, 5), base[:1], torch.randn(3, 1)[:, :1],
             torch.randn(7, 1).t(), base.unsqueeze(1).expand(4, 3, 6, 5), torch.empty(0, 3)]
    for t in cases:
        assert is_dense(t) == is_non_overlapping_and_dense_or_false(t), (t.shape, t.stride())


def test_scale_unless_one_leaves_memory_alone_at_one_and_multiplies_otherwise():
    tensors = [torch.randn(3, 4), torch.randn(5, dtype=torch.bfloat16)]
    kept = [t.clone() for t in tensors]
    scale_unless_one_(tensors, torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(tensors, kept))
    scale_unless_one_(tensors, torch.tensor(0.5))
    assert all(torch.equal(a, b * torch.tensor(0.5, dtype=b.dtype)) for a, b in zip(tensors, kept))


@pytest.mark.parametrize("gradient", [1.0, 3.0])
@torch._functorch.config.patch(donated_buffer=False)  # else retain_graph raises (test_errors)
def test_retain_graph_then_a_second_backward_equals_eager(gradient):
    eager = Chain(3)
    erased = copy.deepcopy(eager)
    compiled = torch.compile(erased, backend="erase",
                             options={"inner": "aot_eager", "on_error": "raise"})
    inputs = chain_inputs()
    for module, fn in ((eager, eager), (erased, compiled)):
        loss = fn(*inputs)
        loss.backward(torch.tensor(gradient), retain_graph=True)
        loss.backward(torch.tensor(gradient))
    assert_same_grads(eager, erased)


@pytest.mark.parametrize("make_model, make_inputs", [
    (lambda: Chain(3), chain_inputs),
    (lambda: attention_chain(3), attention_inputs),
], ids=["chain", "attention"])
def test_with_inductor_every_early_grad_is_deferred(monkeypatch, make_model, make_inputs):
    # the real pipeline (Inductor's joint passes, min-cut partitioner): a
    # gradient left scaled in the graph would cost a pass over its memory
    seen = []

    def spy(bw, ctx):
        result = defer_grad_scaling(bw, ctx)
        scaled_in_graph = [n for n in bw.graph.nodes
                           if (m := get_meta(n)) is not None and m.role is Role.GRAD_SCALE]
        seen.append((len(scaled_in_graph), len(result.artifact.scaled)))
        return result

    monkeypatch.setattr(pipeline.DEFER_GRAD_SCALING, "run", spy)
    model = make_model()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="erase",
                             options={"inner": "inductor", "on_error": "raise"})
    inputs = make_inputs()
    compiled(*inputs).backward(torch.tensor(2.0))
    eager(*inputs).backward(torch.tensor(2.0))
    assert seen and all(found == deferred > 0 for found, deferred in seen), seen
    assert_same_grads(eager, model, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_early_grads_reach_grad_without_a_copy(inner, monkeypatch):
    """Each early block's gradient is the tensor its forward made: the backward scales it in
    place (not at all at T == seed) and AccumulateGrad takes it as ``.grad``, so no second
    copy of the early gradients exists at any time."""
    from erase_fx.emit import program

    # The forward's output storages are kept alive (a storage reference does not count as a
    # reference to the tensor, so AccumulateGrad may still take it): their addresses cannot be
    # handed to a late gradient by the allocator, so matching by address is sound.
    made_storages: list[torch.UntypedStorage] = []
    run = program.StreamProgram.__call__

    def call(self, args):
        outputs = run(self, args)
        made_storages.extend(t.untyped_storage() for t in outputs if torch.is_tensor(t))
        return outputs

    monkeypatch.setattr(program.StreamProgram, "__call__", call)
    torch._dynamo.reset()
    model = Chain(3)
    compiled = torch.compile(model, backend="erase", options={"inner": inner, "on_error": "raise"})
    compiled(*chain_inputs()).backward()
    made = {s.data_ptr() for s in made_storages if s.nbytes()}
    early = [p for name, p in model.named_parameters() if name.split(".")[1] in ("0", "1")]
    assert len(early) == 16
    assert all(p.grad.untyped_storage().data_ptr() in made for p in early)
    late = [p for name, p in model.named_parameters() if name.split(".")[1] == "2"]
    assert not any(p.grad.untyped_storage().data_ptr() in made for p in late)
