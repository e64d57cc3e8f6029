"""CPU tests of the paper report (``bench/paper/report.py``) and the results contract
(``bench/paper/common.py``), on hand-written results files in a temporary folder."""
from __future__ import annotations

import json
import math

import pytest
import torch

from bench.paper import common, report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def results(title: str = "Toy experiment", **overrides) -> dict:
    """A results payload that follows the contract, with a line and a bar figure."""
    payload = {
        "title": title,
        "meta": {"date": "2026-11-30T12:00:00Z", "torch": "2.11.0+cu130",
                 "device": "NVIDIA H200", "command": "python -m bench.paper.toy --quick",
                 "seeds": 2},
        "summary": "A toy summary.",
        "tables": [{"caption": "Speed", "columns": ["variant", "p90 QPS"],
                    "rows": [["eager", "1.0e6"], ["erase|graphs", "1.1e6"]]}],
        "figures": [
            {"file": "toy_curve.png", "caption": "NE curve", "kind": "line",
             "xlabel": "step", "ylabel": "NE",
             "series": [{"label": "eager", "x": [0, 10, 20], "y": [1.0, 0.9, None],
                         "yerr": [0.0, 0.01, 0.01]},
                        {"label": "erase", "x": [0, 10, 20], "y": [1.0, 0.9, 0.85]}]},
            {"file": "toy_qps.png", "caption": "QPS", "kind": "bar",
             "categories": ["median", "p90"],
             "series": [{"label": "eager", "y": [1.0e6, 1.1e6], "yerr": [1e4, 2e4]},
                        {"label": "erase", "y": [1.2e6, 1.3e6]}]},
            {"file": "toy_drawn_by_the_experiment.png", "caption": "a PNG never written"},
        ],
        "paper_comparison": [{"claim": "p90 QPS gain", "paper": "+9.51%",
                              "erase_fx": "+3.0% ± 1.0", "verdict": "worse",
                              "note": "different GPU"}],
    }
    payload.update(overrides)
    return payload


def test_report_writes_markdown_and_figures_from_the_results_files(tmp_path):
    common.write_results("toy", results(), tmp_path)
    other = results("Other experiment", order=1, figures=[], paper_comparison=[])
    common.write_results("other", other, tmp_path)
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "partial.json").write_text(json.dumps({"title": "no meta"}))

    assert report.main(["--results-dir", str(tmp_path)]) == 0

    text = (tmp_path / "REPORT.md").read_text()
    for png in ("toy_curve.png", "toy_qps.png"):
        assert (tmp_path / png).read_bytes().startswith(PNG_MAGIC)
        assert f"]({png})" in text
    # sections in (order, name) order; the comparison table first
    assert text.index("## The paper's claims") < text.index("## Other experiment") < text.index(
        "## Toy experiment")
    assert "| toy | p90 QPS gain | +9.51% | +3.0% ± 1.0 | **worse** | different GPU |" in text
    assert "erase\\|graphs" in text  # pipes escaped in cells
    assert "NVIDIA H200 · torch 2.11.0+cu130 · 2026-11-30T12:00:00Z" in text
    assert "`python -m bench.paper.toy --quick`" in text
    assert "Figure `toy_drawn_by_the_experiment.png` missing: not found" in text
    assert "`broken.json`: not readable as JSON" in text
    assert "`partial.json`: missing key 'meta'" in text


def test_report_of_an_empty_folder_says_so(tmp_path):
    path = report.write_report(tmp_path)
    assert "No results yet" in path.read_text()


def test_report_out_flag_and_missing_folder(tmp_path):
    common.write_results("toy", results(), tmp_path / "res")
    out = tmp_path / "elsewhere" / "R.md"
    assert report.main(["--results-dir", str(tmp_path / "res"), "--out", str(out)]) == 0
    assert out.read_text().startswith("# The ERASE paper's experiments")
    assert report.main(["--results-dir", str(tmp_path / "nothing")]) == 1


def test_validate_results_names_every_problem():
    assert common.validate_results(results()) == []
    bad = results(meta={"date": "d"}, paper_comparison=[{"claim": "c", "verdict": "maybe"}])
    bad["tables"][0]["rows"].append(["only one cell"])
    bad["figures"][0]["kind"] = "pie"
    problems = common.validate_results(bad)
    assert "meta lacks 'torch'" in problems and "meta lacks 'command'" in problems
    assert "tables[0] row 2 has 1 cells, not 2" in problems
    assert any("kind 'pie'" in p for p in problems)
    assert "paper_comparison[0] lacks 'paper'" in problems
    assert any("verdict 'maybe'" in p for p in problems)
    assert common.validate_results({"title": "t"}) == [
        "missing key 'meta'", "missing key 'tables'", "missing key 'figures'",
        "missing key 'paper_comparison'"]


def test_write_results_refuses_a_broken_payload_and_writes_nan_as_null(tmp_path):
    with pytest.raises(ValueError, match="missing key 'meta'"):
        common.write_results("bad", {"title": "t"}, tmp_path)
    assert not (tmp_path / "bad.json").exists()
    path = common.write_results("nan", results(data={"x": math.nan}), tmp_path)
    assert json.loads(path.read_text())["data"] == {"x": None}


def test_throughput_percentiles_and_normalized_entropy():
    stats = common.throughput_stats([0.1, 0.2, 0.4, 0.5, 1.0], batch=100)
    # per-step QPS 1000, 500, 250, 200, 100
    assert stats["median"] == 250
    assert stats["p90"] == pytest.approx(800)  # 90% of steps are slower
    assert stats["p10"] == pytest.approx(140)  # 90% of steps are faster
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    base_rate = torch.full((4,), math.log(0.25 / 0.75))
    assert common.normalized_entropy(base_rate, labels) == pytest.approx(1.0)
    assert common.normalized_entropy(labels * 20 - 10, labels) < 0.01
    assert common.binary_entropy(0.5) == pytest.approx(math.log(2))
