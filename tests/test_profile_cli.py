"""``erase-fx profile`` on CPU, and the driver's per-segment profiler labels."""
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

import erase_fx.profile
from erase_fx import cli
from erase_fx.emit.program import PROFILE_LABEL_PREFIX
from erase_fx.config import EraseConfig
from erase_fx.profile import DEFAULT_TRACE_PATH, KernelInterval, ProfileRun, kernel_overlap
from graphs import Chain, chain_inputs

FAST = '{"inner": "aot_eager"}'


def test_profile_on_cpu_writes_the_trace_and_says_overlap_needs_a_gpu(tmp_path, capsys):
    out = tmp_path / "trace.json"
    code = cli.main(["profile", "erase_fx.demo:ff_factory", "--steps", "2", "--warmup", "1",
                     "--out", str(out), "--options", FAST, "--device", "cpu"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "profiled 2 training step(s) of erase_fx.demo:ff_factory on cpu" in printed
    # every setting in force: EraseConfig's fields, --options applied to its defaults
    settings = settings_printed(printed)
    assert settings == dataclasses.asdict(EraseConfig(inner="aot_eager"))
    assert list(settings) == [f.name for f in dataclasses.fields(EraseConfig)]
    assert "(from --options: inner)" in printed
    assert "hides the per-segment labels" not in printed  # no CUDA graphs on CPU
    assert f"trace: {out}" in printed
    assert "overlap: needs a GPU" in printed
    names = {e.get("name") for e in json.loads(out.read_text())["traceEvents"]}
    labels = {n for n in names if str(n).startswith(PROFILE_LABEL_PREFIX)}
    assert f"{PROFILE_LABEL_PREFIX}seg_1_block_0_stream_1" in labels
    assert f"segment labels: {PROFILE_LABEL_PREFIX}seg_0_stream_0" in printed
    assert f"({len(labels)})" in printed


def settings_printed(printed):
    """The JSON object of the ``erase settings: {...} (from --options: ...)`` line."""
    line = next(line for line in printed.splitlines() if line.startswith("erase settings: "))
    return json.loads(line.removeprefix("erase settings: ").rpartition(" (from --options")[0])


def test_profile_keeps_cudagraphs_when_the_options_set_it(tmp_path, capsys):
    code = cli.main(["profile", "erase_fx.demo:ff_factory", "--steps", "1", "--warmup", "1",
                     "--out", str(tmp_path / "t.json"), "--device", "cpu",
                     "--options", '{"inner": "aot_eager", "cudagraphs": true}'])
    printed = capsys.readouterr().out
    assert code == 0
    assert settings_printed(printed)["cudagraphs"] is True
    assert "(from --options: inner, cudagraphs)" in printed


def test_profile_writes_its_trace_under_erase_fxs_own_folder_by_default(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["profile", "erase_fx.demo:ff_factory", "--steps", "1", "--warmup", "0",
                     "--options", FAST, "--device", "cpu"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert DEFAULT_TRACE_PATH == os.path.join("erase_fx_traces", "trace.json")
    assert (tmp_path / "erase_fx_traces" / "trace.json").is_file()
    assert f"trace: {DEFAULT_TRACE_PATH}" in printed
    assert os.listdir(tmp_path) == ["erase_fx_traces"]  # nothing else in the working folder


def test_git_ignores_the_folders_erase_fx_writes_into():
    ignored = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().splitlines()
    assert {"erase_fx_traces/", "erase_fx_dump/"} <= set(ignored)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nosuchmodule:f"], "cannot import module 'nosuchmodule'"),
        (["erase_fx.demo:ff_factory", "--steps", "0"], "--steps must be >= 1"),
        (["erase_fx.demo:ff_factory", "--out", "/no/such/folder/t.json"], "does not exist"),
        (["erase_fx.demo:ff_factory", "--options", '{"bogus": 1}'], "unknown option(s)"),
        (["erase_fx.demo:ff_factory", "--device", "nonsense"], "--device 'nonsense'"),
        pytest.param(["erase_fx.demo:ff_factory", "--device", "cuda"], "CUDA is not available",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
    ],
)
def test_profile_usage_errors_exit_2(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["profile", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.startswith("erase-fx profile: error:")
    assert list(tmp_path.iterdir()) == []  # no trace folder for a command that failed


def test_profile_a_model_without_a_scalar_loss_exits_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "logits_model.py").write_text(
        "import torch\n"
        "def factory():\n"
        "    return torch.nn.Linear(2, 3), (torch.ones(4, 2),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = cli.main(["profile", "logits_model:factory", "--steps", "1", "--warmup", "0",
                     "--out", str(tmp_path / "t.json"), "--options", FAST, "--device", "cpu"])
    assert code == 2
    assert "must return a scalar loss tensor, got a Tensor of shape (4, 3)" in (
        capsys.readouterr().err)


def test_profile_on_a_gpu_prints_the_measured_overlap(tmp_path, monkeypatch, capsys):
    # The GPU run itself is checked on the GPU machine; here, what the command prints of it.
    kernels = [KernelInterval(7, 0, 100, "main"), KernelInterval(13, 50, 150, "side")]

    def fake_profile_training(model, args, kwargs, *, steps, warmup, options, trace_path,
                              device):
        return ProfileRun(str(trace_path), "cuda:0", steps, dict(options or {}),
                          ("erase_fx/seg_0_stream_0",), kernel_overlap(kernels))

    monkeypatch.setattr(erase_fx.profile, "profile_training", fake_profile_training)
    monkeypatch.delenv("ERASE_FX_DUMP", raising=False)
    code = cli.main(["profile", "erase_fx.demo:ff_factory", "--steps", "3",
                     "--out", str(tmp_path / "t.json")])
    printed = capsys.readouterr().out
    assert code == 0
    assert "on cuda:0" in printed
    assert settings_printed(printed) == dataclasses.asdict(EraseConfig())  # the defaults
    assert "(from --options: none)" in printed
    assert "CUDA graph replay hides the per-segment labels" in printed
    assert ("overlap: side-stream kernel time 100.0 us (streams 13), overlapped with main-stream "
            "(stream 7) kernels 50.0 us: overlap fraction 50.0%") in printed


def test_profile_help_says_cudagraphs_are_off(capsys):
    with pytest.raises(SystemExit):
        cli.main(["profile", "--help"])
    assert "cudagraphs" in capsys.readouterr().out


def test_the_driver_labels_segments_only_under_a_profiler(monkeypatch):
    compiled = torch.compile(Chain(3), backend="erase", options={"inner": "aot_eager"})
    inputs = chain_inputs()
    compiled(*inputs)  # compile outside the profiler

    def no_labels_please(name):
        raise AssertionError(f"record_function({name!r}) without a profiler")

    with monkeypatch.context() as patch:
        patch.setattr(torch.profiler, "record_function", no_labels_please)
        compiled(*inputs).backward()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(*inputs).backward()
    labels = {e.name for e in prof.events() if e.name.startswith(PROFILE_LABEL_PREFIX)}
    assert {f"{PROFILE_LABEL_PREFIX}seg_1_block_0_stream_1",
            f"{PROFILE_LABEL_PREFIX}seg_3_block_1_stream_2"} <= labels
