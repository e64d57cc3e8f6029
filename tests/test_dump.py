"""dump_dir: numbered pass files per graph, the report, and no paths or addresses inside."""
import json
import re

import torch

import erase_fx
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
        "00_joint", "01_find_stop_gradient_blocks", "02_schedule_early_backward",
        "03_partition_joint_graph", "04_assign_streams", "05_split_segments", "06_bwd",
    ]
    assert "report.json" in names
    report = erase_fx.GraphReport.from_dict(json.loads((graph / "report.json").read_text()))
    assert len(report.blocks) == 2
    assert (graph / "02_schedule_early_backward.py").read_text().startswith(
        "# erase_fx: schedule_early_backward\n")


def test_dump_files_hold_no_paths_or_addresses(tmp_path):
    folder = dump(tmp_path, "b")
    for path in folder.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert str(tmp_path) not in text
            assert not re.search(r"0x[0-9a-f]{6,}", text), path.name
            assert "/site-packages/" not in text and "# File:" not in text, path.name
