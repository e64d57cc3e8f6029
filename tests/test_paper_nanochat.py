"""bench.paper.nanochat on CPU: a tiny end-to-end run, the trace step attribution, the paper
rows, the model."""
import gzip
import json

import torch
from paper_helpers import one_thread  # noqa: F401 - autouse fixture
from paper_helpers import run_experiment

from bench.paper import nanochat

TINY = ["--device", "cpu", "--depth", "3", "--layers-per-stage", "1", "--width", "32",
        "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "64", "--warmup", "1",
        "--profile-steps", "1", "--trials", "1", "--steps", "1"]


def test_cpu_run_writes_contract_json_and_trace_but_no_overlap(tmp_path):
    # NB: erase+graphs is asked for and dropped: no CUDA graphs on CPU.
    code, results = run_experiment(nanochat.main, "nanochat",
                                   [*TINY, "--attention", "sdpa", "--variants",
                                    "eager,erase,erase+graphs", "--on-error", "raise"], tmp_path)
    assert code == 0
    (run,) = results["data"]["runs"]
    assert [t["variant"] for t in run["timings"]] == ["eager", "erase"]
    # 3 stages of one layer: the first two are early blocks, the last stays in the backward.
    assert run["early_blocks"] == run["expected_early_blocks"] == 2
    erase = next(t for t in run["timings"] if t["variant"] == "erase")
    assert erase["compiled"] == {"early_blocks": 2, "rejected": [], "fallback": [],
                                 "cudagraph_failures": []}
    # On CPU there are no device kernels: the overlap is not measurable, and says so.
    (profile,) = run["profiles"]
    assert profile["variant"] == "erase" and profile["overlap"] is None
    assert "not measurable on CPU" in profile["overlap_message"]
    assert profile["timeline"] is None and results["figures"] == []
    # The trace is still written, with the profiled step in it.
    trace_path = tmp_path / profile["trace"]
    assert profile["trace"] == "nanochat_trace_sdpa.json.gz"
    with gzip.open(trace_path, "rt") as file:
        events = json.load(file)["traceEvents"]
    assert any(str(e.get("name", "")).startswith("ProfilerStep#") for e in events)
    assert all(row["verdict"] == "not comparable" for row in results["paper_comparison"])


def test_a_failing_variant_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    real = nanochat.compile_variant

    def broken(name, model, **options):
        if name == "erase":
            raise RuntimeError("segment compile exploded")
        return real(name, model, **options)

    monkeypatch.setattr(nanochat, "compile_variant", broken)
    monkeypatch.setattr(nanochat, "count_early_blocks", lambda *args: 2)
    for stale in ("nanochat_trace_manual.json.gz", "nanochat_trace_manual_graphs.json.gz"):
        (tmp_path / stale).write_text("stale")
    code, results = run_experiment(nanochat.main, "nanochat",
                                   [*TINY, "--attention", "manual", "--variants", "erase,eager"],
                                   tmp_path)
    assert code == 1
    (run,) = results["data"]["runs"]
    erase, eager = run["timings"]
    assert erase == {"variant": "erase", "error": "RuntimeError: segment compile exploded"}
    assert eager["median_ms"] > 0
    (profile,) = run["profiles"]
    assert profile["trace"] is None and "erase failed" in profile["overlap_message"]
    assert not list(tmp_path.glob("nanochat_trace_*"))  # the stale ones are gone
    (overlap, _) = results["paper_comparison"]
    assert overlap["erase_fx"] == "erase (no CUDA graphs): not measured"


def launch(correlation, ts):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
            "args": {"correlation": correlation}}


def kernel(correlation, stream, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": f"k{correlation}", "ts": ts, "dur": dur,
            "args": {"correlation": correlation, "stream": stream}}


def handmade_trace():
    """Two profiled steps; the device lags: a step 1 kernel runs after step 2 began on the CPU."""
    return {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "ts": 100, "dur": 100},
        launch(1, 10), launch(2, 20), launch(3, 30),
        launch(4, 110), launch(5, 120),
        kernel(1, 7, 50, 60),     # step 1, main: 50..110
        kernel(2, 13, 60, 20),    # step 1, side: 60..80, under main
        kernel(3, 7, 110, 10),    # step 1, main: 110..120, device time inside step 2's CPU range
        kernel(4, 7, 130, 40),    # step 2, main: 130..170
        kernel(5, 13, 160, 20),   # step 2, side: 160..180, half under main
        kernel(98, 13, 185, 5),   # no launch event: its own start time puts it in step 2
        kernel(99, 7, 300, 5),    # no launch event, in no step: dropped
    ]}


def test_kernels_are_attributed_to_the_step_that_launched_them():
    steps = nanochat.kernels_by_step(handmade_trace())
    names = [[k.name for k in step] for step in steps]
    assert names == [["k1", "k2", "k3"], ["k4", "k5", "k98"]]


def test_overlap_of_the_profiled_steps_and_the_timeline(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as file:
        json.dump(handmade_trace(), file)
    overlap, last_step, message = nanochat.measure_overlap(path)
    # side time 20 + 20 + 5, of which 20 + 10 under main-stream kernels
    assert (overlap.main_stream, overlap.side_streams) == (7, (13,))
    assert (overlap.side_us, overlap.overlapped_us) == (45.0, 30.0)
    assert [k.name for k in last_step] == ["k4", "k5", "k98"] and "66.7%" in message
    picture = tmp_path / "timeline.png"
    nanochat.plot_timeline(last_step, overlap.main_stream, picture, "test")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_graphs_variant_is_read_from_its_own_trace(tmp_path):
    cfg = nanochat.GPTConfig(depth=2, width=32, heads=4, seq=16, batch=2, vocab=64,
                             layers_per_stage=1)
    with gzip.open(tmp_path / "nanochat_trace_sdpa_graphs.json.gz", "wt") as file:
        json.dump(handmade_trace(), file)
    rows = [{"variant": "erase", "error": "RuntimeError: no"}, {"variant": "erase+graphs"}]
    graphs = nanochat.read_profile("erase+graphs", cfg, rows, tmp_path)
    assert graphs["trace"] == "nanochat_trace_sdpa_graphs.json.gz"
    assert graphs["overlap"]["fraction"] == 30.0 / 45.0
    assert graphs["timeline"] == "nanochat_timeline_sdpa_graphs.png"
    assert (tmp_path / graphs["timeline"]).exists()
    erase = nanochat.read_profile("erase", cfg, rows, tmp_path)
    assert erase["trace"] is None
    assert erase["overlap_message"] == "no trace: erase failed (RuntimeError: no)"


def test_a_trace_without_kernels_is_not_measurable(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": handmade_trace()["traceEvents"][:2]}))
    assert nanochat.measure_overlap(path) == (None, [], nanochat.NOT_MEASURABLE_ON_CPU)


def fake_run(attention, fraction, compiled_blocks=2, erase_ms=9.0, one_stream_ms=10.0,
             graphs_fraction=None, graphs_failures=()):
    """A run's results as `run_attention` returns them; erase+graphs only with its fraction."""
    compiled = {"early_blocks": compiled_blocks, "rejected": [], "fallback": [],
                "cudagraph_failures": []}
    if compiled_blocks < 2:
        compiled["rejected"] = ["not_linear: prims.fma.default is not known to be linear"]
    run = {"attention": attention, "early_blocks": 2, "expected_early_blocks": 2,
           "profiles": [{"variant": "erase", "overlap": {"fraction": fraction},
                         "overlap_message": "..."}],
           "timings": [{"variant": "erase", "median_ms": erase_ms, "compiled": compiled},
                       {"variant": "erase/one-stream", "median_ms": one_stream_ms}]}
    if graphs_fraction is not None:
        graphs = {**compiled, "cudagraph_failures": list(graphs_failures)}
        run["timings"].append({"variant": "erase+graphs", "median_ms": 5.0, "compiled": graphs})
        run["profiles"].append({"variant": "erase+graphs",
                                "overlap": {"fraction": graphs_fraction},
                                "overlap_message": "..."})
    return run


def test_paper_rows_count_only_runs_with_the_full_schedule():
    runs = [fake_run("manual", 0.0, compiled_blocks=0), fake_run("sdpa", 0.4, erase_ms=9.5)]
    (overlap,) = nanochat.overlap_comparison(runs)
    assert overlap["erase_fx"].startswith("erase (no CUDA graphs): share of side-stream")
    assert overlap["erase_fx"].endswith("sdpa attention 40% (timelines in the figures)")
    assert overlap["verdict"] == "not comparable"
    assert "manual: the erase compile has 0 of 2 early blocks (not_linear" in overlap["note"]
    fused = nanochat.fused_attention_comparison(runs, torch.device("cuda"))
    assert "sdpa attention 1.05x" in fused["erase_fx"] and "needs both" in fused["note"]
    runs[0] = fake_run("manual", 0.5, erase_ms=8.0)
    fused = nanochat.fused_attention_comparison(runs, torch.device("cuda"))
    assert fused["note"].startswith("consistent with the stated limit")
    runs = [fake_run("manual", 0.0), fake_run("sdpa", 0.0)]
    (overlap,) = nanochat.overlap_comparison(runs)
    assert overlap["verdict"] == "worse" and "launch-bound" in overlap["note"]


def test_erase_and_erase_graphs_get_an_overlap_verdict_each():
    runs = [fake_run("sdpa", 0.0, graphs_fraction=0.44)]
    erase, graphs = nanochat.overlap_comparison(runs)
    assert erase["erase_fx"].startswith("erase (no CUDA graphs): ")
    assert erase["verdict"] == "worse"
    assert graphs["erase_fx"].startswith("erase+graphs (CUDA graph replay, erase_fx's default")
    assert graphs["erase_fx"].endswith("sdpa attention 44% (timelines in the figures)")
    assert graphs["verdict"] == "not comparable"
    # a failed capture means erase+graphs ran without replay: its overlap does not count
    runs = [fake_run("sdpa", 0.0, graphs_fraction=0.44,
                     graphs_failures=["erase_fx graph 0: CUDA graph capture failed: ..."])]
    _, graphs = nanochat.overlap_comparison(runs)
    assert graphs["erase_fx"].endswith("default on CUDA): not measured")
    assert "erase+graphs runs without replay" in graphs["note"]
    assert any("without CUDA graph replay" in p for p in nanochat.shortfalls(runs[0]))


def test_manual_attention_equals_sdpa():
    manual_cfg = nanochat.GPTConfig(depth=2, width=32, heads=4, seq=16, batch=2, vocab=64,
                                    attention="manual")
    sdpa_cfg = nanochat.GPTConfig(**{**manual_cfg.__dict__, "attention": "sdpa"})
    manual = nanochat.DetachedGPT(manual_cfg)
    sdpa = nanochat.DetachedGPT(sdpa_cfg)
    sdpa.load_state_dict(manual.state_dict())
    batch = nanochat.learnable_tokens(manual_cfg, torch.device("cpu"))
    torch.testing.assert_close(manual(*batch), sdpa(*batch))


def test_learnable_tokens_count_by_a_stride():
    cfg = nanochat.GPTConfig(seq=8, batch=3, vocab=50)
    tokens, targets = nanochat.learnable_tokens(cfg, torch.device("cpu"),
                                                torch.Generator().manual_seed(0))
    assert tokens.shape == targets.shape == (3, 8)
    torch.testing.assert_close(targets[:, :-1], tokens[:, 1:])
    stride = (tokens[:, 1] - tokens[:, 0]) % 50
    torch.testing.assert_close((tokens[:, 2] - tokens[:, 1]) % 50, stride)


def test_quick_preset_and_explicit_flags():
    args = nanochat.parse_args(["--quick", "--depth", "8"])
    assert (args.depth, args.width, args.seq, args.vocab) == (8, 384, 512, 4096)
    assert args.variants == nanochat.QUICK["variants"]
    # the overlap under CUDA graph replay is measured in --quick too (dropped on CPU)
    assert "erase+graphs" in args.variants.split(",") and args.attention == "sdpa"
    both = nanochat.parse_args(["--quick", "--attention", "manual,sdpa"])
    assert both.attention == "manual,sdpa"
    full = nanochat.parse_args([])
    assert (full.depth, full.width, full.seq, full.vocab) == (12, 768, 1024, 8192)
    assert full.attention == "manual,sdpa" and full.variants == ",".join(nanochat.VARIANTS)
