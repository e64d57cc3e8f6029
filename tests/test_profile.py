"""erase_fx.profile: the overlap math on hand-made kernel intervals, and the trace readers."""
import gzip
import json
import types

import pytest
import torch

from erase_fx.profile import (
    KernelInterval,
    Overlap,
    busiest_stream,
    kernel_overlap,
    kernels_from_chrome_trace,
    kernels_from_profiler,
    merge_intervals,
)


def k(stream, start, end, name="k"):
    return KernelInterval(stream=stream, start_us=start, end_us=end, name=name)


def test_no_kernels_gives_zeros():
    assert kernel_overlap([]) == Overlap(0.0, 0.0, 0.0, 0.0, None, ())


def test_one_stream_has_no_side_time():
    overlap = kernel_overlap([k(7, 0, 10), k(7, 12, 20)])
    assert (overlap.side_us, overlap.main_us, overlap.fraction) == (0.0, 18.0, 0.0)
    assert overlap.main_stream == 7 and overlap.side_streams == ()


def test_no_overlap():
    overlap = kernel_overlap([k(7, 0, 10), k(13, 10, 14), k(7, 14, 30)])
    assert overlap.main_stream == 7
    assert (overlap.side_us, overlap.overlapped_us, overlap.fraction) == (4.0, 0.0, 0.0)


def test_full_overlap():
    overlap = kernel_overlap([k(7, 0, 100), k(13, 10, 20), k(13, 30, 50)])
    assert (overlap.side_us, overlap.main_us, overlap.overlapped_us) == (30.0, 100.0, 30.0)
    assert overlap.fraction == 1.0


def test_partial_overlap():
    # side 5..15 against main 0..10: half of it overlapped
    overlap = kernel_overlap([k(7, 0, 10), k(13, 5, 15), k(7, 20, 40)])
    assert (overlap.side_us, overlap.overlapped_us) == (10.0, 5.0)
    assert overlap.fraction == 0.5


def test_several_side_streams_are_merged_into_one_side_time():
    kernels = [
        k(7, 0, 100),          # main
        k(13, 10, 30),         # side A
        k(14, 20, 40),         # side B, overlaps side A during 20..30: counted once
        k(15, 90, 120),        # side C, half under main
    ]
    overlap = kernel_overlap(kernels)
    assert overlap.side_streams == (13, 14, 15)
    assert overlap.side_us == 30.0 + 30.0          # 10..40 and 90..120
    assert overlap.overlapped_us == 30.0 + 10.0    # 10..40 and 90..100
    assert overlap.fraction == pytest.approx(40 / 60)


def test_main_kernels_back_to_back_are_merged():
    # main runs 0..10 and 10..20 (touching), side 5..15 sits across the seam
    overlap = kernel_overlap([k(7, 0, 10), k(7, 10, 20), k(13, 5, 15)])
    assert overlap.main_us == 20.0 and overlap.overlapped_us == 10.0 and overlap.fraction == 1.0


def test_main_stream_is_the_busiest_unless_given():
    kernels = [k(7, 0, 10), k(13, 0, 30)]
    assert busiest_stream(kernels) == 13
    assert kernel_overlap(kernels).main_stream == 13
    given = kernel_overlap(kernels, main_stream=7)
    assert (given.main_stream, given.side_us, given.overlapped_us) == (7, 30.0, 10.0)


def test_busiest_stream_breaks_ties_by_lowest_id():
    assert busiest_stream([k(9, 0, 10), k(3, 20, 30)]) == 3
    assert busiest_stream([]) is None


def test_merge_intervals_drops_empty_and_joins_overlapping():
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (4, 4), (6, 9)]) == [(0, 3), (5, 9)]


def test_overlap_summary_names_streams_and_fraction():
    text = kernel_overlap([k(7, 0, 10), k(13, 5, 15)]).summary()
    assert "overlap fraction 50.0%" in text and "streams 13" in text and "stream 7" in text
    assert kernel_overlap([]).summary() == "no kernels in the trace"


# -- trace readers -------------------------------------------------------------

TRACE = {
    "traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "gemm_main", "pid": 0, "tid": 7, "ts": 100.0,
         "dur": 40.0, "args": {"device": 0, "stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm_side", "pid": 0, "tid": 13, "ts": 110.0,
         "dur": 20.0, "args": {"device": 0, "stream": 13}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 0, "tid": 7, "ts": 90,
         "dur": 5, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "no_args", "pid": 0, "tid": 14, "ts": 130,
         "dur": 20},
        {"ph": "f", "cat": "ac2g", "name": "flow", "id": 1, "ts": 100},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1},
    ],
}


def test_chrome_trace_keeps_kernels_with_their_streams():
    kernels = kernels_from_chrome_trace(TRACE)
    assert kernels == [
        k(7, 100.0, 140.0, "gemm_main"),
        k(13, 110.0, 130.0, "gemm_side"),
        k(14, 130.0, 150.0, "no_args"),  # no args.stream: the tid
    ]
    overlap = kernel_overlap(kernels)
    assert overlap.main_stream == 7
    assert (overlap.side_us, overlap.overlapped_us) == (40.0, 30.0)


def test_chrome_trace_from_a_file_a_gz_file_or_an_event_list(tmp_path):
    plain = tmp_path / "trace.json"
    plain.write_text(json.dumps(TRACE))
    packed = tmp_path / "trace.json.gz"
    with gzip.open(packed, "wt") as file:
        json.dump(TRACE, file)
    expected = kernels_from_chrome_trace(TRACE)
    assert kernels_from_chrome_trace(plain) == expected
    assert kernels_from_chrome_trace(str(packed)) == expected
    assert kernels_from_chrome_trace(TRACE["traceEvents"]) == expected


def test_profiler_events_keep_cuda_kernels_only():
    def event(name, device_type, stream, start, end):
        return types.SimpleNamespace(
            name=name, device_type=device_type, device_resource_id=stream,
            time_range=types.SimpleNamespace(start=start, end=end))

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    prof = types.SimpleNamespace(events=lambda: [
        event("aten::mm", cpu, 0, 0, 100),
        event("gemm_side", cuda, 13, 110, 130),
        event("gemm_main", cuda, 7, 100, 140),
        event("Memcpy HtoD (Pageable -> Device)", cuda, 7, 90, 95),
    ])
    assert kernels_from_profiler(prof) == [k(7, 100.0, 140.0, "gemm_main"),
                                           k(13, 110.0, 130.0, "gemm_side")]
