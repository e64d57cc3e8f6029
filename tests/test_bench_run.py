"""bench.run's bookkeeping on CPU: targets judged from ratios, the Markdown table, merging."""
import json

import pytest
import torch

from bench import run

META = {"date": "2026-11-30", "gpu": "NVIDIA H200", "torch": "2.11.0", "trials": 7,
        "steps_per_trial": 20, "tf32": True, "command": "python -m bench.run"}


def row(config, variant, ms, peak=100):
    return {"config": config, "variant": variant, "ms_median": ms, "ms_min": ms, "ms_max": ms,
            "peak_mem_bytes": peak, "compile_s": 1.0, "grad_max_rel_err": 1e-3, "tflops": 1.0}


SMALL, LARGE = "mlp:128:2000:2000:4", "ctr:16384:1024:2048:6"
ROWS = [
    row(SMALL, "inductor", 8.0, peak=100), row(SMALL, "reduce-overhead", 2.0),
    row(SMALL, "inductor+graph", 1.0), row(SMALL, "erase+graphs", 1.2, peak=90),
    row(LARGE, "inductor", 21.0, peak=100), row(LARGE, "inductor+graph", 20.0),
    row(LARGE, "erase+graphs", 19.0, peak=120), row(LARGE, "erase+step-graph", 21.0, peak=90),
]


def test_targets_are_judged_on_ratios_of_this_run():
    judged = run.judge_targets(ROWS)
    targets = {(t["config"], t["vs"]): t for t in judged if t["variant"] == "erase+graphs"}
    assert targets[(SMALL, "inductor+graph")]["ratio"] == pytest.approx(1.2)
    assert not targets[(SMALL, "inductor+graph")]["met"]  # target 0.85
    assert targets[(SMALL, "reduce-overhead")]["met"]  # 0.6 <= 0.75
    assert targets[(SMALL, "inductor peak memory")]["met"]
    assert targets[(LARGE, "inductor+graph")]["met"]  # 0.95 <= 1.0
    assert not targets[(LARGE, "inductor peak memory")]["met"]
    step_graph = {(t["config"], t["vs"]): t["met"] for t in judged
                  if t["variant"] == "erase+step-graph"}
    assert step_graph == {(LARGE, "inductor+graph"): False, (LARGE, "inductor peak memory"): True}


def test_markdown_has_a_row_per_measurement_and_the_verdicts():
    table = run.markdown(META, ROWS, run.judge_targets(ROWS))
    assert "NVIDIA H200, torch 2.11.0" in table
    assert f"| {SMALL} | erase+graphs | 1.200 |" in table and "| 1.20x | 0.60x |" in table
    assert "| MISSED |" in table and "| met |" in table
    assert f"| erase+step-graph | {LARGE} | inductor+graph | 1.05 | <= 1.00 | MISSED |" in table


def test_merge_joins_parts_of_one_gpu_and_refuses_two(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"meta": META, "rows": ROWS[:4]}))
    second.write_text(json.dumps({"meta": dict(META, command="part 2"), "rows": ROWS[4:]}))
    out = tmp_path / "all.json"
    assert run.main(["--merge", str(first), str(second), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert len(merged["rows"]) == len(ROWS) and merged["meta"]["command"].endswith("; part 2")
    assert out.with_suffix(".md").exists()
    second.write_text(json.dumps({"meta": dict(META, gpu="NVIDIA A100"), "rows": ROWS[4:]}))
    assert run.main(["--merge", str(first), str(second), "--out", str(out)]) == 2


def test_towers_configs_share_the_front_and_run_all_towers_but_the_last_early():
    import erase_fx
    from bench.models import ChainConfig, DetachedChain, make_inputs
    from graphs import check_parity

    cfg = ChainConfig.parse("mlp-towers:8:16:32:3")
    assert (cfg.data, cfg.towers, str(cfg)) == ("mlp", True, "mlp-towers:8:16:32:3")
    with erase_fx.collect_reports() as reports:
        check_parity(DetachedChain(cfg), lambda: make_inputs(cfg, torch.device("cpu")),
                     rtol=0, atol=0)
    (report,) = reports
    assert [b.partials for b in report.blocks] == [1, 1]
    assert [r.reason for r in report.rejected] == ["last_block", "joins_blocks"]
    assert report.rejected[1].params == ("front.weight", "front.bias")
    with pytest.raises(ValueError, match="kind one of ctr, mlp, ctr-towers, mlp-towers"):
        ChainConfig.parse("towers:8:16:32:3")


def test_towers_under_a_top_head_run_early_in_pieces():
    import erase_fx
    from bench.models import ChainConfig, DetachedChain, make_inputs
    from graphs import check_parity

    cfg = ChainConfig.parse("mlp-towers-top:8:16:32:3")
    assert (cfg.data, cfg.towers, cfg.top) == ("mlp", True, True)
    with erase_fx.collect_reports() as reports:
        check_parity(DetachedChain(cfg), lambda: make_inputs(cfg, torch.device("cpu")),
                     rtol=0, atol=0)
    (report,) = reports
    assert [b.pieces for b in report.blocks] == [4]  # three towers' parts, then the front
    assert [r.params for r in report.rejected] == [("top.weight", "top.bias")]
