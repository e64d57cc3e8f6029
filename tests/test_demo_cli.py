"""End to end: the demo (``python -m erase_fx.demo``) and the ``erase-fx`` command, on CPU.

The autouse fixture of conftest.py resets Dynamo before each test.
"""
import json
import os

import pytest
import torch

from erase_fx import cli, demo
from erase_fx.report_text import TABLE_KEY

FF_STAGES = demo.FFSizes().stages


@pytest.mark.parametrize("model", ["ff", "ctr"])
def test_demo_trains_and_matches_eager(model, capsys):
    code = demo.main(["--model", model, "--steps", "20", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "3 early blocks" in out
    assert "left in the backward" in out
    assert "step-1 gradients, erase vs eager: max abs diff" in out
    assert "(tolerance 1e-05): PASS" in out
    assert (f"final parameters (after 20 steps), erase vs eager: max abs diff 0, max rel diff 0 "
            f"(tolerance {demo.PARAM_RTOL:g}): PASS") in out
    assert "PASS: all first-step gradients equal the reference's" in out
    assert "PASS: all final parameters equal eager's" in out


def test_demo_prints_the_table_key_once_and_numbers_graphs_per_model(capsys):
    code = demo.main(["--steps", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count(TABLE_KEY) == 1
    assert out.index(TABLE_KEY) < out.index("== ctr:")  # under the first model's table
    headings = [line.split(":")[0] for line in out.splitlines() if line.startswith("graph ")]
    assert headings == ["graph 0", "graph 0"]  # one per model, each model's first


def test_demo_words_say_what_it_prints(capsys):
    demo.main(["--model", "ff", "--steps", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "schedule" not in out  # it prints a table of blocks, not the schedule
    assert "the demo lists the early blocks found and checks exactness" in out


def test_the_loss_curve_is_a_running_mean_and_its_header_says_so(monkeypatch):
    rows = []
    monkeypatch.setattr(demo, "curve_row", lambda step, eager, erase: rows.append(
        (step, eager, erase)) or "row")
    lines = []
    workload = demo.ff_workload(torch.device("cpu"), seed=0)
    result = demo.run_workload(workload, 20, "aot_eager", torch.device("cpu"), 0, lines.append)
    assert "training loss, running mean over the last 2 steps" in "\n".join(lines)
    losses = result.eager.losses
    assert rows == [(step, pytest.approx((losses[step - 2] + losses[step - 1]) / 2),
                     pytest.approx((result.erase.losses[step - 2] + result.erase.losses[step - 1])
                                   / 2))
                    for step in range(2, 21, 2)]


def test_curve_window_and_running_mean():
    assert demo.curve_window(200) == 200 // demo.CURVE_ROWS
    assert demo.curve_window(3) == 1
    assert demo.running_mean([1.0, 2.0, 3.0, 5.0], 2) == 4.0
    assert demo.running_mean([2.0], 4) == 2.0  # fewer losses than the window
    assert demo.curve_header(20)[0].startswith("training loss, running mean over the last 20 "
                                               "steps")


def test_a_final_parameter_difference_fails_the_demo(monkeypatch, capsys):
    def off_by_one(eager, erase, tolerance):
        return demo.Difference(1.0, 1.0, "stages.0.head.weight", tolerance)

    monkeypatch.setattr(demo, "compare_parameters", off_by_one)
    code = demo.main(["--model", "ff", "--steps", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 1
    assert (f"final parameters (after 2 steps), erase vs eager: max abs diff 1, max rel diff 1 "
            f"(tolerance {demo.PARAM_RTOL:g}): FAIL (worst: stages.0.head.weight)") in out
    assert "FAIL: the final parameters of ff differ from eager's" in out
    assert "PASS: all first-step gradients equal the reference's" in out


def test_final_parameters_are_compared_and_not_judged_with_inductor():
    eager, erase = demo.ff_factory()[0], demo.ff_factory()[0]
    assert demo.compare_parameters(eager, erase).max_rel == 0.0
    with torch.no_grad():
        erase.stages[2].head.bias[0] += 1.0
    diff = demo.compare_parameters(eager, erase)
    assert not diff.ok and diff.verdict == "FAIL" and diff.worst_param == "stages.2.head.bias"
    assert demo.final_parameter_tolerance("aot_eager") == demo.PARAM_RTOL
    assert demo.final_parameter_tolerance("inductor") is None
    not_judged = demo.compare_parameters(eager, erase, tolerance=None)
    assert not_judged.ok and not_judged.verdict == "not judged"
    line = demo.describe_difference("final parameters", not_judged, "eager")
    assert line.endswith(f": not judged ({demo.NOT_JUDGED_WHY})")


def test_demo_quiet_prints_only_the_summary(capsys):
    code = demo.main(["--model", "ff", "--steps", "6", "--device", "cpu", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    assert "early blocks" in out  # the summary's column
    assert "compiling" not in out


def test_cli_demo_forwards_its_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    assert "--steps" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["demo", "explain", "profile"])
def test_each_subcommands_usage_names_the_erase_fx_command(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert capsys.readouterr().out.startswith(f"usage: erase-fx {command} ")


def test_the_demo_run_as_a_module_names_itself_so(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m erase_fx.demo ")


def test_explain_ff_finds_one_early_block_per_stage_but_the_last(capsys):
    code = cli.main(["explain", "erase_fx.demo:ff_factory"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"{FF_STAGES - 1} early blocks" in out
    assert "last_block" in out
    assert "of the backward FLOPs run early" in out


def test_explain_dump_writes_the_dump_and_the_table_shows_each_blocks_share(tmp_path, capsys):
    code = cli.main(["explain", "erase_fx.demo:ff_factory", "--dump", str(tmp_path / "dump")])
    out = capsys.readouterr().out
    assert code == 0
    (graph,) = list((tmp_path / "dump").iterdir())
    assert (graph / "report.json").exists() and (graph / "06_assign_streams.py").exists()
    assert f"dump written to {graph}{os.sep}" in out
    header = next(line for line in out.splitlines() if line.strip().startswith("block"))
    assert header.split() == ["block", "stream", "#params", "params", "ready", "after", "nodes",
                              "bwd", "FLOPs", "share", "of", "bwd"]
    block_rows = [line.split() for line in out.splitlines() if line.startswith("  0  ")]
    assert block_rows and block_rows[0][-1] == f"{100 // FF_STAGES}%"
    assert "share of bwd: of the whole backward's FLOPs" in out


def test_explain_json_with_dump_keeps_stdout_json(tmp_path, capsys):
    code = cli.main(["explain", "erase_fx.demo:ff_factory", "--json", "--dump", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0
    assert len(json.loads(captured.out)) == 1
    assert "dump written to" in captured.err


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda tmp: ["--dump", str(tmp / "a_file")], "exists and is not a folder"),
        (lambda tmp: ["--dump", str(tmp / "x"), "--options", '{"dump_dir": "%s"}' % (tmp / "y")],
         "disagree"),
    ],
)
def test_explain_bad_dump_exits_2(make_args, message, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    code = cli.main(["explain", "erase_fx.demo:ff_factory", *make_args(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_explain_json_lists_the_reports(capsys):
    code = cli.main(["explain", "erase_fx.demo:ff_factory", "--json", "--options",
                     '{"streams": 2}'])
    reports = json.loads(capsys.readouterr().out)
    assert code == 0
    (report,) = reports
    assert [b["stream"] for b in report["blocks"]] == [1, 2, 1]
    assert [r["reason"] for r in report["rejected"]] == ["last_block"]
    assert report["fallback_reason"] is None
    assert report["streams"] == 2


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nosuchmodule:f", "cannot import module 'nosuchmodule'"),
        ("erase_fx.demo:nosuchfactory", "has no attribute 'nosuchfactory'"),
        ("erase_fx.demo", "expected module:factory"),
    ],
)
def test_explain_bad_spec_exits_2(spec, message, capsys):
    code = cli.main(["explain", spec])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "module, body, message",
    [
        ("factory_raises", "def factory():\n    raise ValueError('no data')\n",
         "raised ValueError: no data"),
        ("factory_returns_4", "def factory():\n    return 1, 2, 3, 4\n",
         "returned a tuple of length 4"),
        ("factory_returns_tensor",
         "import torch\ndef factory():\n    return torch.nn.Linear(2, 2), torch.ones(2)\n",
         "expected a tuple"),
        ("factory_not_callable", "factory = 3\n", "factory_not_callable:factory is not callable"),
        ("factory_needs_args", "def factory(batch):\n    return batch\n",
         "factory_needs_args:factory() raised TypeError"),
        ("factory_bad_model", "def factory():\n    return 'model', (1,)\n",
         "returned a model that is not callable: a str"),
        ("factory_import_fails", "import no_such_dependency\ndef factory():\n    pass\n",
         "cannot import module 'factory_import_fails': ModuleNotFoundError"),
    ],
)
def test_explain_bad_factory_exits_2(module, body, message, tmp_path, monkeypatch, capsys):
    (tmp_path / f"{module}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = cli.main(["explain", f"{module}:factory"])
    assert code == 2
    assert message in capsys.readouterr().err


def test_explain_bad_options_exit_2(capsys):
    code = cli.main(["explain", "erase_fx.demo:ff_factory", "--options", '{"bogus": 1}'])
    assert code == 2
    assert "unknown option(s) 'bogus'" in capsys.readouterr().err


def test_compare_gradients_flags_a_difference_and_a_missing_gradient():
    eager, erase = demo.ff_factory()[0], demo.ff_factory()[0]
    for module in (eager, erase):
        for param in module.parameters():
            param.grad = torch.ones_like(param)
    same = demo.compare_gradients(eager, erase)
    assert same.ok and same.max_abs == same.max_rel == 0.0 and same.verdict == "PASS"
    erase.stages[1].head.weight.grad[0, 0] += 1e-3
    diff = demo.compare_gradients(eager, erase)
    assert not diff.ok and diff.worst_param == "stages.1.head.weight"
    erase.stages[2].head.bias.grad = None
    assert demo.compare_gradients(eager, erase).max_rel == float("inf")
