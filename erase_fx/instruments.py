"""Instruments: what runs around each pass (the passes themselves never log, time or write).

The pass lists' driver (`erase_fx.passes.run_passes`) runs each pass through
`PassRunner.run(name, fn, *args)`, which calls ``before_pass`` / ``after_pass``
on every instrument; `PassRunner.record(name, gm)` shows them a module no pass
produced (the joint graph AOTAutograd traced, the backward it partitioned).
`TimingInstrument` keeps how long each pass took (for the log);
`DumpInstrument` writes numbered, diffable files of each step's result (a
pass's `PassResult` renders its own: `PassResult.render`) into
``<dump_dir>/graph_<n>/``::

    00_joint.py                       the joint graph AOTAutograd traced
    01_merge_common_subexpressions.py the joint graph, its tangent-free repeats merged
    02_find_stop_gradient_blocks.json the blocks and rejected components
    03_schedule_early_backward.py     the rewritten joint graph
    04_partition_joint_graph.fwd.py   the forward and backward modules
    04_partition_joint_graph.bwd.py
    05_copy_input_values_per_block.py the forward, large input-only values copied per block
    06_assign_streams.py              the forward, with streams in comments
    07_recompute_boundary_values.py   the forward, block segments' cheap boundary values recomputed
    08_split_segments.py              the split module, then one file per segment
    08_split_segments.seg_<k>_....py
    08_split_segments.segments.json
    09_bwd.py                         the backward AOT hands over (at the first backward)
    10_defer_grad_scaling.py          the backward as compiled: early grads unscaled, scales last
    report.json                       the GraphReport (but its graph_id: the folder's name)
    timings.json                      how long each pass took
    schedule.dot                      the forward after assign_streams, drawn (needs pydot)
    schedule.svg                      the same, rendered (when Graphviz's dot is on the PATH)

Each ``.py`` file opens with a provenance header (`provenance_header`): the
step's name, whether it is a pass or a recorded value, its position in the
pipeline and the steps before it, and which part of the result the file
holds. JSON has no comments, so the ``.json`` files carry no header; their
names give the step and pass.

``schedule.dot`` is `erase_fx.schedule_picture.schedule_dot` of the
forward after ``assign_streams``: nodes coloured by stream, clustered by
block, early-backward nodes as boxes, cross-stream syncs dashed, parameters
labelled with their qualified names (`param_names_by_input`, from the
analysis). Without ``pydot`` (``pip install erase-fx[viz]``) it is skipped with one INFO line;
without Graphviz's ``dot`` binary there is no ``schedule.svg``
(``dot -Tsvg schedule.dot -o schedule.svg`` renders it elsewhere).

Each text file is also a ``torch._logging.trace_structured`` artifact named
``erase_fx_graph_<n>_<file>`` (``timings.json`` with the report, then again
after each backward pass), so ``TORCH_TRACE=dir`` runs show them in
``tlparse``. `dump_instrument_for`
makes a trace-only instrument (no files) when a structured trace is on but
no ``dump_dir`` is set.

Two dumps of one model diff clean, file by file: files hold no paths, ids,
addresses or times. NB: that is why the time each pass took is not in the
headers but in ``timings.json``, the one file that differs between runs.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch._logging
import torch.fx as fx

from erase_fx.passes import BlockAnalysis, DumpFile, PassResult
from erase_fx.passes.pass_result import graph_text
from erase_fx.passes.graph import primals
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


def dump_instrument_for(dump_dir: str | os.PathLike | None, graph_id: int) -> DumpInstrument | None:
    """The dump of one graph: files when ``dump_dir`` is set, trace artifacts when tracing.

    None when there is neither a ``dump_dir`` nor a structured trace: nothing
    is rendered then.
    """
    if dump_dir is None and not structured_trace_enabled():
        return None
    return DumpInstrument(dump_dir, graph_id)


class DumpInstrument:
    """Writes each step's result into ``<dump_dir>/graph_<n>/``; see the module docstring.

    With ``dump_dir=None`` it writes no file and only emits the trace artifacts.
    """

    def __init__(self, dump_dir: str | os.PathLike | None, graph_id: int):
        self.graph_id = graph_id
        self.folder_name = f"graph_{graph_id}"
        self.folder = Path(dump_dir) / self.folder_name if dump_dir is not None else None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        self.steps: list[str] = []
        self.timings: list[dict[str, Any]] = []
        self._running: str | None = None
        self._reported = False
        #: the joint graph's primal inputs, by name, in order; then the
        #: parameters' qualified names by input name, for the picture's labels
        self._primals: list[str] = []
        self._param_names: dict[str, str] = {}

    def before_pass(self, name: str, args: tuple[Any, ...]) -> None:
        self._running = name

    def after_pass(self, name: str, result: Any, seconds: float) -> None:
        # NB: `PassRunner.record` calls after_pass without before_pass: a
        # recorded value (the joint graph, the backward), not a pass.
        is_pass = self._running == name
        self._running = None
        step = len(self.steps)
        self.steps.append(name)
        stem = step_stem(step, name)
        for file in _files_of(result, name):
            text = file.text
            if file.suffix.endswith((".py", ".txt")):
                text = provenance_header(step, name, is_pass, self.steps, file.part) + text
            self._write(stem + file.suffix, text)
        if is_pass:
            self.timings.append({"step": step, "pass": name, "seconds": round(seconds, 6)})
            # NB: backward passes run after the report: their timings are traced again.
            self._write(TIMINGS_FILE, timings_json(self.timings), emit=self._reported)
        if name == "joint" and isinstance(result, fx.GraphModule):
            self._primals = [node.name for node in primals(result.graph)]
        if isinstance(result, PassResult) and isinstance(result.artifact, BlockAnalysis):
            self._param_names = param_names_by_input(self._primals, result.artifact)
        if name == SCHEDULE_PASS and isinstance(result, PassResult):
            self._write_schedule(result.gm, step)

    def write_report(self, report: GraphReport) -> None:
        self._reported = True
        self._write(REPORT_FILE, dumped_report_json(report))
        # NB: timings.json is rewritten after each pass; trace it once, here.
        if self.timings:
            self._emit(TIMINGS_FILE, timings_json(self.timings))

    def _write_schedule(self, gm: fx.GraphModule, step: int) -> None:
        if not pydot_available():
            log.info("erase_fx dump: pydot is not installed (pip install erase-fx[viz]), so no "
                     "%s in %s", SCHEDULE_DOT_FILE, self.folder_name)
            return
        from erase_fx.schedule_picture import render_svg, schedule_dot

        text = schedule_header(step) + schedule_dot(gm, self._param_names).to_string()
        self._write(SCHEDULE_DOT_FILE, text)
        if self.folder is None:
            return
        try:
            svg = render_svg(text)
        except (OSError, subprocess.SubprocessError) as error:
            # NB: a picture is not worth failing a compilation over.
            detail = getattr(error, "stderr", None) or b""
            log.warning("erase_fx dump: Graphviz's dot failed on %s/%s, so no %s: %s %s",
                        self.folder_name, SCHEDULE_DOT_FILE, SCHEDULE_SVG_FILE, error,
                        detail.decode(errors="replace").strip())
            return
        if svg is not None:
            (self.folder / SCHEDULE_SVG_FILE).write_bytes(svg)

    def _write(self, file_name: str, text: str, emit: bool = True) -> None:
        if self.folder is not None:
            (self.folder / file_name).write_text(text)
        if emit:
            self._emit(file_name, text)

    def _emit(self, file_name: str, text: str) -> None:
        emit_artifact(artifact_name(self.folder_name, file_name), text)


def param_names_by_input(primal_inputs: list[str], analysis: BlockAnalysis) -> dict[str, str]:
    """``{"primals_1": "stages.0.body.0.weight", ...}``: the parameters the analysis names.

    ``primal_inputs`` are the joint graph's primal input names in order: a
    component's ``grad_outputs`` hold primal indices, its ``params`` the
    qualified names of the same primals, in index order.
    """
    names = {}
    components = [(b.component, b.params) for b in analysis.blocks]
    components += [(r.component, r.params) for r in analysis.rejected]
    for component, params in components:
        for (index, _), param in zip(sorted(component.grad_outputs), params):
            if index < len(primal_inputs):
                names[primal_inputs[index]] = param
    return names


def artifact_name(folder_name: str, file_name: str) -> str:
    """``erase_fx_graph_0_03_schedule_early_backward.py``: a dump file's name in the trace."""
    return f"erase_fx_{folder_name}_{file_name}"


def emit_artifact(name: str, text: str) -> None:
    """One ``trace_structured`` artifact (a no-op unless a structured trace is on)."""
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=lambda: text,
    )


def structured_trace_enabled() -> bool:
    """Whether torch's structured trace (``TORCH_TRACE``, read by tlparse) has a handler.

    NB: torch checks the same (``trace_log.handlers``) before it logs anything.
    """
    trace_log = getattr(torch._logging._internal, "trace_log", None)
    return bool(trace_log is not None and trace_log.handlers)


#: The one dump file that differs between two runs of the same model.
TIMINGS_FILE = "timings.json"
REPORT_FILE = "report.json"
#: The pass whose result `schedule_dot` draws: streams assigned, not yet split.
SCHEDULE_PASS = "assign_streams"
SCHEDULE_DOT_FILE = "schedule.dot"
SCHEDULE_SVG_FILE = "schedule.svg"


def pydot_available() -> bool:
    """Whether the optional ``pydot`` (the ``viz`` extra) can be imported."""
    try:
        import pydot  # noqa: F401
    except ImportError:
        return False
    return True


def schedule_header(step: int) -> str:
    """The DOT comment ``schedule.dot`` opens with."""
    return (
        f"// erase_fx dump: the forward after {SCHEDULE_PASS} (step {step:02d}), drawn\n"
        f"// render: dot -Tsvg {SCHEDULE_DOT_FILE} -o {SCHEDULE_SVG_FILE}\n"
    )


def dumped_report_json(report: GraphReport) -> str:
    """``report.json``: the report without its ``graph_id``.

    NB: the graph id counts graphs per process (the folder's name,
    ``graph_<n>``, holds it); in the file it would make two dumps of one
    model differ. `read_dumped_report` puts it back.
    """
    data = report.to_dict()
    del data["graph_id"]
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def read_dumped_report(graph_folder: str | os.PathLike) -> GraphReport:
    """The `GraphReport` of a dumped ``graph_<n>/`` folder, its id taken from the folder name."""
    folder = Path(graph_folder)
    graph_id = int(folder.name.rpartition("_")[2])
    data = json.loads((folder / REPORT_FILE).read_text())
    return GraphReport.from_dict({**data, "graph_id": graph_id})


def step_stem(step: int, name: str) -> str:
    """``03_schedule_early_backward``: the file name of a step's result, without suffix."""
    return f"{step:02d}_{name}"


def provenance_header(
    step: int, name: str, is_pass: bool, steps_so_far: list[str], part: str
) -> str:
    """The comment block a dumped ``.py`` file opens with: what made it, and where.

    Holds no time, path, id or address, so the file is the same in every run.
    """
    what = f"pass {name}" if is_pass else f"{name} (a recorded value, not a pass)"
    return (
        f"# erase_fx dump, step {step:02d} of this graph's pipeline: {what}\n"
        f"# pipeline so far: {' > '.join(steps_so_far)}\n"
        f"# this file: {part}\n"
        f"# time taken: see {TIMINGS_FILE} (kept out of this file so that two dumps diff clean)\n"
    )


def timings_json(timings: list[dict[str, Any]]) -> str:
    """``timings.json``: seconds per pass, in pipeline order, and their total."""
    total = round(sum(t["seconds"] for t in timings), 6)
    return json.dumps({"unit": "seconds", "passes": timings, "total": total}, indent=2) + "\n"


#: What the values `PassRunner.record` shows the instruments are, for the headers.
RECORDED_VALUES = {
    "joint": "the joint forward+backward graph AOTAutograd traced",
    "bwd": "the backward module, as compiled at the first backward",
}


def _files_of(result: Any, name: str) -> tuple[DumpFile, ...]:
    """The dump files of one step: a pass's result renders its own; a recorded module is
    its code."""
    if isinstance(result, PassResult):
        return result.render()
    return (DumpFile(".py", RECORDED_VALUES.get(name, "the module"), graph_text(result)),)
