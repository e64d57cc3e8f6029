"""Release planning under CUDA graph capture (erase_fx.emit.release), and the program running it."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from erase_fx.config import EraseConfig, Tuning
from erase_fx.emit import program as program_module
from erase_fx.emit.release import StepIO, plan_captured_releases
from graphs import Chain, StageChain, Stages, attention_inputs, chain_inputs, real_values
from test_program import build

MAIN, SIDE1, SIDE2 = 0, 1, 2


def chain_steps():
    """Main 0 makes slot 2 (block 0's activation) -> side step 1 reads it; main steps 2, 4, 5 follow.

    slots: 0, 1 inputs; 2 made by step 0 on main; 3 made by side step 1 (its loss),
    read by main step 5 (the sum); 4 made by main 2, read by side 3; 5 by main 4; 6 by main 5.
    """
    return [
        StepIO(MAIN, (0,), (2,)),
        StepIO(SIDE1, (2, 1), (3,)),
        StepIO(MAIN, (2,), (4,)),
        StepIO(SIDE2, (4, 1), (7,)),
        StepIO(MAIN, (4,), (5,)),
        StepIO(MAIN, (5, 3, 7), (6,)),
    ]


def test_a_main_tensor_read_by_a_block_is_released_lag_main_steps_later_after_a_wait():
    plan = plan_captured_releases(chain_steps(), num_inputs=2, kept={6}, release_lag=2)
    assert plan.records_event == (False, True, False, True, False, False)
    assert plan.waits_before[4] == (1,)  # the 2nd main step after side step 1
    assert plan.releases_before[4] == (2,)
    assert plan.waits_before[5] == (3,) and plan.releases_before[5] == (4,)


def test_without_a_main_step_late_enough_a_value_is_held_to_the_join():
    plan = plan_captured_releases(chain_steps(), num_inputs=2, kept={6}, release_lag=3)
    # slot 4: read by side step 3, with two main steps after it
    assert all(4 not in r for r in plan.releases_before)
    assert all(4 not in d for d in plan.drops_after)
    assert not plan.records_event[3]


def test_lag_one_releases_at_the_next_main_step_after_every_main_read():
    plan = plan_captured_releases(chain_steps(), num_inputs=2, kept={6}, release_lag=1)
    # slot 2 is also read by main step 2: released at the first main step after that read
    assert plan.releases_before[4] == (2,)
    assert plan.waits_before[5] == (3,) and plan.releases_before[5] == (4,)


def test_same_stream_values_drop_after_their_last_reader_and_side_values_read_by_main_are_held():
    plan = plan_captured_releases(chain_steps(), num_inputs=2, kept={6}, release_lag=2)
    assert plan.drops_after[5] == (5,)  # main made it, main read it
    held = {3, 7}  # side-made losses the main sum reads
    assert not held & {s for d in plan.drops_after for s in d}
    assert not held & {s for r in plan.releases_before for s in r}
    assert not {0, 1, 6} & {s for d in plan.drops_after for s in d}  # inputs, outputs


def test_a_lag_below_one_is_refused():
    with pytest.raises(ValueError, match="release_lag"):
        plan_captured_releases(chain_steps(), num_inputs=2, kept=set(), release_lag=0)


def test_a_captured_run_waits_releases_and_computes_the_same_values(monkeypatch):
    stages = Stages(Chain(5), chain_inputs(),
                    EraseConfig(inner="aot_eager", streams=2, tuning=Tuning(stages_on_side=False)))
    values = real_values(stages.fw)
    args = [values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")]
    plain, _ = build(stages, trace=False)
    expected = plain(list(args))

    monkeypatch.setattr(program_module, "stream_capturing", lambda: True)
    program, streams = build(stages, release_lag=2)
    got = program(list(args))
    for a, b in zip(expected, got):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    kinds = [entry[0] for entry in streams.trace]
    assert "record" in kinds and "wait_events" in kinds
    # every wait comes after the event it waits for was recorded
    recorded = 0
    for entry in streams.trace:
        if entry[0] == "record":
            recorded += 1
        elif entry[0] == "wait_events":
            assert entry[1] == MAIN and recorded >= len(entry[2])
    assert any(program.capture_plan_for(2).releases_before)


def _slots_alive_before_each_launch(monkeypatch, cfg, model=None, inputs=None):
    stages = Stages(model or Chain(4), inputs or chain_inputs(), cfg)
    values = real_values(stages.fw)
    args = [values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")]
    monkeypatch.setattr(program_module, "stream_capturing", lambda: True)
    program, streams = build(stages)
    alive = []
    program.aliases = set()  # outputs that are views of a live value (a weight, a stage output)
    program.shared = {}  # step -> its outputs that share memory the step allocated
    real_launch = program._launch

    def launch(k, step, env, events, streams, record=False):
        alive.append({i for i, v in enumerate(env) if v is not None})
        live = {v.untyped_storage().data_ptr() for v in env if isinstance(v, torch.Tensor)}
        real_launch(k, step, env, events, streams, record)
        made = [slot for slot in step.outputs if slot >= 0 and isinstance(env[slot], torch.Tensor)]
        program.aliases |= {slot for slot in made if env[slot].untyped_storage().data_ptr() in live}
        fresh = [slot for slot in made if slot not in program.aliases]
        ptr = {slot: env[slot].untyped_storage().data_ptr() for slot in fresh}
        program.shared[k] = {slot for slot in fresh
                             if sum(p == ptr[slot] for p in ptr.values()) > 1}

    monkeypatch.setattr(program, "_launch", launch)
    program(list(args))
    return program, streams, alive


def test_by_default_a_captured_run_holds_what_crosses_streams_to_the_join(monkeypatch):
    """Classic layout: a block's activations are made on the main stream and read on its side
    stream, so they live to the join; nothing waits to release them."""
    program, streams, alive = _slots_alive_before_each_launch(
        monkeypatch, EraseConfig(inner="aot_eager", streams=2, tuning=Tuning(stages_on_side=False)))
    assert not any(program.capture_plan_for(None).releases_before)
    assert not any(kind == "wait_events" for kind, *_ in streams.trace)
    cross = {slot for k, step in enumerate(program.steps) if step.stream == MAIN
             for slot in step.outputs
             if any(s.stream != MAIN and slot in s.inputs for s in program.steps)}
    assert cross
    assert all(cross & set(program.steps[k].outputs) <= later
               for k in range(len(program.steps)) for later in alive[k + 1:])


def test_with_stages_on_side_a_blocks_activations_die_with_its_backward_under_capture(
        monkeypatch):
    """Stages on side streams: block b's activations are made and read on b's stream; under
    capture they are dropped right after block b's step (the stream orders the reuse),
    before the next block's stage on that stream runs."""
    program, streams, alive = _slots_alive_before_each_launch(
        monkeypatch, EraseConfig(inner="aot_eager", streams=2, tuning=Tuning(stages_on_side=True)))
    assert not any(kind == "wait_events" for kind, *_ in streams.trace)
    steps = program.steps
    for k, step in enumerate(steps):
        if "_stage_" not in step.name:
            continue
        block_step = k + 1  # the block's head and backward, on the same stream
        assert steps[block_step].stream == step.stream
        # NB: a view of a live value (a weight's transpose) lives as long as that value
        activations = {slot for slot in step.outputs if slot >= 0
                       and slot not in program.aliases
                       and all(s.stream == step.stream for s in steps if slot in s.inputs)}
        assert len(activations) >= 4, step.name
        assert program.capture_plan_for(None).drops_after[block_step]
        for later in alive[block_step + 1:]:
            assert not activations & later, step.name


class FusedQKVStage(nn.Module):
    """Attention whose q, k and v are views of one projection's output (a GPT block's shape)."""

    def __init__(self, d: int = 16, heads: int = 2, classes: int = 5):
        super().__init__()
        self.heads = heads
        self.qkv, self.head = nn.Linear(d, 3 * d), nn.Linear(d, classes)

    def forward(self, x, y):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + out.transpose(1, 2).reshape(b, t, d)
        return h, F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def test_outputs_of_one_step_that_share_its_memory_are_freed_under_capture(monkeypatch):
    """q, k and v of a fused projection are three outputs of a block's stage sharing one
    allocation of that step: each is dropped after its last reader on the block's stream,
    not held to the join as a view of someone else's memory would be."""
    program, _, alive = _slots_alive_before_each_launch(
        monkeypatch, EraseConfig(inner="aot_eager", streams=2, tuning=Tuning(stages_on_side=True)),
        StageChain([FusedQKVStage() for _ in range(4)]), attention_inputs())
    steps = program.steps
    checked = 0
    for k, step in enumerate(steps):
        shared = {slot for slot in program.shared.get(k, ())
                  if all(s.stream == step.stream for s in steps if slot in s.inputs)}
        if "_stage_" not in step.name or not shared:
            continue
        last_reader = max(j for j, s in enumerate(steps) if shared & set(s.inputs))
        assert steps[last_reader].stream == step.stream
        for later in alive[last_reader + 1:]:
            assert not shared & later, (step.name, shared & later)
        checked += 1
    assert checked >= 2  # the early stages' q, k and v (the last stage is the main stream's)


# -- release_lag="record_stream": the allocator orders the reuse (issue 39's candidate) -------

def test_record_stream_is_a_release_lag_and_near_misses_are_refused():
    assert Tuning(release_lag="record_stream").release_lag == "record_stream"
    with pytest.raises(Exception, match="'auto', 'record_stream' or None"):
        Tuning(release_lag="record-stream")
    with pytest.raises(Exception, match="an integer >= 1, 'auto' or None"):
        Tuning(side_cuda_streams="record_stream")


def test_with_record_stream_a_captured_run_marks_each_use_and_drops_after_the_last_reader(
        monkeypatch, caplog):
    """Stages on the main stream: a block's activations cross to its side stream. Under
    capture with release_lag="record_stream" they are dropped after their last reader, as
    outside capture (the plan would hold them to the join), every step's inputs are marked
    as used by its stream, no wait is added, and the values are those of a plain run."""
    stages = Stages(Chain(4), chain_inputs(),
                    EraseConfig(inner="aot_eager", streams=2, tuning=Tuning(stages_on_side=False)))
    values = real_values(stages.fw)
    args = [values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")]
    plain, _ = build(stages, trace=False)
    expected = plain(list(args))

    monkeypatch.setattr(program_module, "stream_capturing", lambda: True)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    program, streams = build(stages, release_lag="record_stream")
    alive = []
    launch = program._launch

    def watching(k, step, env, events, stream_ops, record=False):
        alive.append({i for i, v in enumerate(env) if v is not None})
        launch(k, step, env, events, stream_ops, record)

    monkeypatch.setattr(program, "_launch", watching)
    with caplog.at_level("WARNING", logger="erase_fx.emit.program"):
        got = program(list(args))
    for a, b in zip(expected, got):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    runs = [i for i, entry in enumerate(streams.trace) if entry[0] == "run"]
    assert all(streams.trace[i - 1] == ("mark", streams.trace[i][1]) for i in runs)
    assert not any(entry[0] == "wait_events" for entry in streams.trace)
    for k, step in enumerate(program.steps):
        for later in alive[k + 1:]:
            assert not set(step.frees) & later, step.name
    crossing = {slot for step in program.steps for slot in step.frees
                if any(s.stream != MAIN for s in program.steps if slot in s.inputs)
                and any(s.stream == MAIN and slot in s.outputs for s in program.steps)}
    assert crossing  # activations the plan would have held to the join
    assert "graph_capture_record_stream_reuse:True" in caplog.text


def test_the_allocator_setting_is_read_from_torch_or_the_environment(monkeypatch):
    from erase_fx.emit import streams

    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF",
                       "expandable_segments:False, graph_capture_record_stream_reuse:True")
    assert streams.record_stream_reuse_on()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "graph_capture_record_stream_reuse:False")
    assert not streams.record_stream_reuse_on()
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings",
                        lambda: "graph_capture_record_stream_reuse:True", raising=False)
    assert streams.record_stream_reuse_on()
