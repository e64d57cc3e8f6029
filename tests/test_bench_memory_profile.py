"""bench.memory_profile's reading of an allocator snapshot (pure: synthetic snapshots, CPU)."""
from __future__ import annotations

import os

import pytest

from bench import memory_profile
from bench.memory_profile import (
    Allocation,
    describe_frames,
    format_report,
    high_water_marks,
    pool_by_stream,
    pool_growths,
)

MAIN, SIDE = 11, 22
POOL = (1, 0)


def _segment(address, size, stream, pool=POOL):
    return {"address": address, "total_size": size, "stream": stream, "segment_pool_id": pool}


def _snapshot(trace):
    return {
        "segments": [
            _segment(0, 1000, MAIN),
            _segment(1000, 600, SIDE),
            _segment(5000, 4000, MAIN, pool=(0, 0)),  # the default pool: not a graph's
        ],
        "device_traces": [trace],
    }


def _alloc(addr, size, stream, name="buf"):
    return {"action": "alloc", "addr": addr, "size": size, "stream": stream,
            "frames": [{"filename": "/tmp/gen.py", "line": 1, "name": name}]}


def _free(addr, size, stream):
    return {"action": "free_completed", "addr": addr, "size": size, "stream": stream}


def test_pool_by_stream_counts_graph_pool_segments_only():
    assert pool_by_stream(_snapshot([])) == {MAIN: 1000, SIDE: 600}


def test_high_water_mark_is_the_most_alive_at_once_per_stream():
    trace = [
        _alloc(1000, 100, SIDE),  # before the graph pools' first segment: not counted
        {"action": "segment_alloc", "addr": 0, "size": 1000, "stream": MAIN},
        _alloc(0, 300, MAIN), _alloc(300, 200, MAIN), _free(0, 300, MAIN),
        _alloc(500, 100, MAIN),  # 300 alive, below the 500 of before
        {"action": "segment_alloc", "addr": 1000, "size": 600, "stream": SIDE},
        _alloc(1000, 400, SIDE), _free(1000, 400, SIDE), _alloc(1000, 250, SIDE),
        _alloc(6000, 3000, MAIN),  # default pool: not counted
    ]
    report = {s.stream: s for s in high_water_marks(_snapshot(trace), top=1,
                                                    describe=lambda frames: ("made", "", "/tmp/gen.py"))}
    assert report[MAIN].pool_bytes == 1000 and report[MAIN].peak_bytes == 500
    assert report[MAIN].at_peak == (Allocation(300, "made", "", "/tmp/gen.py"),)  # largest
    assert memory_profile.generated_files(list(report.values())) == {"/tmp/gen.py"}
    assert memory_profile.generated_files(list(report.values()), [MAIN]) == {"/tmp/gen.py"}
    assert memory_profile.generated_files(list(report.values()), []) == set()
    assert report[SIDE].pool_bytes == 600 and report[SIDE].peak_bytes == 400
    assert [s.stream for s in high_water_marks(_snapshot(trace))] == [MAIN, SIDE]  # largest first


def test_describe_frames_skips_torch_and_names_the_erase_function(tmp_path):
    generated = tmp_path / "cabc.py"
    generated.write_text("x = 1\nbuf3 = empty_strided_cuda((16, 8192), (8192, 1), torch.float32)\n")
    torch_file = os.sep.join(["", "site-packages", "torch", "_inductor", "runtime.py"])
    erase_file = os.sep.join(["", "repo", "erase_fx", "emit", "program.py"])
    frames = [{"filename": torch_file, "line": 3, "name": "alloc"},
              {"filename": str(generated), "line": 2, "name": "call"},
              {"filename": erase_file, "line": 40, "name": "run_segment"}]
    made_by, under, source = describe_frames(frames)
    assert made_by == "cabc.py:2: buf3 = empty_strided_cuda((16, 8192), (8192, 1), torch.float32)"
    assert under == "erase_fx/emit/program.py:run_segment" and source == str(generated)
    assert describe_frames([]) == ("?", "", "")


def test_main_without_cuda_says_so(monkeypatch, capsys):
    monkeypatch.setattr(memory_profile.torch.cuda, "is_available", lambda: False)
    assert memory_profile.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("report", [[]])
def test_format_report_of_nothing(report):
    assert memory_profile.format_report("x", report, {}).startswith("## x: graph pools 0 MiB")


def test_an_address_is_inside_a_pool_segment_from_its_start_to_before_its_end():
    ranges = [(0, 10), (20, 30)]
    inside = [a for a in (-1, 0, 9, 10, 15, 20, 29, 30) if memory_profile._inside(ranges, a)]
    assert inside == [0, 9, 20, 29]


def test_debug_ir_of_finds_the_trace_folder_by_the_code_it_holds(tmp_path):
    code = tmp_path / "generated.py"
    code.write_text("def call(args): pass\n")
    for name, text in (("graph_a", "other code\n"), ("graph_b", code.read_text())):
        folder = tmp_path / "trace" / name
        folder.mkdir(parents=True)
        (folder / "output_code.py").write_text(text)
        (folder / "ir_pre_fusion.txt").write_text(f"{name} pre\n")
    found = memory_profile.debug_ir_of(str(code), str(tmp_path / "trace"))
    assert {k: open(v).read() for k, v in found.items()} == {"ir_pre_fusion.txt": "graph_b pre\n"}
    (tmp_path / "alone.py").write_text("no trace holds this\n")
    assert memory_profile.debug_ir_of(str(tmp_path / "alone.py"), str(tmp_path / "trace")) == {}


def test_inductors_trace_holds_the_ir_of_the_module_it_runs(tmp_path):
    """Pins what --keep-ir reads of torch: with ``trace.enabled`` Inductor copies the module
    it loads into its debug folder as ``output_code.py``, beside the scheduler's IR."""
    import torch
    from torch._inductor.codecache import PyCodeCache

    torch._dynamo.reset()
    with memory_profile._inductor_trace(str(tmp_path)):
        fn = torch.compile(lambda x: (x.sin() * 2).sum(dim=0) + x.cos().amax(dim=0))
        fn(torch.randn(64, 32))
    torch._dynamo.reset()
    loaded = [m.__file__ for m in PyCodeCache.modules]
    found = [memory_profile.debug_ir_of(path, str(tmp_path)) for path in loaded]
    assert any(set(ir) == set(memory_profile.IR_FILES) for ir in found), found


def test_keep_ir_needs_keep_code():
    with pytest.raises(SystemExit):
        memory_profile.main(["--keep-ir"])


def test_pool_growths_flag_a_segment_made_while_enough_was_free_in_pieces():
    """Side: 6 MiB in one segment; 4 and 1 MiB taken, the 4 freed: 5 MiB free but in two
    pieces, so a 4.5 MiB request takes a new segment (fragmentation); then a 7 MiB request,
    more than was free, grows the pool as a stream that needs more memory does. Small
    blocks and their 2 MiB segments are left out; a freed segment takes its blocks along."""
    M = 2**20
    snapshot = {
        "segments": [_segment(10 * M, 6 * M, SIDE), _segment(20 * M, 5 * M, SIDE),
                     _segment(30 * M, 8 * M, SIDE), _segment(40 * M, 2 * M, SIDE),
                     _segment(50 * M, 40 * M, MAIN, pool=(0, 0))],
        "device_traces": [[
            {"action": "segment_alloc", "addr": 30 * M, "size": 8 * M, "stream": SIDE},
            _alloc(30 * M, 8 * M, SIDE),  # an earlier graph's segment, freed below
            {"action": "segment_free", "addr": 30 * M, "size": 8 * M, "stream": SIDE},
            {"action": "segment_alloc", "addr": 10 * M, "size": 6 * M, "stream": SIDE},
            _alloc(10 * M, 4 * M, SIDE), _alloc(14 * M, 1.5 * M, SIDE), _free(10 * M, 4 * M, SIDE),
            {"action": "segment_alloc", "addr": 40 * M, "size": 2 * M, "stream": SIDE},
            _alloc(40 * M, 512, SIDE),  # a small block: not counted
            {"action": "segment_alloc", "addr": 20 * M, "size": 5 * M, "stream": SIDE},
            _alloc(20 * M, 4.5 * M, SIDE, name="logits"),
            {"action": "segment_alloc", "addr": 30 * M, "size": 8 * M, "stream": SIDE},
            _alloc(30 * M, 7 * M, SIDE),
            _alloc(60 * M, 3 * M, MAIN),  # the default pool: not a graph's
        ]],
    }
    describe = lambda frames: (frames[0]["name"] if frames else "?", "", "")  # noqa: E731
    growths = pool_growths(snapshot, describe=describe)
    assert [(g.segment / M, g.request / M, g.held_before / M, g.free_before / M,
             g.largest_free / M, g.fragmented)
            for g in growths] == [(6, 4, 0, 0, 0, False), (5, 4.5, 6, 4.5, 4, True),
                                  (8, 7, 11, 5, 4, False)]
    assert growths[1].made_by == "logits"
    report = high_water_marks(snapshot, describe=lambda frames: ("made", "", ""))
    text = format_report("t", report, {SIDE: "side 1"}, growths)
    assert "side 1's pool grew by 3 large segments, 1 of them with the request's size free" in text


def test_largest_free_run_is_within_one_segment():
    from bench.memory_profile import _largest_free_run
    assert _largest_free_run({}, {}) == 0
    assert _largest_free_run({0: 10}, {}) == 10
    assert _largest_free_run({0: 10}, {0: 3, 7: 3}) == 4  # between the two blocks
    assert _largest_free_run({0: 10, 10: 10}, {0: 6, 14: 6}) == 4  # 6-10 and 10-14: not one run
    assert _largest_free_run({0: 10}, {0: 10, 20: 5}) == 0  # a block elsewhere: not here
