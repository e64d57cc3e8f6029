"""bench.segment_cost's pieces that run without a GPU: its rows and the kernel families of a
trace."""
import json

from bench import segment_cost
from bench.harness import Variant


def test_the_rows_are_bench_variants():
    """Every row names a variant the bench parses (the forward whole: ``/streams=0``)."""
    rows = dict(segment_cost.ROWS + segment_cost.NO_RECOMPUTE_ROWS)
    assert rows["one stream, forward whole"] == "erase+step/streams=0"
    for variant in rows.values():
        Variant.parse(variant)
    # the no-recompute control of the one-stream row: that row's options and the pass off
    assert Variant.parse(rows["one stream, segments, no recompute"]).erase_options == {
        **Variant.parse(rows["one stream, segments"]).erase_options,
        "tuning": {"recompute_boundary_values": False}}


def test_kernel_families_per_step(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": n, "dur": d} for n, d in [
        ("nvjet_sm90_tst_128x128", 40), ("triton_poi_fused_gelu_3", 10),
        ("triton_red_fused_sum_1", 6), ("cudnn_generated_sdpa", 20), ("Memset", 2)]]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 99})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert segment_cost.kernel_families(str(path), steps=2) == {
        "matrix products": 20.0, "cuDNN (attention, conv)": 10.0, "Triton poi": 5.0,
        "Triton red": 3.0, "other": 1.0}
