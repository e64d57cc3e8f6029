"""`CudaStreams.run_update` / `join_update` on CPU, with recording stand-ins for CUDA's streams.

The early optimizer (`erase_fx.early_update`) launches each block's update on
the update stream paired with the block's side stream; the main stream then
waits for every update stream used. A GPU run checks the values; this pins
which stream waits for what.
"""
import contextlib

import pytest
import torch

from erase_fx.emit import streams as streams_module


class RecordingStream:
    made = 0

    def __init__(self, device=None):
        RecordingStream.made += 1
        self.name = f"stream{RecordingStream.made}"
        self.waited_events: list = []
        self.waited_streams: list = []
        self.ran: list = []

    def wait_event(self, event):
        self.waited_events.append(event)

    def wait_stream(self, other):
        self.waited_streams.append(other)


@pytest.fixture
def recording_cuda(monkeypatch):
    main = RecordingStream()
    current = [main]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", RecordingStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(streams_module, "_pool", {})
    monkeypatch.setattr(streams_module, "_update_pool", {})
    return main, current


def test_each_lane_has_its_update_stream_and_the_main_stream_joins_every_one(recording_cuda):
    main, current = recording_cuda
    ops = streams_module.CudaStreams(torch.device("cuda", 0), 2)

    def update(tag):
        current[-1].ran.append(tag)
        return tag

    assert ops.run_update(1, ["event of block 1"], lambda: update("block 1")) == "block 1"
    ops.run_update(0, ["event of block 0"], lambda: update("block 0"))
    ops.run_update(1, ["event of block 3"], lambda: update("block 3"))
    lane0, lane1 = streams_module.update_streams(torch.device("cuda", 0), 2)
    assert lane0 not in ops.side and lane1 not in ops.side and lane0 is not lane1
    assert lane0.ran == ["block 0"] and lane1.ran == ["block 1", "block 3"]
    assert lane0.waited_events == ["event of block 0"]
    assert lane1.waited_events == ["event of block 1", "event of block 3"]
    assert main.ran == []
    ops.join_update()
    assert sorted(s.name for s in main.waited_streams) == sorted([lane0.name, lane1.name])


def test_graphs_share_a_devices_update_streams(recording_cuda):
    first = streams_module.CudaStreams(torch.device("cuda", 0), 2)
    second = streams_module.CudaStreams(torch.device("cuda", 0), 2)
    first.run_update(0, [], lambda: None)
    second.run_update(0, [], lambda: None)
    assert first._updates[0] is second._updates[0]


def test_join_without_updates_waits_for_nothing(recording_cuda):
    main, _ = recording_cuda
    streams_module.CudaStreams(torch.device("cuda", 0), 2).join_update()
    assert main.waited_streams == []


def test_folded_streams_run_side_stream_s_on_1_plus_s_minus_1_mod_width(recording_cuda,
                                                                        monkeypatch):
    """`Tuning.side_cuda_streams`: four side streams on two; fork and join touch each
    CUDA stream once; the communication stream a folded view makes is the original's too."""
    main, current = recording_cuda
    monkeypatch.setattr(streams_module, "_comm_pool", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    ops = streams_module.CudaStreams(torch.device("cuda", 0), 4)
    folded = ops.folded(2)
    assert folded.side is ops.side and ops.width is None and folded.width == 2

    def on_current(tag):
        def fn(inputs):
            current[-1].ran.append(tag)
        return fn

    folded.fork((1, 2, 3, 4))
    for stream in (1, 2, 3, 4):
        folded.run(stream, on_current(f"block on {stream}"), [], waits=[f"event {stream}"])
    folded.join((1, 2, 3, 4), [])
    first, second, third, fourth = ops.side
    assert first.ran == ["block on 1", "block on 3"] and second.ran == ["block on 2", "block on 4"]
    assert third.ran == fourth.ran == []
    assert first.waited_streams == [main] and second.waited_streams == [main]
    assert first.waited_events == ["event 1", "event 3"]
    assert [s.name for s in main.waited_streams] == [first.name, second.name]
    folded.run_comm([3], [], lambda: None)
    ops.wait_comm()  # NB: the original waits for what its folded view launched
    assert main.waited_streams[-1] is streams_module.comm_stream(torch.device("cuda", 0))
