"""Dump files as torch structured-trace artifacts (what tlparse shows for TORCH_TRACE runs)."""
import logging

import pytest
import torch

from erase_fx.instruments import (
    TIMINGS_FILE,
    DumpInstrument,
    artifact_name,
    dump_instrument_for,
    structured_trace_enabled,
)
from graphs import Chain, chain_inputs

TRACE_LOGGER = "torch.__trace"  # torch._logging._internal.trace_log


class ArtifactCapture(logging.Handler):
    """Keeps each ``trace_structured("artifact", ...)`` record: name -> (encoding, payload)."""

    def __init__(self):
        super().__init__()
        self.artifacts = {}

    def emit(self, record):
        artifact = (getattr(record, "metadata", None) or {}).get("artifact")
        if artifact is not None:
            self.artifacts[artifact["name"]] = (artifact["encoding"], record.payload)


@pytest.fixture
def trace():
    trace_log = logging.getLogger(TRACE_LOGGER)
    capture = ArtifactCapture()
    trace_log.addHandler(capture)
    try:
        yield capture
    finally:
        trace_log.removeHandler(capture)


def test_every_dump_file_is_also_a_string_artifact(trace, tmp_path):
    compiled = torch.compile(Chain(3), backend="erase",
                             options={"inner": "aot_eager", "dump_dir": str(tmp_path)})
    compiled(*chain_inputs()).backward()
    (graph,) = list(tmp_path.iterdir())
    files = sorted(p for p in graph.iterdir() if p.suffix != ".svg")
    assert len(files) > 10
    for path in files:
        name = artifact_name(graph.name, path.name)
        assert name == f"erase_fx_{graph.name}_{path.name}"
        assert trace.artifacts[name] == ("string", path.read_text()), path.name
    ours = [n for n in trace.artifacts if n.startswith("erase_fx_")]
    assert len(ours) == len(files)  # timings.json once, not once per pass


def test_without_dump_dir_a_trace_gets_the_artifacts_and_no_file(trace, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert structured_trace_enabled()
    dump = dump_instrument_for(None, 7)
    assert dump is not None and dump.folder is None
    dump.before_pass("assign_streams", ())
    dump.after_pass("assign_streams", torch.fx.symbolic_trace(torch.nn.ReLU()), 0.25)
    assert list(tmp_path.iterdir()) == []
    encoding, payload = trace.artifacts["erase_fx_graph_7_00_assign_streams.py"]
    assert encoding == "string" and payload.startswith("# erase_fx dump, step 00")
    assert f"erase_fx_graph_7_{TIMINGS_FILE}" not in trace.artifacts  # with the report


def test_without_dump_dir_or_trace_nothing_is_rendered(monkeypatch, tmp_path):
    monkeypatch.setattr(logging.getLogger(TRACE_LOGGER), "handlers", [])
    assert not structured_trace_enabled()
    assert dump_instrument_for(None, 0) is None
    dump = dump_instrument_for(tmp_path, 0)
    assert isinstance(dump, DumpInstrument) and dump.folder == tmp_path / "graph_0"
