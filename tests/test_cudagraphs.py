"""The pure parts of CUDA graph replay, on CPU: which outputs alias inputs, and liveness.

The replay itself needs a GPU; ``bench/check_cuda.py`` checks it there.
"""
import contextlib

import pytest
import torch

from erase_fx.emit import cudagraphs
from erase_fx.emit.cudagraphs import (
    AliasOf,
    GraphedForward,
    Unreplayed,
    graph_backward,
    _OwnedMemory,
    plan_outputs,
    realize_outputs,
)


def test_plan_marks_outputs_that_live_in_input_memory():
    saved = torch.randn(4, 3)
    tangent = torch.randn(2)
    own = torch.randn(5)
    passthrough, view = saved, saved[1:].t()
    plan = plan_outputs([own, passthrough, view, None], [saved, tangent])
    assert plan[0] is own
    assert plan[1] == AliasOf(0, (4, 3), (3, 1), 0, whole=True)
    assert plan[2] == AliasOf(0, (3, 3), (1, 3), 3, whole=False)
    assert plan[3] is None


def test_realized_outputs_are_fresh_aliases_of_this_replays_inputs():
    saved, own = torch.randn(4, 3), torch.randn(5)
    plan = plan_outputs([own, saved, saved[1:].t()], [saved])
    next_saved = torch.randn(4, 3)  # the same memory in a real replay; here another tensor
    first, whole, view = realize_outputs(plan, [next_saved])
    assert first is not own and first.data_ptr() == own.data_ptr()
    assert torch.equal(first, own)
    assert whole is not next_saved and whole.data_ptr() == next_saved.data_ptr()
    assert torch.equal(view, next_saved[1:].t())
    assert view.data_ptr() == next_saved[1:].data_ptr()


def test_owned_memory_is_in_use_while_an_alias_lives():
    static = torch.randn(8)
    memory = _OwnedMemory([static, None, torch.empty(0)])
    assert not memory.in_use()
    (alias,) = realize_outputs([static], [])
    assert memory.in_use()
    grad = alias.detach()  # what AccumulateGrad stores as .grad
    del alias
    assert memory.in_use()
    del grad
    assert not memory.in_use()


# -- the replay state machine, with a stand-in for CUDA graphs -----------------
#
# A `FakeGraph` "captures" by remembering the call made under it and
# "replays" by running that call again and writing the results into the
# captured outputs' memory, as a real replay writes into the graph's memory.
# That is enough to check which calls replay, that replay never overwrites
# tensors still in use, and that every call returns the right values.


class FakeGraph:
    capturing: "FakeGraph | None" = None

    def __init__(self):
        self.call = None
        self.replays = 0

    def replay(self):
        fn, inputs_of, outputs = self.call
        for out, value in zip(outputs, fn(list(inputs_of()))):
            if out is not None:
                out.copy_(value)
        self.replays += 1


@contextlib.contextmanager
def fake_capture(graph, pool=None):
    FakeGraph.capturing = graph
    try:
        yield
    finally:
        FakeGraph.capturing = None


def captured(fn, inputs_of=None):
    """``fn`` (boxed), telling a fake capture what it ran.

    Like a real graph, the fake holds no tensor it does not own: the
    backward's inputs (the forward's memory) are looked up at replay
    (``inputs_of``), and outputs that live in input memory are not kept.
    """
    def run(args):
        inputs = list(args)
        outputs = fn(args)
        if FakeGraph.capturing is not None:
            owned = {a.untyped_storage().data_ptr() for a in inputs}
            kept = [None if o.untyped_storage().data_ptr() in owned else o for o in outputs]
            FakeGraph.capturing.call = (fn, inputs_of or (lambda: inputs), kept)
        return outputs
    return run


def forward(args):
    """User output: the loss; saved: the activation and an early gradient."""
    x, w = args
    h = x @ w
    return [h.square().sum(), h, 2 * x.t() @ h]


def backward(args):
    """The gradient computed here, then the early one passed through."""
    h, early, tangent = args
    return [tangent * h.sum(0), early]


@pytest.fixture
def graphed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    # NB: called outside autograd's engine, a backward "keeps its graph".
    monkeypatch.setattr(cudagraphs, "backward_keeps_graph", lambda: False)
    w = torch.randn(3, 3)
    fw = GraphedForward(captured(forward), num_user_outputs=1, static_input_indices=[1],
                        device=torch.device("cpu"), name="test")
    bw = graph_backward(
        fw, captured(backward, inputs_of=lambda: fw.static_outputs[1:] + bw.static_tangents),
        num_saved=2, name="test backward")
    return fw, bw, w


def step(fw, bw, w, x):
    loss, h, early = fw([x, w])
    grads = bw([h, early, torch.ones(())])
    return loss, grads


def test_replays_after_warm_up_and_capture_with_fresh_inputs(graphed):
    fw, bw, w = graphed
    for _ in range(4):
        x = torch.randn(2, 3)
        loss, (grad, early) = step(fw, bw, w, x)
        expected_loss, h, expected_early = forward([x, w])
        assert torch.equal(loss, expected_loss)
        assert torch.equal(grad, h.sum(0)) and torch.equal(early, expected_early)
        del grad, early
    assert (fw.calls, fw.replays, bw.replays) == (4, 3, 3)


def test_forward_does_not_replay_over_saved_tensors_still_in_use(graphed):
    fw, bw, w = graphed
    step(fw, bw, w, torch.randn(2, 3))
    first = fw([torch.randn(2, 3), w])  # replayed; its saved tensors are now held
    kept = [t.clone() for t in first]
    second = fw([torch.randn(2, 3), w])  # must not overwrite `first`
    assert fw.replays == 1
    assert all(torch.equal(a, b) for a, b in zip(first, kept))
    grads = bw(first[1:] + [torch.ones(())])  # the replayed forward's backward replays
    assert bw.replays == 1 and torch.equal(grads[1], kept[2])
    del grads
    grads = bw(second[1:] + [torch.ones(())])  # not from a replay: runs without the graph
    assert bw.replays == 1 and torch.equal(grads[1], second[2])


def test_gradients_kept_across_steps_are_never_overwritten(graphed):
    fw, bw, w = graphed
    step(fw, bw, w, torch.randn(2, 3))
    _, (grad, early) = step(fw, bw, w, torch.randn(2, 3))  # replayed; grads held, as .grad is
    assert early.data_ptr() == fw.static_outputs[2].data_ptr()  # no copy: graph memory
    grad_before, early_before = grad.clone(), early.clone()
    replays = fw.replays, bw.replays
    x = torch.randn(2, 3)
    loss, (grad2, early2) = step(fw, bw, w, x)  # accumulation: the held grads must survive
    assert (fw.replays, bw.replays) == replays
    assert torch.equal(grad, grad_before) and torch.equal(early, early_before)
    assert torch.equal(early2, forward([x, w])[2])
    del grad, early, grad2, early2
    step(fw, bw, w, torch.randn(2, 3))  # released (zero_grad(set_to_none=True)): replays again
    assert (fw.replays, bw.replays) == (replays[0] + 1, replays[1] + 1)


def test_a_moved_parameter_is_captured_again(graphed):
    fw, bw, w = graphed
    step(fw, bw, w, torch.randn(2, 3))
    moved = w.clone() * 2
    x = torch.randn(2, 3)
    loss, (grad, early) = step(fw, bw, moved, x)
    expected_loss, h, expected_early = forward([x, moved])
    assert torch.equal(loss, expected_loss) and torch.equal(early, expected_early)


def test_no_graph_replays_over_the_backwards_gradients_still_in_use(graphed):
    # both graphs share one memory pool: a forward replay could overwrite them too
    fw, bw, w = graphed
    step(fw, bw, w, torch.randn(2, 3))
    _, (grad, early) = step(fw, bw, w, torch.randn(2, 3))
    del early  # the early gradient (forward memory) is released, the other one is kept
    kept = grad.clone()
    replays = fw.replays, bw.replays
    x = torch.randn(2, 3)
    _, (grad2, _) = step(fw, bw, w, x)
    assert (fw.replays, bw.replays) == replays
    assert torch.equal(grad, kept) and torch.equal(grad2, forward([x, w])[1].sum(0))
    del grad, grad2
    step(fw, bw, w, torch.randn(2, 3))
    assert (fw.replays, bw.replays) == (replays[0] + 1, replays[1] + 1)


def replaying(fw, bw, w):
    """Warm up and capture both graphs; the replay counts so far."""
    step(fw, bw, w, torch.randn(2, 3))
    step(fw, bw, w, torch.randn(2, 3))
    return fw.replays, bw.replays


def test_a_backward_that_keeps_its_graph_runs_without_replay(graphed, monkeypatch):
    # the backward graph scales early gradients in place: a second backward
    # over the same saved tensors must not see them scaled
    fw, bw, w = graphed
    replays = replaying(fw, bw, w)
    monkeypatch.setattr(cudagraphs, "backward_keeps_graph", lambda: True)
    x = torch.randn(2, 3)
    _, (grad, early) = step(fw, bw, w, x)
    assert (fw.replays, bw.replays) == (replays[0] + 1, replays[1])
    assert torch.equal(early, forward([x, w])[2])


def test_inside_someone_elses_capture_the_program_runs_as_is(graphed, monkeypatch):
    # a whole-step CUDA graph taken by the user captures the compiled program itself
    fw, bw, w = graphed
    replays = replaying(fw, bw, w)
    monkeypatch.setattr(cudagraphs, "stream_capturing", lambda: True)
    x = torch.randn(2, 3)
    loss, (grad, early) = step(fw, bw, w, x)
    assert (fw.replays, bw.replays) == replays
    assert torch.equal(loss, forward([x, w])[0]) and torch.equal(early, forward([x, w])[2])


def test_every_reason_a_call_runs_without_its_graph(graphed, monkeypatch):
    """The exits of the replay state machine, one by one (`Unreplayed`)."""
    fw, bw, w = graphed
    x = torch.randn(2, 3)
    fw.calls = 0
    fw.calls += 1
    assert fw.unreplayed() is Unreplayed.WARM_UP  # a first call
    replaying(fw, bw, w)
    assert fw.unreplayed() is None
    out = fw([x, w])  # replayed: its saved tensors are held now
    assert fw.unreplayed() is Unreplayed.OUTPUTS_IN_USE
    assert bw.unreplayed(out[1:] + [torch.ones(())]) is None
    grads = bw(out[1:] + [torch.ones(())])
    del out
    assert fw.unreplayed() is Unreplayed.OUTPUTS_IN_USE  # the early grad aliases forward memory
    other = [torch.randn(2, 3), torch.randn(3, 3), torch.ones(())]
    assert bw.unreplayed(other) is Unreplayed.NOT_AFTER_A_REPLAY
    del grads
    assert fw.unreplayed() is None
    out = fw([x, w])
    monkeypatch.setattr(cudagraphs, "backward_keeps_graph", lambda: True)
    assert bw.unreplayed(out[1:] + [torch.ones(())]) is Unreplayed.KEEPS_GRAPH
    monkeypatch.setattr(cudagraphs, "backward_keeps_graph", lambda: False)
    grads = bw(out[1:] + [torch.ones(())])
    del out
    out = fw([x, w])  # not replayed: grads held; its saved tensors are not a replay's
    assert bw.unreplayed(out[1:] + [torch.ones(())]) is Unreplayed.NOT_AFTER_A_REPLAY
    monkeypatch.setattr(cudagraphs, "stream_capturing", lambda: True)
    assert fw.unreplayed() is Unreplayed.INSIDE_CAPTURE
    assert bw.unreplayed(out[1:] + [torch.ones(())]) is Unreplayed.INSIDE_CAPTURE
    monkeypatch.setattr(cudagraphs, "stream_capturing", lambda: False)
    fw.disabled_reason, bw.disabled_reason = "capture failed: test", "capture failed: test"
    assert fw.unreplayed() is Unreplayed.CAPTURE_FAILED
    assert bw.unreplayed(out[1:] + [torch.ones(())]) is Unreplayed.CAPTURE_FAILED
    del grads


def test_a_program_that_left_its_graph_end_blocks_to_the_backward_still_replays(graphed):
    """Disarmed (`erase_fx.emit.graph_end`), a program's forwards run without the graph
    leave those blocks to the backward; its replays run them as captured: a disarm never
    costs the forward its graph."""
    import types

    fw, bw, w = graphed
    fw.fn.graph_end = types.SimpleNamespace(armed=False)
    for _ in range(3):
        x = torch.randn(2, 3)
        loss, (grad, early) = step(fw, bw, w, x)
        expected_loss, h, expected_early = forward([x, w])
        assert torch.equal(loss, expected_loss) and torch.equal(early, expected_early)
        del grad, early
    assert (fw.calls, fw.replays) == (3, 2)


def test_a_backwards_gradients_still_held_block_its_replay(graphed):
    # defensive: the forward does not replay over them either, so this is
    # reached only by a backward over the last replay's saved tensors
    fw, bw, w = graphed
    replaying(fw, bw, w)
    out = fw([torch.randn(2, 3), w])
    grad, early = bw(out[1:] + [torch.ones(())])  # replayed: grad lives in graph memory
    saved = [t.detach() for t in fw.saved_outputs]  # the last replay's saved tensors
    assert bw.unreplayed(saved + [torch.ones(())]) is Unreplayed.GRADIENTS_IN_USE
    del grad
    assert bw.unreplayed(saved + [torch.ones(())]) is None


def test_which_forwards_are_replayed_from_a_graph(caplog, monkeypatch):
    """erase_fx.emit.cudagraphs.graph_forward: the policy, on fake CUDA tensors."""
    import logging
    import types

    from torch._subclasses.fake_tensor import FakeTensorMode

    from erase_fx.emit.cudagraphs import graph_forward

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        on_gpu = [torch.empty(2, 3, device="cuda")]
    shape_env = torch.fx.experimental.symbolic_shapes.ShapeEnv()
    with FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True):
        dynamic = [torch.empty(shape_env.create_unbacked_symint(), device="cuda")]
    metadata = types.SimpleNamespace(num_forward_returns=1, static_input_indices=[0])
    fn = lambda args: args  # noqa: E731

    def graphed(inputs, **kwargs):
        options = dict(cudagraphs=None, fw_metadata=metadata, name="g")
        return graph_forward(fn, inputs, **{**options, **kwargs})

    backend = "native"
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: backend)
    assert isinstance(graphed(on_gpu), GraphedForward)
    assert graphed(on_gpu).static_input_indices == [0]
    assert graphed([torch.empty(2)]) is None  # CPU
    assert graphed(on_gpu, cudagraphs=False) is None
    with caplog.at_level(logging.INFO, "erase_fx"):
        assert graphed(dynamic) is None
        assert graphed(on_gpu, fw_metadata=None) is None
        assert graphed(on_gpu, refusal="it all-reduces in the forward") is None
    reasons = [r.getMessage() for r in caplog.records]
    assert any("dynamic shapes" in m for m in reasons)
    assert any("no AOT forward metadata" in m for m in reasons)
    assert any("all-reduces in the forward" in m for m in reasons)
    # the cudaMallocAsync allocator: never graphs, said at WARNING where graphs were asked for
    backend = "cudaMallocAsync"
    caplog.clear()
    with caplog.at_level(logging.INFO, "erase_fx"):
        assert graphed(on_gpu) is None
        assert graphed(on_gpu, cudagraphs=True) is None
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]
    assert all("cudaMallocAsync" in r.getMessage() for r in caplog.records)
    del mode


def test_a_refusal_is_said_only_where_graphs_could_run(caplog, monkeypatch):
    """`erase_fx.compilation` looks for data-dependent sizes on every forward it compiles
    (before Inductor takes the module over); `graph_forward` says why a forward gets no
    graph only where it could get one: not on CPU, not with ``cudagraphs=False``."""
    import logging
    import types

    from torch._subclasses.fake_tensor import FakeTensorMode

    from erase_fx.emit.cudagraphs import graph_forward

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        on_gpu = [torch.empty(2, 3, device="cuda")]
    metadata = types.SimpleNamespace(num_forward_returns=1, static_input_indices=[])
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    refusal = "data-dependent sizes or values (node nonzero: nonzero)"
    with caplog.at_level(logging.INFO, "erase_fx"):
        for inputs, option in ((on_gpu, False), ([torch.empty(2)], None),
                               ([torch.empty(2)], True)):
            assert graph_forward(lambda args: args, inputs, cudagraphs=option,
                                 fw_metadata=metadata, name="g", refusal=refusal) is None
        assert caplog.records == []
        assert graph_forward(lambda args: args, on_gpu, cudagraphs=None, fw_metadata=metadata,
                             name="g", refusal=refusal) is None
    assert [r.getMessage() for r in caplog.records] == [f"erase_fx g: no CUDA graphs: {refusal}"]
    del mode
