"""Instruments: what runs around each pass (the passes themselves never log, time or write).

`PassRunner.run(name, fn, *args)` calls ``before_pass`` / ``after_pass`` on
every instrument. `TimingInstrument` keeps how long each pass took (for the
log); `DumpInstrument` writes numbered, diffable files of each pass's result
into ``<dump_dir>/graph_<n>/``::

    00_joint.py                      the joint graph AOTAutograd traced
    01_find_stop_gradient_blocks.json the blocks and rejected components
    02_schedule_early_backward.py    the rewritten joint graph
    03_partition_joint_graph.fwd.py  the forward and backward modules
    03_partition_joint_graph.bwd.py
    04_assign_streams.py             the forward, with streams in comments
    05_split_segments.py             the split module, then one file per segment
    05_split_segments.seg_<k>_....py
    report.json                      the GraphReport

Files hold no paths, ids or addresses, so two dumps of one model diff clean.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch.fx as fx

from erase_fx.passes import BlockAnalysis, PassResult, SegmentedForward, get_meta
from erase_fx.report import GraphReport

log = logging.getLogger("erase_fx")


class Instrument(Protocol):
    def before_pass(self, name: str, args: tuple[Any, ...]) -> None: ...

    def after_pass(self, name: str, result: Any, seconds: float) -> None: ...


class PassRunner:
    """Runs passes with the instruments around them."""

    def __init__(self, instruments: list[Instrument]):
        self.instruments = instruments

    def run(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        for instrument in self.instruments:
            instrument.before_pass(name, args)
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        seconds = time.perf_counter() - start
        for instrument in self.instruments:
            instrument.after_pass(name, result, seconds)
        return result

    def record(self, name: str, result: Any) -> None:
        """Show the instruments a value that no pass produced (the input joint graph)."""
        for instrument in self.instruments:
            instrument.after_pass(name, result, 0.0)


class TimingInstrument:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def before_pass(self, name: str, args: tuple[Any, ...]) -> None:
        pass

    def after_pass(self, name: str, result: Any, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


class DumpInstrument:
    """Writes each pass's result into ``<dump_dir>/graph_<n>/``."""

    def __init__(self, dump_dir: str | os.PathLike, graph_id: int):
        self.folder = Path(dump_dir) / f"graph_{graph_id}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.index = 0

    def before_pass(self, name: str, args: tuple[Any, ...]) -> None:
        pass

    def after_pass(self, name: str, result: Any, seconds: float) -> None:
        stem = f"{self.index:02d}_{name}"
        self.index += 1
        for suffix, text in _render(result):
            header = f"# erase_fx: {name}\n" if suffix.endswith(".py") else ""
            (self.folder / f"{stem}{suffix}").write_text(header + text)

    def write_report(self, report: GraphReport) -> None:
        (self.folder / "report.json").write_text(report.to_json() + "\n")


def _render(result: Any) -> list[tuple[str, str]]:
    if isinstance(result, SegmentedForward):
        files = [(".py", _graph_text(result.gm))]
        for segment in result.segments:
            files.append((f".{segment.name}.py", _graph_text(getattr(result.gm, segment.name))))
        files.append((".segments.json", json.dumps(
            [dataclasses.asdict(s) for s in result.segments], indent=2) + "\n"))
        return files
    if isinstance(result, PassResult):
        return [(".py", _graph_text(result.gm))]
    if isinstance(result, fx.GraphModule):
        return [(".py", _graph_text(result))]
    if isinstance(result, tuple) and all(isinstance(r, fx.GraphModule) for r in result):
        return [(".fwd.py", _graph_text(result[0])), (".bwd.py", _graph_text(result[1]))]
    if isinstance(result, BlockAnalysis):
        return [(".json", json.dumps(dataclasses.asdict(result), indent=2, default=str) + "\n")]
    return [(".txt", repr(result) + "\n")]


def _graph_text(gm: fx.GraphModule) -> str:
    """The module's code, with each node's erase_fx decision as a comment."""
    code = gm.print_readable(print_output=False, include_stride=False)
    # NB: source-location comments hold absolute paths; dumps must diff clean.
    lines = [line for line in code.splitlines() if not line.lstrip().startswith("# File:")]
    notes = []
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if meta is not None and (meta.block is not None or meta.stream or meta.waits_for):
            notes.append(
                f"#   {node.name}: role={meta.role.value} block={meta.block} "
                f"stream={meta.stream} waits_for={list(meta.waits_for)}"
            )
    if notes:
        lines.append("# erase_fx node decisions:")
        lines.extend(notes)
    return "\n".join(lines) + "\n"
