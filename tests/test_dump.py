"""dump_dir: numbered pass files per graph, the report, and no paths or addresses inside."""
import json
import re

import pytest
import torch

from erase_fx.instruments import TIMINGS_FILE, pydot_available, read_dumped_report
from graphs import Chain, chain_inputs


def dump(tmp_path, name):
    folder = tmp_path / name
    model = Chain(3)
    compiled = torch.compile(model, backend="erase",
                             options={"inner": "aot_eager", "dump_dir": str(folder)})
    compiled(*chain_inputs()).backward()
    return folder


def test_dump_has_one_numbered_file_per_pass_in_pipeline_order(tmp_path):
    folder = dump(tmp_path, "a")
    (graph,) = list(folder.iterdir())
    names = sorted(p.name for p in graph.iterdir())
    stems = [n.split(".")[0] for n in names if n[0].isdigit()]
    assert sorted(set(stems)) == [
        "00_joint", "01_merge_common_subexpressions", "02_find_stop_gradient_blocks",
        "03_schedule_early_backward", "04_partition_joint_graph",
        "05_copy_input_values_per_block", "06_assign_streams", "07_recompute_boundary_values",
        "08_split_segments", "09_bwd", "10_defer_grad_scaling",
    ]
    assert {"report.json", "timings.json"} <= set(names)
    assert ("schedule.dot" in names) == pydot_available()
    report = read_dumped_report(graph)
    assert len(report.blocks) == 2 and report.graph_id == int(graph.name.split("_")[1])


def test_each_py_file_opens_with_its_step_pass_and_position(tmp_path):
    (graph,) = list(dump(tmp_path, "h").iterdir())
    header = (graph / "03_schedule_early_backward.py").read_text().splitlines()[:4]
    assert header == [
        "# erase_fx dump, step 03 of this graph's pipeline: pass schedule_early_backward",
        "# pipeline so far: joint > merge_common_subexpressions > find_stop_gradient_blocks > "
        "schedule_early_backward",
        "# this file: the module the pass returned",
        "# time taken: see timings.json (kept out of this file so that two dumps diff clean)",
    ]
    joint = (graph / "00_joint.py").read_text()
    assert joint.startswith(
        "# erase_fx dump, step 00 of this graph's pipeline: joint (a recorded value, not a pass)\n")
    bwd = (graph / "04_partition_joint_graph.bwd.py").read_text()
    assert "# this file: the backward module\n" in bwd
    segment = next(graph.glob("08_split_segments.seg_1_*.py"))
    assert f"# this file: segment {segment.name.split('.')[1]} of the split module\n" in (
        segment.read_text())
    for path in graph.glob("*.py"):
        assert path.read_text().startswith("# erase_fx dump, step "), path.name


def test_timings_are_in_their_own_file_not_in_the_headers(tmp_path):
    (graph,) = list(dump(tmp_path, "t").iterdir())
    timings = json.loads((graph / "timings.json").read_text())
    assert timings["unit"] == "seconds"
    assert [t["pass"] for t in timings["passes"]] == [
        "merge_common_subexpressions", "find_stop_gradient_blocks", "schedule_early_backward",
        "partition_joint_graph",
        "copy_input_values_per_block", "assign_streams", "recompute_boundary_values",
        "split_segments", "defer_grad_scaling",
    ]
    assert [t["step"] for t in timings["passes"]] == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert all(t["seconds"] >= 0 for t in timings["passes"])
    assert timings["total"] == pytest.approx(sum(t["seconds"] for t in timings["passes"]),
                                             abs=1e-5)
    for path in graph.glob("*.py"):
        assert not re.search(r"\d+(\.\d+)? ?(ms|s|seconds)\b", path.read_text().split(
            "class ", 1)[0]), path.name


def test_dump_files_hold_no_paths_or_addresses(tmp_path):
    folder = dump(tmp_path, "b")
    for path in folder.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert str(tmp_path) not in text
            assert not re.search(r"0x[0-9a-f]{6,}", text), path.name
            assert "/site-packages/" not in text and "# File:" not in text, path.name


def test_two_dumps_of_one_model_are_byte_identical_but_for_timings(tmp_path):
    # NB: graph_<n> counts graphs per process, so compare the folders' contents.
    (first,) = list(dump(tmp_path, "first").iterdir())
    torch._dynamo.reset()
    (second,) = list(dump(tmp_path, "second").iterdir())
    assert first.name != second.name
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert len(names) > 10
    for name in names:
        if name != TIMINGS_FILE:
            assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_node_comments_say_which_nodes_are_a_stage_and_which_run_after_the_join(tmp_path):
    folder = tmp_path / "stages"
    compiled = torch.compile(Chain(3), backend="erase", options={
        "inner": "aot_eager", "dump_dir": str(folder), "tuning": {"stages_on_side": True}})
    compiled(*chain_inputs()).backward()
    (graph,) = list(folder.iterdir())
    notes = [line for line in (graph / "06_assign_streams.py").read_text().splitlines()
             if line.startswith("#   ")]
    stage = [line for line in notes if line.endswith(" stage")]
    assert stage and all("role=forward" in line and "stream=0" not in line for line in stage)
    after_join = [line for line in notes if line.endswith(" after_join")]
    assert after_join and all("stream=0" in line for line in after_join)
