"""The memory plan on the bench configs' programs (bench.plan_peaks), checked against a run.

`bench.held_to_join` runs a program through the captured path's release plan
with real tensors and measures each stream's high-water mark: the plan's
``today`` prediction, made from the FX meta alone, must give the same bytes.
And no release of today's plan may race, on any bench config, release lag or
folding.
"""
import itertools

import pytest
import torch

from bench import held_to_join, plan_peaks
from bench.dump_programs import DEFAULT_CONFIGS

CPU = torch.device("cpu")


@pytest.mark.parametrize("text", ["gpt:2:64:32:3", "mlp:32:64:128:4"])
@pytest.mark.parametrize("on_side", [False, True])
@pytest.mark.parametrize("width", [None, 1])
def test_todays_prediction_is_each_streams_high_water_mark_in_a_captured_run(
        text, on_side, width):
    with plan_peaks.programs_run() as programs:
        measured = held_to_join.measure(text, CPU, "aot_eager", on_side, 2, width)
    assert len(programs) == 1
    plan = programs[0].memory_plan(None, width)
    assert plan.today.by_stream == measured.stream_peaks
    assert plan.races == ()


@pytest.fixture(scope="module")
def bench_programs():
    """Each bench config's forward program, stages on side streams and on the main stream."""
    return {(text, on_side): plan_peaks.programs_of(text, CPU, "aot_eager", on_side)
            for text, on_side in itertools.product(DEFAULT_CONFIGS, (True, False))}


def test_no_release_of_todays_plan_races_on_the_bench_configs(bench_programs):
    checked = 0
    for (text, on_side), programs in bench_programs.items():
        assert programs, text
        for program, lag, width in itertools.product(programs, plan_peaks.LAGS,
                                                     plan_peaks.WIDTHS):
            plan = program.memory_plan(lag, width)
            assert plan.races == (), (text, on_side, lag, width, [str(r) for r in plan.races])
            checked += sum(r < len(program.steps) for r in plan.released_today)
    assert checked > 100  # releases before the join were checked, not only held values


def test_the_one_pool_needs_no_more_than_todays_pools_on_the_bench_configs(bench_programs):
    """Without a release lag (no wait of its own), today's pools hold every set of values
    whose lifetimes overlap: the one pool's peak is at most theirs."""
    for (text, on_side), programs in bench_programs.items():
        for program in programs:
            plan = program.memory_plan()
            assert plan.one_pool.total <= plan.record_stream.total <= plan.today.total, text
            assert plan.one_pool.total > 0


def test_the_race_check_finds_a_release_whose_wait_is_left_out(bench_programs):
    """With ``release_lag=1`` and stages on the main stream, the main stream waits for a
    block's side stream before it frees the block's activations; without those waits the
    check must find the races."""
    import dataclasses

    from erase_fx.emit.memory_plan import plan_memory
    from erase_fx.emit.release import StepIO

    program = bench_programs[("gpt:2:64:32:3", False)][0]
    capture = program.capture_plan_for(1)
    assert any(capture.releases_before)
    unwaited = dataclasses.replace(capture, waits_before=tuple(() for _ in capture.waits_before))
    steps = [StepIO(s.stream, s.inputs, s.outputs, s.waits) for s in program.steps]
    kept = {slot for kind, slot in program.results if kind == "slot"}
    races = plan_memory(steps, program.memory, kept, unwaited).races
    assert races and all(program.steps[r.use].stream != 0 for r in races)


def test_the_printout_has_a_row_per_config_and_stages_and_updates_its_table(tmp_path, capsys):
    out = tmp_path / "plan_peaks.md"
    assert plan_peaks.main(["--configs", "mlp:32:64:128:4", "--inner", "aot_eager",
                            "--stages", "side,main", "--streams", "2", "--out", str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| mlp:32:64:128:4")]
    assert len(rows) == 2
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    row = dict(zip(plan_peaks.COLUMNS, cells))
    assert row["stages"] == "side" and row["races"] == "0"
    assert float(row["one pool MiB"]) <= float(row["today MiB"])
    assert len(row["today by stream"].split(", ")) == 3  # main and two side streams
    assert "mlp:32:64:128:4" in out.read_text()


def test_each_blocks_segment_holds_its_heads_temporaries_on_its_stream(bench_programs):
    """gpt with stages on side streams: each block's segment (head, loss, early backward)
    holds its logits and their gradient inside; counted, they raise its stream's peak."""
    program = bench_programs[("gpt:2:64:32:3", True)][0]
    blocks = [k for k, s in enumerate(program.steps) if "_block_" in s.name
              and "_stage_" not in s.name]
    logits = 2 * 32 * 8192 * 4  # batch x tokens x vocab, fp32 on CPU without autocast
    assert blocks and all(program.temporaries[k] >= logits for k in blocks)
    values, inside = program.memory_plan(), program.memory_plan(temporaries=True)
    for stream in {program.steps[k].stream for k in blocks}:
        assert inside.today.by_stream[stream] >= values.today.by_stream[stream] + logits
    assert values.one_pool.total < inside.one_pool.total <= inside.today.total
    assert inside.races == ()
