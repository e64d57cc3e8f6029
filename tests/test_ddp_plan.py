"""Early all-reduce without processes: which gradients qualify, and where the program hooks them."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.early_grads import _owns_its_memory, plan_early_grads
from erase_fx.emit import StreamProgram, VirtualStreams, compile_segment
from erase_fx.emit.inner import example_inputs_of
from erase_fx.errors import EraseOptionError
from erase_fx.passes.graph import output_values
from graphs import Chain, Stages, Towers, chain_inputs, real_values

aten = torch.ops.aten
CFG = EraseConfig(inner="aot_eager", streams=2)


def test_plan_takes_each_whole_early_gradient_of_a_chain():
    stages = Stages(Chain(3), chain_inputs(), CFG)
    grads = plan_early_grads(stages.fw, stages.bw, stages.joint.num_fwd_outputs)
    assert sorted({g.block for g in grads}) == [0, 1]  # the last block's backward stays late
    assert [sum(g.block == b for g in grads) for b in (0, 1)] == [8, 8]  # 4 layers x (w, b)
    assert len({g.param for g in grads}) == len(grads)
    outputs = output_values(stages.fw.graph)
    saved = list(stages.bw.graph.find_nodes(op="placeholder"))
    for grad in grads:
        assert grad.result >= stages.joint.num_fwd_outputs
        assert outputs[grad.result].name == saved[grad.saved].name


def test_plan_leaves_gradient_parts_to_ddp():
    """Towers over a shared front: the front's gradient is a sum completed in the backward."""
    stages = Stages(Towers(3), chain_inputs(), CFG)
    grads = plan_early_grads(stages.fw, stages.bw, stages.joint.num_fwd_outputs)
    assert len(grads) == 8  # the two early towers' own parameters; not the front's
    front = {i for i, n in enumerate(stages.fw.graph.find_nodes(op="placeholder"))
             if n.meta["val"].shape in ((16, 16), (16,)) and i < 3}
    assert front and not front & {g.param for g in grads}


def _graph(build):
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.randn(4, 4)
    outs = build(graph, x)
    graph.output(tuple(outs))
    return graph, outs


def test_a_gradient_owns_its_memory_only_if_nothing_else_reads_it():
    graph, (mm, t) = _graph(lambda g, x: (
        (mm := g.call_function(aten.mm.default, (x, x))),
        g.call_function(aten.t.default, (mm,))))
    assert not _owns_its_memory(t)  # mm is returned too: two readers of one memory
    graph, (t,) = _graph(lambda g, x: (g.call_function(
        aten.t.default, (g.call_function(aten.mm.default, (x, x)),)),))
    assert _owns_its_memory(t)  # a view of fresh memory nobody else reads
    graph, (t,) = _graph(lambda g, x: (g.call_function(aten.t.default, (x,)),))
    assert not _owns_its_memory(t)  # a view of an input
    graph, (piece,) = _graph(lambda g, x: (g.call_function(
        operator.getitem, (g.call_function(aten.split.Tensor, (x, 2)), 0)),))
    assert not _owns_its_memory(piece)  # split returns views of its input
    graph, (piece,) = _graph(lambda g, x: (g.call_function(
        operator.getitem, (g.call_function(aten.native_layer_norm.default,
                                           (x, [4], None, None, 1e-5)), 0)),))
    assert _owns_its_memory(piece)  # a fresh output of a multi-output op


def _program(stages, trace):
    segmented = stages.segmented
    compiled = {
        s.name: compile_segment(getattr(segmented.gm, s.name),
                                example_inputs_of(getattr(segmented.gm, s.name)), "aot_eager")
        for s in segmented.segments
    }
    return StreamProgram.build(segmented, compiled, VirtualStreams(trace=trace))


def test_completion_hooks_run_right_after_each_block_and_may_write_its_results():
    stages = Stages(Chain(3), chain_inputs(), CFG)
    grads = plan_early_grads(stages.fw, stages.bw, stages.joint.num_fwd_outputs)
    program = _program(stages, trace=True)
    calls = []

    def begin(inputs):
        calls.append(("begin", len(inputs)))
        return "context"

    def on_block(block):
        def fn(context, values, streams, ops):
            calls.append((block, context, streams))
            ops.run_comm(streams, values, lambda: [v.mul_(2) for v in values])
        return fn

    by_block = {b: tuple(g.result for g in grads if g.block == b) for b in (0, 1)}
    placed = program.add_completion_hooks(begin, [(by_block[b], on_block(b)) for b in (0, 1)])
    assert [hook.streams for hook in placed] == [(1,), (2,)]

    values = real_values(stages.fw)
    args = [values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")]
    expected = list(stages.fw(*args))
    results = program(list(args))
    assert calls == [("begin", len(args)), (0, "context", (1,)), (1, "context", (2,))]
    trace = [entry for entry in program.streams.trace if entry[0] != "record"]
    for stream in (1, 2):  # the block's hook runs right after its side step, mid-forward
        assert trace[trace.index(("comm", (stream,))) - 1] == ("run", stream)
    assert trace.index(("comm", (2,))) < trace.index(("wait", 0, (1, 2)))
    for i, (got, want) in enumerate(zip(results, expected)):
        doubled = any(i in r for r in by_block.values())
        torch.testing.assert_close(got, want * 2 if doubled else want)


def test_several_callers_hook_one_program_each_with_its_context():
    stages = Stages(Chain(3), chain_inputs(), CFG)
    grads = plan_early_grads(stages.fw, stages.bw, stages.joint.num_fwd_outputs)
    program = _program(stages, trace=False)
    calls = []
    last = tuple(g.result for g in grads if g.block == 1)
    for name, context in (("first", "a"), ("off", None), ("second", "b")):
        program.add_completion_hooks(
            lambda inputs, context=context: context,
            [(last, lambda c, values, streams, ops, name=name: calls.append((name, c)))])
    values = real_values(stages.fw)
    program([values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")])
    assert calls == [("first", "a"), ("second", "b")]  # in order; "off" began with None


def test_no_hook_runs_when_begin_returns_none():
    stages = Stages(Chain(3), chain_inputs(), CFG)
    program = _program(stages, trace=True)
    ran = []
    program.add_completion_hooks(lambda inputs: None,
                                 [((len(program.results) - 1,), lambda *a: ran.append(a))])
    values = real_values(stages.fw)
    program([values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")])
    assert ran == []
    assert not any(entry[0] == "comm" for entry in program.streams.trace)


def test_early_allreduce_is_an_option_validated_like_the_others():
    assert EraseConfig().early_allreduce is True
    assert EraseConfig.from_options({"early_allreduce": False}).early_allreduce is False
    with pytest.raises(EraseOptionError, match="early_allreduce"):
        EraseConfig.from_options({"early_allreduce": 1})
