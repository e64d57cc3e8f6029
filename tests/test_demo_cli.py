"""End to end: the demo (``python -m erase_fx.demo``) and the ``erase-fx`` command, on CPU.

The autouse fixture of conftest.py resets Dynamo before each test.
"""
import json

import pytest
import torch

from erase_fx import cli, demo

FF_STAGES = demo.FFSizes().stages


@pytest.mark.parametrize("model", ["ff", "ctr"])
def test_demo_trains_and_matches_eager(model, capsys):
    code = demo.main(["--model", model, "--steps", "20", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "3 early blocks" in out
    assert "left in the backward" in out
    assert "step-1 gradients, erase vs eager: max abs diff" in out
    assert "all first-step gradients equal the reference's" in out


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


def test_explain_ff_finds_one_early_block_per_stage_but_the_last(capsys):
    code = cli.main(["explain", "erase_fx.demo:ff_factory"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"{FF_STAGES - 1} early blocks" in out
    assert "last_block" in out
    assert "of the backward FLOPs run early" in out


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
    assert same.ok and same.max_abs == same.max_rel == 0.0
    erase.stages[1].head.weight.grad[0, 0] += 1e-3
    diff = demo.compare_gradients(eager, erase)
    assert not diff.ok and diff.worst_param == "stages.1.head.weight"
    erase.stages[2].head.bias.grad = None
    assert demo.compare_gradients(eager, erase).max_rel == float("inf")
