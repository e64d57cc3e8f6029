"""bench.run's bookkeeping on CPU: targets judged from ratios, the current table, merging."""
import json
from types import SimpleNamespace

import pytest
import torch

from bench import run

META = {"date": "2026-11-30", "gpu": "NVIDIA H200", "torch": "2.11.0", "trials": 7,
        "steps_per_trial": 20, "tf32": True, "command": "python -m bench.run"}
MIB = 2**20


def row(config, variant, ms, mem=100, **extra):
    return {"config": config, "variant": variant, "ms_median": ms, "ms_min": ms, "ms_max": ms,
            "peak_mem_bytes": 1000 * MIB, "step_peak_bytes": mem * MIB // 4,
            "kept_bytes": mem * MIB - mem * MIB // 4, "mem_bytes": mem * MIB,
            "compile_s": 1.0, "grad_max_rel_err": 1e-3, "grad_random": False, "tflops": 1.0,
            **extra}


SMALL, LARGE, GPT = "mlp:128:2000:2000:4", "ctr:16384:1024:2048:6", "gpt:8:768:1024:6"
VISION = "tv-resnet18-dgl:256:32"
ROWS = [
    row(SMALL, "inductor", 8.0), row(SMALL, "reduce-overhead", 2.0),
    row(SMALL, "inductor+graph", 1.0), row(SMALL, "erase+graphs", 1.2, mem=90),
    row(LARGE, "inductor", 21.0), row(LARGE, "inductor+graph", 20.0, mem=100),
    row(LARGE, "erase+graphs", 19.0, mem=120), row(LARGE, "erase+step-graph", 21.0, mem=50),
]


def md(rows):
    """The Markdown of ``rows`` measured in one run (`META`)."""
    rows = run.stamped(rows, META)
    return run.markdown(rows, run.judge_targets(rows))


def judged(rows, variant):
    return {(t["config"], t["vs"], t["measure"]): t for t in run.judge_targets(rows)
            if t["variant"] == variant}


def test_targets_are_judged_on_ratios_of_this_run():
    targets = judged(ROWS, "erase+graphs")
    assert targets[(SMALL, "inductor+graph", "time")]["ratio"] == pytest.approx(1.2)
    assert not targets[(SMALL, "inductor+graph", "time")]["met"]  # target 0.85
    assert targets[(SMALL, "reduce-overhead", "time")]["met"]  # 0.6 <= 0.85
    assert targets[(SMALL, "reduce-overhead", "time")]["limit"] == 0.85
    assert targets[(LARGE, "inductor+graph", "time")]["met"]  # 0.95 <= 1.0
    # memory: against each stock variant measured (only inductor+graph on LARGE)
    assert targets[(SMALL, "reduce-overhead", "memory")]["met"]  # 0.9 <= 1.0
    large = targets[(LARGE, "inductor+graph", "memory")]
    assert (large["ratio"], large["limit"], large["met"]) == (pytest.approx(1.2), 0.6, False)
    assert (LARGE, "reduce-overhead", "memory") not in targets
    step_graph = {key: t["met"] for key, t in judged(ROWS, "erase+step-graph").items()}
    assert step_graph == {(LARGE, "inductor+graph", "time"): False,  # 1.05 > 1.00
                          (LARGE, "inductor+graph", "memory"): True}  # 0.5 <= 0.6


def test_the_step_api_targets():
    rows = [
        row(SMALL, "inductor+graph", 1.00), row(SMALL, "inductor+step", 1.01),
        row(SMALL, "erase+step-graph", 0.80), row(SMALL, "erase+step", 0.78, mem=60),
        row(SMALL, "inductor+step+adam", 1.20), row(SMALL, "erase+step+adam", 1.03),
        row(VISION, "inductor+step", 10.0), row(VISION, "erase+step", 10.1),
        row(VISION, "inductor+graph+adam", 10.0), row(VISION, "inductor+step+adam", 10.3),
        row(GPT, "inductor+step", 5.0, mem=100), row(GPT, "erase+step", 4.0, mem=61),
    ]
    step = judged(rows, "erase+step")
    assert step[(SMALL, "inductor+step", "time")]["limit"] == 0.78
    assert step[(SMALL, "inductor+step", "time")]["met"]  # 0.78 / 1.01 = 0.77
    # the step API within 1.02x of the hand capture of the same compiled model
    assert step[(SMALL, "erase+step-graph", "time")]["ratio"] == pytest.approx(0.975)
    assert step[(SMALL, "erase+step-graph", "time")]["met"]
    assert not step[(VISION, "inductor+step", "time")]["met"]  # elsewhere: 1.01 > 1.00
    assert step[(VISION, "inductor+step", "time")]["limit"] == 1.0
    assert step[(GPT, "inductor+step", "time")]["met"]  # 0.8
    assert not step[(GPT, "inductor+step", "memory")]["met"]  # 0.61 > 0.6 on gpt
    assert step[(SMALL, "inductor+step", "memory")]["met"]  # 0.6 <= 1.0 elsewhere
    adam = judged(rows, "erase+step+adam")
    assert adam[(SMALL, "inductor+step+adam", "time")]["limit"] == 0.85
    assert not adam[(SMALL, "inductor+step+adam", "time")]["met"]  # 1.03 / 1.20 = 0.86
    api = judged(rows, "inductor+step")
    assert api[(SMALL, "inductor+graph", "time")]["met"]  # 1.01 <= 1.02
    assert not judged(rows, "inductor+step+adam")[(VISION, "inductor+graph+adam", "time")]["met"]
    # stock variants have no memory target of their own
    assert not [t for t in run.judge_targets(rows)
                if t["measure"] == "memory" and not t["variant"].startswith("erase")]


def test_controls_and_failed_rows_are_not_judged():
    rows = [row(SMALL, "inductor+step", 1.0), row(SMALL, "erase+step/one-stream", 1.5),
            {"config": SMALL, "variant": "erase+step", "error": "RuntimeError: no"}]
    assert run.judge_targets(rows) == []
    assert run.ratio(rows, SMALL, "erase+step", "inductor+step") is None


def test_markdown_has_a_row_per_measurement_the_memory_columns_and_the_verdicts():
    rows = [*ROWS, row(SMALL, "inductor+step", 1.0, mem=80),
            row(SMALL, "erase+step", 0.75, mem=40, captures=1, replays=160,
                uncaptured_reason=None),
            row(VISION, "erase+graphs", 3.0, grad_random=True, tflops=None),
            {"config": VISION, "variant": "erase+step", "error": "RuntimeError: boom"}]
    table = md(rows)
    assert "1. 2026-11-30, NVIDIA H200, torch 2.11.0, native allocator, 7 trials of 20 " \
           "steps: `python -m bench.run`" in table
    header = next(line for line in table.splitlines() if line.startswith("| config |"))
    assert header == "| " + " | ".join(run.COLUMNS) + " |"
    for column in ("peak MiB", "step peak MiB", "kept MiB", "step memory MiB",
                   "memory vs stock", "vs stock"):
        assert column in run.COLUMNS
    assert f"| {SMALL} | erase+graphs | 2026-11-30 | 1 | 1.200 |" in table
    assert "| 1.20x | 0.60x |" in table
    # ratios to the matching stock variants, for time and for memory
    line = next(line for line in table.splitlines() if f"| {SMALL} | erase+graphs |" in line)
    assert "| 0.60x reduce-overhead; 1.20x inductor+graph |" in line
    assert "| 0.90x reduce-overhead; 0.90x inductor+graph |" in line
    assert "| 1000 | 22 | 68 | 90 |" in line  # peak, step peak, kept, step memory (MiB)
    step = next(line for line in table.splitlines() if f"| {SMALL} | erase+step |" in line)
    assert "| 0.75x inductor+step |" in step and "| 0.50x inductor+step |" in step
    assert "captures 1, replays 160 |" in step
    early = run._notes({"captures": 1, "replays": 9, "early_updated": 27,
                        "early_refused": {"autograd copied the early gradient": 15}})
    assert early.endswith("27 parameters updated early (not early: autograd copied the early "
                          "gradient (15))")
    vision = next(line for line in table.splitlines() if f"| {VISION} | erase+graphs |" in line)
    assert "1.0e-03 (random)" in vision and "| - |" in vision
    assert f"| {VISION} | erase+step | 2026-11-30 | 1 | - |" in table
    assert "failed: RuntimeError: boom" in table
    assert all(line.count("|") == len(run.COLUMNS) + 1 for line in table.splitlines()
               if line.startswith(f"| {SMALL}") or line.startswith(f"| {VISION}"))
    assert "| MISSED |" in table and "| met |" in table
    assert (f"| erase+step-graph | {LARGE} | inductor+graph | time | 1.05 | <= 1.00 | MISSED |"
            in table)
    assert (f"| erase+graphs | {LARGE} | inductor+graph | memory | 1.20 | <= 0.60 | MISSED |"
            in table)


def test_markdown_says_what_the_memory_ratio_is_without_cublas_workspaces():
    # stock: 100 MiB with 65 of workspaces; erase: 200 MiB with 131 -> 2.00x whole, 69/35 without
    rows = [row(VISION, "inductor+step", 1.0, mem=100, workspace_bytes=65 * MIB),
            row(VISION, "erase+step", 0.7, mem=200, workspace_bytes=131 * MIB),
            row(SMALL, "inductor+step", 1.0, mem=100),
            row(SMALL, "erase+step", 0.8, mem=150, workspace_bytes=99 * MIB)]
    table = md(rows)
    line = next(line for line in table.splitlines() if f"| {VISION} | erase+step |" in line)
    assert "| 2.00x inductor+step |" in line
    assert "kept has 131 MiB of cuBLAS workspaces, memory without cuBLAS workspaces 1.97x " \
           "inductor+step" in line
    stock = next(line for line in table.splitlines() if f"| {VISION} | inductor+step |" in line)
    assert "without cuBLAS" not in stock
    # no figure where the stock row does not say what its workspaces were
    small = next(line for line in table.splitlines() if f"| {SMALL} | erase+step |" in line)
    assert "without cuBLAS" not in small
    # the verdict still judges the whole figure
    memory = next(t for t in run.judge_targets(rows)
                  if t["config"] == VISION and t["measure"] == "memory")
    assert memory["ratio"] == pytest.approx(2.0)


def test_markdown_reads_results_written_before_the_memory_columns():
    old = {"config": SMALL, "variant": "erase+graphs", "ms_median": 1.0, "ms_min": 1.0,
           "ms_max": 1.0, "peak_mem_bytes": 10 * MIB, "compile_s": 1.0,
           "grad_max_rel_err": 1e-3, "tflops": 1.0}
    table = run.markdown(run.stamped([old], META), [])
    assert f"| {SMALL} | erase+graphs | 2026-11-30 | 1 | 1.000 |" in table
    assert "| 10 | - | - | - |" in table


def test_a_run_replaces_its_rows_in_the_table_and_the_others_keep_theirs(tmp_path):
    """The current table (step.json): files taken in order, as runs; a row measured again
    replaces the row of its config, variant, GPU and allocator; the rest stay, each with its
    run's date and command; legacy names map to today's."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"meta": META, "rows": ROWS}))
    from bench.harness import LEGACY_NAMES

    old_name = next(old for old, new in LEGACY_NAMES.items() if new == "erase+step-graph")
    later = dict(META, date="2026-12-01", command="python -m bench.run --configs later")
    again = [row(LARGE, "inductor+graph", 10.0), dict(ROWS[7], variant=old_name, ms_median=9.0)]
    second.write_text(json.dumps({"meta": later, "rows": again}))
    out = tmp_path / "step.json"
    assert run.main(["--merge", str(first), str(second), "--out", str(out)]) == 0
    rows = {(r["config"], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == len(ROWS)
    assert rows[LARGE, "erase+step-graph"]["ms_median"] == 9.0  # a legacy name, mapped
    assert rows[LARGE, "inductor+graph"]["date"] == "2026-12-01"
    assert rows[SMALL, "erase+graphs"]["command"] == "python -m bench.run"
    # ratios stay those of each row's own run: erase+graphs was measured against its
    # inductor+graph (20 ms), not the later run's (10 ms)
    assert run.ratio(list(rows.values()), LARGE, "erase+graphs", "inductor+graph") == (
        pytest.approx(19.0 / 20.0))
    assert run.ratio(list(rows.values()), LARGE, "erase+step-graph", "inductor+graph") == (
        pytest.approx(9.0 / 10.0))
    table = out.with_suffix(".md").read_text()
    assert (f"| {LARGE} | erase+graphs | 2026-11-30 | 1 | 19.000 | 19.000 | 19.000 | 0.95x |"
            in table)
    assert "2. 2026-12-01, NVIDIA H200" in table
    assert "`python -m bench.run --configs later`" in table
    # another GPU or another allocator: rows of their own
    other = dict(META, gpu="NVIDIA A100")
    second.write_text(json.dumps({"meta": other, "rows": [ROWS[0]]}))
    asynchronous = dict(META, allocator="cudaMallocAsync")
    first.write_text(json.dumps({"meta": asynchronous, "rows": [ROWS[0]]}))
    assert run.main(["--merge", str(second), str(first), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())["rows"]
    assert len(merged) == len(ROWS) + 2
    assert {(r["gpu"], r["allocator"]) for r in merged if r["variant"] == "inductor"
            and r["config"] == SMALL} == {("NVIDIA H200", "native"), ("NVIDIA A100", "native"),
                                           ("NVIDIA H200", "cudaMallocAsync")}


def test_main_rejects_unknown_configs_and_variants_before_touching_a_gpu(capsys):
    assert run.main(["--configs", "gpt:8:100:64:2"]) == 2  # d not a multiple of 64
    assert "multiple of 64" in capsys.readouterr().err
    assert run.main(["--configs", "resnet:1:2"]) == 2
    assert "tv-resnet18-dgl" in capsys.readouterr().err
    assert run.main(["--variants", "inductor+graphs"]) == 2
    assert "does not apply to inductor" in capsys.readouterr().err


def test_the_sweep_adds_controls_of_the_erase_forms_asked_for():
    args = SimpleNamespace(sweep_configs="mlp:128:2000:2000:4", streams="1,2")
    variants = ["inductor+step", "erase+graphs", "erase+step"]
    assert run.variants_for(SMALL, variants, args) == [
        *variants, "erase+graphs/streams=1", "erase+graphs/streams=2",
        "erase+graphs/one-stream", "erase+step/one-stream"]
    assert run.variants_for(LARGE, variants, args) == variants
    assert run.variants_for(SMALL, ["erase+step-graph"], args) == [
        "erase+step-graph", "erase+step-graph/one-stream"]


def test_the_default_run_covers_every_variant_and_the_config_groups_parse():
    from bench.harness import Variant
    from bench.models import parse_config

    names = [*run.VARIANTS, *run.ADAM_VARIANTS]
    assert {"inductor+step", "erase+step", "inductor+step+adam", "erase+step+adam",
            "inductor+graph+adam", "inductor+graph", "erase+step-graph"} <= set(names)
    assert [str(Variant.parse(n)) for n in names] == names
    for text in (*run.CONFIGS, *run.GPT_CONFIGS, *run.MEMORY_CONFIGS, *run.VISION_CONFIGS):
        assert str(parse_config(text)) == text
    assert set(run.GPT_CONFIGS) == {"gpt:8:768:1024:6", "gpt:16:384:256:8"}
    assert all(run.is_memory_config(c) for c in run.MEMORY_CONFIGS)


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


# -- issue 13: never slower than stock, within 1.02x where nothing runs early ------------

PLAIN, DGL, GOOGLENET = "tv-resnet18:256:32", "tv-mobilenet-dgl:256:64", "tv-googlenet-aux:128:64"


def verdicts(rows, variant, config, vs):
    """{limit: (met, why)} of the time targets of ``variant`` against ``vs`` on ``config``."""
    return {t["limit"]: (t["met"], t["why"]) for t in run.judge_targets(rows)
            if (t["variant"], t["config"], t["vs"], t["measure"]) == (variant, config, vs, "time")}


def test_a_config_without_early_blocks_is_held_to_1_02_and_one_with_them_to_1_00():
    rows = [row(PLAIN, "inductor+step", 10.0), row(PLAIN, "erase+step", 10.1, early_blocks=0),
            row(DGL, "inductor+step", 10.0), row(DGL, "erase+step", 10.1, early_blocks=4)]
    plain = verdicts(rows, "erase+step", PLAIN, "inductor+step")
    assert list(plain) == [1.02] and plain[1.02][0]  # 1.01 <= 1.02: met
    assert "no early block" in plain[1.02][1]
    early = verdicts(rows, "erase+step", DGL, "inductor+step")
    assert list(early) == [1.00] and not early[1.00][0]  # 1.01 > 1.00: missed
    assert early[1.00][1] == "4 early block(s): never slower"
    # a row that does not record its early blocks (an older results file) gets the strict limit
    older = [dict(r) for r in rows]
    for r in older:
        r.pop("early_blocks", None)
    assert verdicts(older, "erase+step", PLAIN, "inductor+step") == {
        1.00: (False, "early blocks not recorded: never slower")}
    # the verdicts say which early blocks they were judged on
    assert {t["config"]: t["early_blocks"] for t in run.judge_targets(rows)
            if t["vs"] == "inductor+step"} == {PLAIN: 0, DGL: 4}


def test_the_detached_resnet_is_held_to_0_78_under_the_step_api():
    config = "tv-resnet18-dgl:256:32"
    rows = [row(config, "inductor+step", 10.0), row(config, "erase+step", 8.0, early_blocks=3)]
    found = verdicts(rows, "erase+step", config, "inductor+step")
    assert {limit: met for limit, (met, _) in found.items()} == {0.78: False, 1.00: True}
    rows[1]["ms_median"] = 7.8
    assert all(met for met, _ in verdicts(rows, "erase+step", config, "inductor+step").values())


def test_erase_against_inductor_and_its_graphs_against_reduce_overhead_are_judged():
    rows = [row(PLAIN, "inductor", 10.0), row(PLAIN, "erase", 10.15, early_blocks=0),
            row(PLAIN, "reduce-overhead", 2.0), row(PLAIN, "erase+graphs", 2.06, early_blocks=0),
            row(GOOGLENET, "inductor", 10.0), row(GOOGLENET, "erase", 9.9, early_blocks=2),
            row(GOOGLENET, "reduce-overhead", 2.0),
            row(GOOGLENET, "erase+graphs", 2.02, early_blocks=2),
            row(SMALL, "inductor", 10.0), row(SMALL, "erase", 9.0, early_blocks=3)]
    assert verdicts(rows, "erase", PLAIN, "inductor") == {
        1.02: (True, "no early block: stock Inductor, within 1.02x")}  # 1.015
    assert verdicts(rows, "erase+graphs", PLAIN, "reduce-overhead") == {
        1.02: (False, "no early block: stock Inductor, within 1.02x")}  # 1.03
    assert verdicts(rows, "erase", GOOGLENET, "inductor") == {
        1.00: (True, "2 early block(s): never slower")}  # 0.99
    assert verdicts(rows, "erase+graphs", GOOGLENET, "reduce-overhead") == {
        1.00: (False, "2 early block(s): never slower")}  # 1.01
    assert verdicts(rows, "erase", SMALL, "inductor") == {1.00: (True, "3 early block(s): "
                                                                 "never slower")}
    # only where both rows exist: no reduce-overhead row, no verdict
    assert verdicts(rows[:2] + rows[3:4], "erase+graphs", PLAIN, "reduce-overhead") == {}
    # the small chains keep their own, stricter, graph targets
    small = [row(SMALL, "reduce-overhead", 2.0), row(SMALL, "erase+graphs", 1.6, early_blocks=3)]
    assert verdicts(small, "erase+graphs", SMALL, "reduce-overhead") == {
        0.85: (True, "small chain")}


def test_the_targets_table_says_which_limit_applies_and_why():
    rows = [row(PLAIN, "inductor+step", 10.0), row(PLAIN, "erase+step", 10.1, early_blocks=0,
                                                     erase_graphs=1, erase_fallback=None),
            row(DGL, "inductor+step", 10.0), row(DGL, "erase+step", 10.1, early_blocks=4,
                                                 erase_graphs=2, erase_fallback=None)]
    table = md(rows)
    assert "| variant | config | against | measure | ratio | target | | why | date |" in table
    assert (f"| erase+step | {PLAIN} | inductor+step | time | 1.01 | <= 1.02 | met | "
            "no early block: stock Inductor, within 1.02x |") in table
    assert (f"| erase+step | {DGL} | inductor+step | time | 1.01 | <= 1.00 | MISSED | "
            "4 early block(s): never slower |") in table
    line = next(line for line in table.splitlines() if f"| {DGL} | erase+step |" in line)
    assert "early blocks 4 in 2 graph(s)" in line
    assert all(line.count("|") == 10 for line in table.splitlines()
               if line.startswith("| erase+step |"))


def test_a_row_records_the_early_blocks_of_its_compiled_program():
    import erase_fx
    from bench.harness import Variant
    from bench.models import ChainConfig, DetachedChain, make_inputs

    cfg = ChainConfig.parse("mlp:8:16:32:3")
    reports = erase_fx.explain(DetachedChain(cfg), *make_inputs(cfg, torch.device("cpu")))
    erase_step = Variant.parse("erase+step")
    assert run.early_info(erase_step, reports) == {
        "early_blocks": 2, "erase_graphs": 1, "erase_fallback": None}  # the last block stays
    # a graph compiled again counts its blocks once; a graph on the stock path has none
    again = run.early_info(erase_step, [*reports, *reports])
    assert (again["early_blocks"], again["erase_graphs"]) == (2, 2)
    fell_back = run.early_info(erase_step, [reports[0].with_fallback("compile failed: no")])
    assert fell_back == {"early_blocks": 0, "erase_graphs": 1,
                         "erase_fallback": "compile failed: no"}
    assert run.early_info(Variant.parse("inductor+step"), reports) == {}


def test_device_run_runs_the_judged_vision_pairs_first_and_has_the_issue_13_part():
    import re
    import subprocess
    from pathlib import Path

    script = Path(run.__file__).with_name("device_run.sh")
    text = script.read_text()

    def listed(name):
        return ",".join(re.findall(rf"^{name}\+?=,?(\S+)$", text, re.M)).split(",")

    assert listed("ISSUE13") == ["inductor+step", "erase+step", "reduce-overhead",
                                 "erase+graphs", "erase+step/one-stream"]
    part = re.search(r"^  vision-e\)\n(.*?);;", text, re.M | re.S).group(1)
    assert "tv-googlenet-aux:128:64,tv-mobilenet-dgl:256:64" in part and '"$ISSUE13"' in part
    assert "--trials 5 --steps-per-trial 20" in part
    for name in listed("ISSUE13"):
        run.Variant.parse(name)
    # the usage text is the whole header, the new part included
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "vision-e" in usage.stdout
    assert "#   python -m bench.paper.report\n" in usage.stdout
    assert usage.stdout.rstrip().endswith("`git log -p bench/device_run.sh`\n# has them.")
    # every part updates the current tables: nothing of its own into $OUT but traces and code
    assert not re.search(r'(--out|--results-dir|--out-dir|tee( -a)?) "\$OUT', text)
