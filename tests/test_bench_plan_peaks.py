"""The memory plan on the bench configs' programs (bench.plan_peaks), checked against a run.

`bench.held_to_join` runs a program through the captured path's release plan
with real tensors and measures each stream's high-water mark: the plan's
``today`` prediction, made from the FX meta alone, must give the same bytes.
And no release of today's plan may race, on any bench config, release lag or
folding.
"""
import itertools
from pathlib import Path

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


def test_the_device_parts_predict_then_measure_with_the_allocator_setting(tmp_path):
    """bench/device_run.sh plan-a to plan-d, with a python3 that prints its arguments and the
    allocator setting instead of running: the prediction on the four configs, the race stress
    and the A/B rows under graph_capture_record_stream_reuse."""
    import os
    import subprocess

    from bench.harness import Variant
    from bench.models import parse_config

    root = Path(__file__).resolve().parent.parent
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\necho "python3 $* [${PYTORCH_ALLOC_CONF:-}]"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTORCH_ALLOC_CONF")}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    calls = {}
    for part in ("plan-a", "plan-b", "plan-c", "plan-d"):
        result = subprocess.run(["bash", "bench/device_run.sh", part], capture_output=True,
                                text=True, env=env, cwd=root)
        assert result.returncode == 0, result.stderr
        calls[part] = [line for line in result.stdout.splitlines() if "-m bench." in line
                       and "pip" not in line]
    configs = "gpt:16:384:256:8,ctr:16384:1024:2048:6,mlp:128:2000:2000:4,tv-resnet18-dgl:256:32"
    [predict] = calls["plan-a"]
    assert f"bench.plan_peaks --device cuda --configs {configs}" in predict
    assert predict.endswith("[]")  # the prediction needs no allocator setting
    [stress] = calls["plan-b"]
    assert "--checks record-stream" in stress
    assert stress.endswith("[graph_capture_record_stream_reuse:True]")
    measured = []
    for part in ("plan-c", "plan-d"):
        [run] = calls[part]
        assert run.startswith("python3 -m bench.run") and run.endswith(
            "[graph_capture_record_stream_reuse:True]")
        words = run.split()
        measured += words[words.index("--configs") + 1].split(",")
        variants = words[words.index("--variants") + 1].split(",")
        assert [str(Variant.parse(v)) for v in variants] == [
            "inductor+step", "erase+step", "erase+step/release-lag=record-stream"]
    assert measured == configs.split(",")
    assert all(parse_config(text) for text in measured)
