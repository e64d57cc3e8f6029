"""The user patterns (issue 36) as bench.run configs, on CPU at tiny sizes.

``pattern-<name>:B[:width[:depth]]`` parses and prints back in full, builds each
pattern's model with its own ``loss_of``, and bench.run's step applies that
loss outside the compiled model; ``bench.run --smoke`` runs the loop on the CPU
and ``--explain`` says what erase finds; ``bench/device_run.sh patterns-a``
and ``patterns-b`` call bench.run as they should.
"""
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bench import harness, run
from bench.models import WithLoss, build_config, build_with_loss, parse_config
from bench.user_patterns import (
    BENCH_SIZES,
    PATTERN_CONFIGS,
    PATTERNS,
    NOT_BENCHED,
    PatternConfig,
    pattern_model,
)

pytestmark = pytest.mark.filterwarnings(
    # NB: the Forward-Forward net keeps a Function instance, as the code it stands for does
    "ignore:.*should not be instantiated.*:DeprecationWarning")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device_run.sh"
#: Each bench pattern at a size that builds and steps on a CPU in well under a second.
TINY = {name: f"pattern-{name}:4:32:2" for name in BENCH_SIZES}
TINY["vgg_local_loss"] = "pattern-vgg_local_loss:4:8:2"
#: Packages a pattern needs beyond torch.
NEEDS = {"gpt2_probes": "transformers"}


def tiny(name: str):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    return parse_config(TINY[name])


def test_every_pattern_but_lightnings_has_a_bench_config():
    assert set(BENCH_SIZES) | set(NOT_BENCHED) == set(PATTERNS)
    assert [PatternConfig.parse(text).name for text in PATTERN_CONFIGS] == list(BENCH_SIZES)
    for text in PATTERN_CONFIGS:
        cfg = parse_config(text)
        assert isinstance(cfg, PatternConfig) and str(cfg) == text
        assert cfg.kind == text.split(":")[0]


def test_omitted_sizes_take_the_patterns_defaults():
    assert str(parse_config("pattern-ff_one_graph:256")) == "pattern-ff_one_graph:256:2048:4"
    assert str(parse_config("pattern-vgg_local_loss:64:32")) == "pattern-vgg_local_loss:64:32:4"
    assert str(parse_config("pattern-gpt2_probes:8:256:3")) == "pattern-gpt2_probes:8:256:3"


@pytest.mark.parametrize("text, message", [
    ("pattern-lightning_module:8", "bench.frameworks times Lightning"),
    ("pattern-resnet:8", "name one of ff_accumulator"),
    ("pattern-ff_one_graph", "pattern-<name>:B[:width[:depth]]"),
    ("pattern-ff_one_graph:8:16:2:1", "pattern-<name>:B[:width[:depth]]"),
    ("pattern-ff_one_graph:8:x", "positive integers"),
    ("pattern-ff_one_graph:1:16", "batch at least 2"),
    ("pattern-ff_one_graph:8:16:1", "depth at least 2"),
    ("pattern-vgg_local_loss:8:16:6", "no 2 x 2 map"),
    ("pattern-gpt2_probes:8:100", "multiple of 64"),
    ("patterns:8", "pattern-<name>:B[:width[:depth]]"),  # an unknown kind lists the patterns
])
def test_malformed_pattern_configs_say_what_is_expected(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(text)


def test_main_rejects_a_bad_pattern_config_before_touching_a_gpu(capsys):
    assert run.main(["--configs", "pattern-lightning_module:8"]) == 2
    assert "bench.frameworks" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(BENCH_SIZES))
def test_each_pattern_builds_with_its_own_loss_and_the_same_parameters(name):
    cfg = tiny(name)
    model, inputs, loss_of = build_with_loss(cfg, torch.device("cpu"),
                                             torch.Generator().manual_seed(0))
    # NB: bench.run builds a pattern's model again for each row: the same parameters
    again = pattern_model(cfg)
    for (key, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), key
    assert loss_of is PATTERNS[name].factory()[2]
    loss = loss_of(model(*inputs))
    assert loss.numel() == 1 and torch.isfinite(loss).all()
    loss.sum().backward()
    assert any(p.grad is not None for p in model.parameters())
    # the model's own loss: build_config hands out the model itself
    assert build_config(cfg, torch.device("cpu"))[0].__class__ is model.__class__


def test_the_bench_sizes_are_the_patterns_at_a_gpus_size():
    model, inputs, _ = build_with_loss(parse_config("pattern-vgg_local_loss:2"),
                                       torch.device("cpu"))
    assert inputs[0].shape == (2, 3, 64, 64)
    assert [b.body[0].out_channels for b in model.blocks] == [64, 128, 256, 512]
    model, inputs, _ = build_with_loss(parse_config("pattern-ff_one_graph:2"),
                                       torch.device("cpu"))
    assert [x.shape for x in inputs] == [(2, 784), (2, 784)]
    assert [layer.linear.out_features for layer in model.layers] == [2048] * 4
    model, (_, y), _ = build_with_loss(parse_config("pattern-data_dependent_between:8:16"),
                                       torch.device("cpu"), torch.Generator().manual_seed(0))
    assert int((y < 0).sum()) == 4 and len(model.blocks) == 4


def test_a_hooked_model_is_built_again_not_copied():
    """The hooks close over the dict of the model they were registered on: a copy's forward
    writes the original's dict, which then holds tensors with history and cannot be copied."""
    model, inputs, _ = build_with_loss(tiny("hooked_activations"), torch.device("cpu"))
    copy.deepcopy(model)(*inputs)
    assert model.activations  # the copy wrote the original's dict
    with pytest.raises(RuntimeError, match="deepcopy"):
        copy.deepcopy(model)


class LossAndLogits(nn.Module):
    """Returns ``(loss, logits)``: its loss is ``output[0]``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x, y):
        logits = self.b(self.a(x).relu())
        return F.cross_entropy(logits, y), logits


def first(output):
    return output[0]


@pytest.mark.parametrize("variant", ["eager", "inductor+step", "erase+step"])
def test_the_step_applies_a_configs_loss_of_outside_the_compiled_model(variant):
    torch.manual_seed(0)
    base = LossAndLogits()
    inputs = (torch.randn(6, 8), torch.randint(0, 3, (6,)))
    reference = copy.deepcopy(base)
    first(reference(*inputs)).backward()
    model = copy.deepcopy(base)
    built = harness.build_step(variant, model, inputs, loss_of=first, inner="aot_eager")
    torch.testing.assert_close(harness.grads_of(model), harness.grads_of(reference),
                               rtol=0, atol=0)
    assert built.step().shape == ()
    # the tools that call model(*inputs) get the loss through WithLoss
    torch.testing.assert_close(WithLoss(base, first)(*inputs), base(*inputs)[0], rtol=0, atol=0)


def test_smoke_runs_the_loop_on_the_cpu_and_writes_only_where_told(tmp_path, capsys):
    out = tmp_path / "step.json"
    args = ["--smoke", "--out", str(out), "--streams", "", "--sweep-configs", "",
            "--trials", "2", "--steps-per-trial", "1",
            "--configs", "pattern-hooked_activations:4:32:3",
            "--variants", "inductor+step,erase+step"]
    assert run.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["config"], r["variant"]) for r in rows] == [
        ("pattern-hooked_activations:4:32:3", "inductor+step"),
        ("pattern-hooked_activations:4:32:3", "erase+step")]
    assert all("error" not in r and r["grad_max_rel_err"] == 0.0 for r in rows)
    assert rows[1]["early_blocks"] == 2 and rows[1]["gpu"] == "CPU (--smoke)"
    assert "CUDA is not available" in rows[1]["uncaptured_reason"]
    assert "| pattern-hooked_activations:4:32:3 | erase+step |" in out.with_suffix(".md").read_text()
    # never into bench/results
    assert run.main(["--smoke", "--configs", "pattern-ff_one_graph:4:32:2"]) == 2
    assert "--smoke writes no table" in capsys.readouterr().err


def test_smoke_fails_when_a_row_fails(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("a typo")

    monkeypatch.setattr(run, "build_step", broken)
    args = ["--smoke", "--out", str(tmp_path / "step.json"), "--streams", "",
            "--sweep-configs", "", "--configs", "pattern-ff_one_graph:4:32:2",
            "--variants", "erase+step"]
    assert run.main(args) == 1
    assert "1 row(s) failed: pattern-ff_one_graph:4:32:2 erase+step" in capsys.readouterr().err


def test_explain_says_what_erase_finds_in_each_config(capsys):
    assert run.main(["--explain", "--configs",
                     "pattern-ff_one_graph:4:32:3,pattern-lightning_module:4"]) == 2
    capsys.readouterr()
    assert run.main(["--explain", "--configs",
                     "pattern-ff_one_graph:4:32:3,pattern-data_dependent_between:4:32:3"]) == 0
    table = capsys.readouterr().out.strip().splitlines()[-3:]
    assert re.match(r"config +graphs +early blocks +early share", table[0])
    assert re.match(r"pattern-ff_one_graph:4:32:3 +1 +2 +\d+% +last_block x1$", table[1])
    # the nonzero breaks the graph after block 0, which runs at the graph's end
    assert re.match(r"pattern-data_dependent_between:4:32:3 +2 +2 ", table[2])


def test_pattern_rows_come_after_the_other_families():
    rows = [{"config": c, "variant": "erase+step"}
            for c in ("pattern-ff_one_graph:4:32:2", "tv-resnet18-dgl:256:32", "gpt:4:64:8:2")]
    assert [r["config"] for r in sorted(rows, key=run.order)] == [
        "gpt:4:64:8:2", "tv-resnet18-dgl:256:32", "pattern-ff_one_graph:4:32:2"]


# -- bench/device_run.sh ---------------------------------------------------------------


def listed(name: str) -> list[str]:
    text = SCRIPT.read_text()
    return ",".join(re.findall(rf"^{name}\+?=,?(\S+)$", text, re.M)).split(",")


def test_the_parts_run_every_bench_pattern_and_their_tiny_forms():
    assert sorted(listed("PATTERNS")) == sorted(PATTERN_CONFIGS)
    smoke = [parse_config(text) for text in listed("PATTERNS_SMOKE")]
    assert [cfg.name for cfg in smoke] == [parse_config(t).name for t in listed("PATTERNS")]
    usage = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert usage.returncode == 2
    assert "device_run.sh patterns-a" in usage.stdout and "patterns-b" in usage.stdout
    refused = subprocess.run(["bash", str(SCRIPT), "step", "--smoke"], capture_output=True,
                             text=True)
    assert refused.returncode == 2 and "applies to patterns-a" in refused.stderr


def test_on_the_gpu_patterns_a_runs_the_step_pair_then_the_drop_in_pair(tmp_path):
    """The GPU branch, with a python3 that prints its arguments instead of running."""
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\necho "python3 $*"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    result = subprocess.run(["bash", str(SCRIPT), "patterns-a"], capture_output=True, text=True,
                            env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    calls = [line for line in result.stdout.splitlines() if "bench.run" in line]
    assert len(calls) == 2
    for call, variants in zip(calls, ("inductor+step,erase+step", "reduce-overhead,erase+graphs")):
        assert f"--configs {','.join(listed('PATTERNS'))} --variants {variants}" in call
        assert "--smoke" not in call and "--budget-s" in call
    result = subprocess.run(["bash", str(SCRIPT), "patterns-b"], capture_output=True, text=True,
                            env=env, cwd=ROOT)
    calls = [line for line in result.stdout.splitlines() if "bench.run" in line]
    assert len(calls) == 1 and calls[0].endswith("--variants reduce-overhead,erase+graphs")


def test_without_transformers_the_gpt2_config_is_skipped_with_a_line(tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # NB: import fails
    args = ["--smoke", "--out", str(tmp_path / "step.json"), "--streams", "",
            "--sweep-configs", "", "--configs", "pattern-gpt2_probes:2:32:2",
            "--variants", "erase+step"]
    assert run.main(args) == 0
    assert ("pattern-gpt2_probes:2:32:2: skipped, pattern-gpt2_probes:2:32:2 needs transformers"
            in capsys.readouterr().out)
