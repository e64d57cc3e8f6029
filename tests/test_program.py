"""StreamProgram on virtual streams: launch order, the sync protocol, freed inputs, values."""
import torch

from erase_fx.config import EraseConfig, Tuning
from erase_fx.emit import StreamProgram, VirtualStreams, compile_segment
from erase_fx.emit.inner import example_inputs_of
from graphs import Chain, Stages, assert_outputs_close, chain_inputs, real_values


def build(stages, trace=True, release_lag=None, side_cuda_streams=None):
    segmented = stages.segmented
    compiled = {
        s.name: compile_segment(getattr(segmented.gm, s.name),
                                example_inputs_of(getattr(segmented.gm, s.name)), "aot_eager")
        for s in segmented.segments
    }
    streams = VirtualStreams(trace=trace)
    return StreamProgram.build(segmented, compiled, streams, release_lag,
                               side_cuda_streams), streams


def run_traced(cfg):
    stages = Stages(Chain(3), chain_inputs(), cfg)
    program, streams = build(stages)
    values = real_values(stages.fw)
    args = [values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")]
    program(list(args))
    return streams.trace


def test_program_forks_each_side_step_waits_before_the_sum_and_joins_at_the_end():
    trace = run_traced(EraseConfig(inner="aot_eager", streams=2,
                                   tuning=Tuning(stages_on_side=False)))
    assert trace == [
        ("fork", (1, 2)),
        ("run", 0), ("record", 0), ("wait", 1, (0,)), ("run", 1), ("record", 1),
        ("run", 0), ("record", 0), ("wait", 2, (0,)), ("run", 2), ("record", 2),
        ("run", 0),
        ("wait", 0, (1, 2)), ("run", 0),  # the loss sum, after the blocks' backwards
        ("join", (1, 2)),
    ]


def test_with_stages_on_side_each_stage_waits_only_for_the_stage_before_it():
    trace = run_traced(EraseConfig(inner="aot_eager", streams=2,
                                   tuning=Tuning(stages_on_side=True,
                                                 recompute_boundary_values=False)))
    assert trace == [
        ("fork", (1, 2)),
        ("run", 1), ("record", 1),  # stage 0: stage 1 and the main stream read its output
        ("run", 1), ("record", 1),  # block 0: the loss sum reads its loss
        ("wait", 2, (1,)), ("run", 2), ("record", 2),  # stage 1, once stage 0's event fired
        ("run", 2), ("record", 2),  # block 1: its own constants (merged before the cloning)
        ("wait", 0, (2,)), ("run", 0),  # the last stage: after stage 1, not block 1
        ("wait", 0, (1, 2)), ("run", 0),
        ("join", (1, 2)),
    ]


def test_a_block_that_recomputes_stage_0s_constant_no_longer_waits_for_it():
    """With recompute_boundary_values (the default), block 1 makes the constant itself (it
    read it from stage 0 above): one wait fewer, the rest of the schedule as it was."""
    trace = run_traced(EraseConfig(inner="aot_eager", streams=2,
                                   tuning=Tuning(stages_on_side=True,
                                                 recompute_boundary_values=True)))
    assert trace == [
        ("fork", (1, 2)),
        ("run", 1), ("record", 1),
        ("run", 1), ("record", 1),
        ("wait", 2, (1,)), ("run", 2), ("record", 2),
        ("run", 2), ("record", 2),  # block 1: no wait for stage 0
        ("wait", 0, (2,)), ("run", 0),
        ("wait", 0, (1, 2)), ("run", 0),
        ("join", (1, 2)),
    ]


def test_program_returns_the_forward_values_and_consumes_its_inputs():
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager"))
    program, _ = build(stages, trace=False)
    for _ in range(2):
        values = real_values(stages.fw)
        args = [values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")]
        expected = list(stages.fw(*args))
        boxed = list(args)
        assert_outputs_close(program(boxed), expected)
        assert boxed == []  # boxed convention: the program owns and frees its inputs


def test_slots_are_freed_after_their_last_reader():
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager"))
    program, _ = build(stages, trace=False)
    kept = {value for kind, value in program.results if kind == "slot"}
    freed = [slot for step in program.steps for slot in step.frees]
    assert len(freed) == len(set(freed))
    assert not kept & set(freed)
    assert freed  # activations read only by a block die with its step
    assert program.side_results  # early grads come back from side streams
    assert torch.is_tensor(stages.fw.graph.find_nodes(op="placeholder")[0].meta["val"])


def test_the_memory_plans_sizes_are_measured_at_the_first_plan_not_at_build(monkeypatch):
    from erase_fx.emit import program as program_module

    measured = []
    original = program_module.segment_temporaries
    monkeypatch.setattr(program_module, "segment_temporaries",
                        lambda gm: measured.append(gm) or original(gm))
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager"))
    program, _ = build(stages, trace=False)
    assert measured == []  # compiling pays nothing for a plan no one asks for
    plan = program.memory_plan()
    assert len(measured) == len(program.steps) and plan.buffers
    assert program.memory_plan(temporaries=True).buffers and len(measured) == len(program.steps)
