"""Helpers shared by the paper reproductions (``bench/paper/*.py``).

- seeding (`seed_everything`; `build_seeded`, from `erase_fx._training`);
- per-step timing (`StepTimer`: CUDA events on a GPU, ``perf_counter`` on
  the CPU) and throughput statistics (`throughput_stats`: median, p90, p10
  of per-step QPS);
- normalized entropy (`normalized_entropy`, `binary_entropy`) and `mlp`, from
  `erase_fx._training`, the one copy the installed demo uses too;
- the variants the experiments compare (`compile_variant`,
  `capture_erase_warnings`, `compile_summary`, `compiled_notes`,
  `variant_failed`, `print_compiled`) and the command-line flags they share
  (`add_erase_arguments`);
- the results contract (`validate_results`, `write_results`, `run_meta`,
  `table`): every experiment writes one JSON file,
  ``<results_dir>/<name>.json``, that `bench.paper.report` turns into
  ``REPORT.md``. The contract is documented in ``bench/paper/README.md`` and
  checked here.

Of erase_fx only `erase_fx._training` is imported here (which loads the
package); the variants compile with ``backend="erase"`` by name.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

# NB: the one copy of these, shared with the installed demo; re-exported for bench/paper.
from erase_fx._training import (  # noqa: F401
    binary_entropy,
    build_seeded,
    mlp,
    normalized_entropy,
)

#: The repository root (``bench/paper/common.py`` -> three levels up).
REPO_ROOT = Path(__file__).resolve().parents[2]
#: Where the experiments write their JSON and `bench.paper.report` its report.
DEFAULT_RESULTS_DIR = REPO_ROOT / "bench" / "results" / "paper"

#: Top-level keys every results JSON has (see README.md, "Results contract").
REQUIRED_KEYS = ("title", "meta", "tables", "figures", "paper_comparison")
#: Keys of ``meta``.
META_KEYS = ("date", "torch", "device", "command")
#: Keys of one ``tables`` entry.
TABLE_KEYS = ("caption", "columns", "rows")
#: Keys of one ``figures`` entry.
FIGURE_KEYS = ("file", "caption")
#: Keys of one ``paper_comparison`` entry.
COMPARISON_KEYS = ("claim", "paper", "erase_fx", "verdict")
#: The verdicts a comparison may give.
VERDICTS = ("better", "equal", "worse", "not comparable")
#: Figure kinds `bench.paper.report` can draw from data (``"kind"`` of a figure).
FIGURE_KINDS = ("line", "bar")


# -- seeding -------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's (CPU and every GPU) random number generators."""
    random.seed(seed)
    torch.manual_seed(seed)


# -- timing ----------------------------------------------------------------------


class StepTimer:
    """Times each training step: CUDA events on a GPU, ``perf_counter`` on the CPU.

    ``start()`` and ``stop()`` bracket one step. On a GPU the events are
    recorded on the current stream without synchronizing, so timing does not
    stall the CPU's launches; `seconds` synchronizes once and reads them all.
    An event pair measures the step as the GPU sees it: when the CPU launches
    slower than the GPU computes, the GPU waits inside the pair for the
    launches, so launch-bound steps are measured too.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pairs: list[tuple[Any, Any]] = []
        self._open: Any = None

    def start(self) -> None:
        if self.cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self._pairs.append((self._open, end))
        self._open = None

    def seconds(self) -> list[float]:
        """The duration of every step so far, in seconds."""
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) / 1e3 for start, end in self._pairs]
        return [end - start for start, end in self._pairs]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def throughput_stats(step_seconds: Sequence[float], batch: int) -> dict[str, float]:
    """Per-step QPS (``batch / step time``) statistics of the given (already filtered) steps.

    ``p90`` is the 90th percentile of per-step QPS: 90% of steps are slower,
    10% faster (the reading of the paper's "p90 QPS" we use); ``p10`` is the
    10th percentile: 90% of steps are faster than it (the tail). ``median``
    is the 50th percentile. All in samples per second.
    """
    qps = [batch / s for s in step_seconds if s > 0]
    return {
        "median": percentile(qps, 50),
        "p90": percentile(qps, 90),
        "p10": percentile(qps, 10),
        "mean_step_ms": 1e3 * statistics.fmean(step_seconds) if step_seconds else math.nan,
        "steps": len(qps),
    }


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value; NaN for none)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    if len(values) == 1:
        return values[0], 0.0
    return statistics.fmean(values), statistics.stdev(values)


# -- variants --------------------------------------------------------------------

#: What an erase variant's name selects (digits and nanochat; ctr names its own),
#: in the vocabulary of `bench.harness`:
#: ``erase``: the erase backend with the run's inner compiler, no CUDA graphs;
#: ``erase+graphs``: the same with CUDA graph replay (erase_fx's default on
#: CUDA); ``erase/one-stream``: ``erase`` with ``overlap=False`` (every segment
#: on the main stream: the same program, no overlap possible, the baseline that
#: separates what overlap buys from what moving work buys);
#: ``erase/aot_eager``: inner ``aot_eager``, which must train exactly as eager.
GRAPHS_VARIANT = "erase+graphs"


def compile_variant(name: str, model: torch.nn.Module, *, inner: str, streams: int,
                    on_error: str = "fallback") -> Callable[..., Any]:
    """The callable variant ``name`` trains with (compiled lazily, on its first call).

    ``eager`` is the module itself, ``compile`` stock ``torch.compile`` with
    ``inner``; every other name is ``backend="erase"`` (see `GRAPHS_VARIANT`).
    """
    if name == "eager":
        return model
    if name == "compile":
        return torch.compile(model, backend=inner)
    options = {
        "inner": "aot_eager" if name == "erase/aot_eager" else inner,
        "streams": streams,
        "cudagraphs": name == GRAPHS_VARIANT,
        "on_error": on_error,
    }
    if name == "erase/one-stream":
        options["overlap"] = False
    return torch.compile(model, backend="erase", options=options)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def capture_erase_warnings() -> Iterator[list[str]]:
    """The warnings the ``erase_fx`` logger emits in this block (the messages, in order).

    NB: a failed CUDA graph capture is only logged (erase_fx then runs
    without replay, and no `GraphReport` says so): `compile_summary` reads
    it from here.
    """
    handler = _Records()
    logger = logging.getLogger("erase_fx")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def compile_summary(reports: Sequence[Any], warnings: Sequence[str] = ()) -> dict[str, Any]:
    """What erase did with the graphs it compiled: early blocks, and why any fell short.

    ``reports`` are `erase_fx.GraphReport`; ``rejected`` leaves out the last
    block (it is never early); with ``on_error="fallback"`` a block erase_fx
    cannot prove safe, or a failed segment compile, shows up here instead of
    stopping the run. ``cudagraph_failures``: the CUDA graph captures that
    failed (from ``warnings``, see `capture_erase_warnings`); those graphs
    ran without replay.
    """
    return {
        "early_blocks": sum(len(r.blocks) for r in reports),
        "rejected": [f"{x.reason}: {x.detail}" for r in reports for x in r.rejected
                     if x.reason != "last_block"],
        # NB: an InductorError's text holds the whole IR; its first line is enough here
        "fallback": [" ".join(r.fallback_reason.split())[:300]
                     for r in reports if r.fallback_reason],
        "cudagraph_failures": [" ".join(w.split())[:300] for w in warnings
                               if "CUDA graph" in w],
    }


def compiled_notes(compiled: Mapping[str, Any]) -> list[str]:
    """Why a `compile_summary` fell short: rejected blocks, fallbacks, failed CUDA graphs."""
    return (list(compiled["rejected"]) + list(compiled["fallback"])
            + list(compiled.get("cudagraph_failures", ())))


def print_compiled(name: str, compiled: Mapping[str, Any], width: int) -> None:
    """Print what `compile_summary` found, indented under the variant's line."""
    print(f"    {'':{width}s} {compiled['early_blocks']} early blocks compiled", flush=True)
    for line in compiled_notes(compiled):
        print(f"    {'':{width}s} NB: {line[:300]}", flush=True)


def variant_failed(name: str, error: Exception, width: int) -> dict[str, Any]:
    """A variant's results when it raised: its name and the error (printed too).

    NB: the GPU runs are one-shot: the caller records this and goes on, so
    the other variants still count.
    """
    message = f"{type(error).__name__}: {str(error).strip()[:800]}"
    print(f"    {name:{width}s} FAILED: {message}", flush=True)
    return {"variant": name, "error": message}


def add_erase_arguments(parser: argparse.ArgumentParser, results_help: str | None = None) -> None:
    """The flags digits and nanochat share: device, erase's options, where results go."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--inner", help="inductor (CUDA default) or aot_eager (CPU default)")
    parser.add_argument("--streams", type=int, default=4, help="erase's side streams")
    parser.add_argument("--on-error", choices=("fallback", "raise"), default="fallback",
                        help="erase's on_error: fallback records why a block is not early "
                             "and goes on")
    parser.add_argument("--out-dir", "--results-dir", dest="out_dir", type=Path,
                        default=DEFAULT_RESULTS_DIR, help=results_help)


# -- results ---------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    """``"NVIDIA H200"`` on a GPU; the CPU's architecture and thread count otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"


def _git(*args: str) -> str | None:
    """``git <args>``'s output in the repository root; None if git fails or is missing."""
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


#: Left out of the dirty check: what the experiments write, not code.
RESULTS_PATHSPEC = ":(exclude)bench/results"


def git_commit() -> str | None:
    """HEAD's short commit, ``"<sha>-dirty"`` when the tree differs from it; None without git.

    Dirty means ``git status --porcelain`` lists anything outside
    ``bench/results`` (changed, staged or untracked files): the code that ran
    is not that commit. NB: on a copied working tree (the device machine's)
    ``.git`` may be older than the files: the commit is then the copy's
    stale HEAD, and the copied changes show as dirty. Only a clean ``<sha>``
    says the code that ran is that commit.
    """
    sha = (_git("rev-parse", "--short", "HEAD") or "").strip()
    if not sha:
        return None
    status = _git("status", "--porcelain", "--", ".", RESULTS_PATHSPEC)
    if status is None:
        return f"{sha}-unknown"  # NB: HEAD is known, whether the tree matches it is not
    return f"{sha}-dirty" if status.strip() else sha


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """How the experiment was started: ``python -m <module> <args>``."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", "-m", module, *(shlex.quote(a) for a in args)])


def run_meta(device: torch.device, command: str, **extra: Any) -> dict[str, Any]:
    """The ``meta`` block: date (UTC, ISO 8601), torch, device, command, plus ``extra``."""
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__,
        "device": device_name(device),
        "command": command,
        "python": platform.python_version(),
        "git_commit": git_commit(),
    }
    meta.update(extra)
    return meta


def table(caption: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """One ``tables`` entry of the contract; raises ValueError on a row of the wrong width."""
    columns, rows = list(columns), [list(row) for row in rows]
    bad = [index for index, row in enumerate(rows) if len(row) != len(columns)]
    if bad:
        raise ValueError(f"table {caption[:60]!r}: rows {bad} do not have {len(columns)} cells")
    return {"caption": caption, "columns": columns, "rows": rows}


def validate_results(payload: Mapping[str, Any]) -> list[str]:
    """What is wrong with a results payload against the contract (empty when nothing is)."""
    problems = [f"missing key {key!r}" for key in REQUIRED_KEYS if key not in payload]
    if problems:
        return problems
    meta = payload["meta"]
    if not isinstance(meta, Mapping):
        return ["'meta' is not an object"]
    problems += [f"meta lacks {key!r}" for key in META_KEYS if key not in meta]
    for index, table in enumerate(payload["tables"]):
        problems += [f"tables[{index}] lacks {key!r}" for key in TABLE_KEYS if key not in table]
        if all(key in table for key in TABLE_KEYS):
            width = len(table["columns"])
            problems += [
                f"tables[{index}] row {r} has {len(row)} cells, not {width}"
                for r, row in enumerate(table["rows"]) if len(row) != width
            ]
    for index, figure in enumerate(payload["figures"]):
        problems += [f"figures[{index}] lacks {key!r}" for key in FIGURE_KEYS if key not in figure]
        kind = figure.get("kind")
        if kind is not None and kind not in FIGURE_KINDS:
            problems.append(f"figures[{index}] kind {kind!r} is not one of {FIGURE_KINDS}")
        if kind is not None and "series" not in figure:
            problems.append(f"figures[{index}] of kind {kind!r} lacks 'series'")
    for index, row in enumerate(payload["paper_comparison"]):
        problems += [
            f"paper_comparison[{index}] lacks {key!r}" for key in COMPARISON_KEYS if key not in row
        ]
        if row.get("verdict") not in VERDICTS:
            problems.append(
                f"paper_comparison[{index}] verdict {row.get('verdict')!r} is not one of {VERDICTS}"
            )
    return problems


def _json_safe(value: Any) -> Any:
    """NaN and infinities as None (JSON has neither); tuples as lists."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_results(name: str, payload: Mapping[str, Any], results_dir: str | os.PathLike) -> Path:
    """Write ``<results_dir>/<name>.json`` after checking it against the contract.

    Raises ValueError naming every problem if the payload breaks the
    contract. Writes to a temporary file first, so a reader never sees half
    a file (the experiments rewrite their JSON after every run).
    """
    problems = validate_results(payload)
    if problems:
        raise ValueError(f"results {name!r} break the contract: " + "; ".join(problems))
    directory = Path(results_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(_json_safe(payload), indent=1, allow_nan=False) + "\n")
    partial.replace(path)
    return path


def fmt(value: Any, digits: int = 4) -> str:
    """A table cell: floats to ``digits`` significant digits, None as ``-``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def fmt_mean_std(mean: float, std: float, digits: int = 4) -> str:
    """``mean ± std`` as a table cell."""
    if mean is None or math.isnan(mean):
        return "-"
    return f"{mean:.{digits}g} ± {std:.2g}"
