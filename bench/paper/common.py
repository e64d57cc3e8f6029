"""Helpers shared by the paper reproductions (``bench/paper/*.py``).

- seeding (`seed_everything`, `build_seeded`);
- per-step timing (`StepTimer`: CUDA events on a GPU, ``perf_counter`` on
  the CPU) and throughput statistics (`throughput_stats`: median, p90, p10
  of per-step QPS);
- normalized entropy (`normalized_entropy`);
- the results contract (`validate_results`, `write_results`, `run_meta`):
  every experiment writes one JSON file, ``<results_dir>/<name>.json``, that
  `bench.paper.report` turns into ``REPORT.md``. The contract is documented in
  ``bench/paper/README.md`` and checked here.

Nothing here imports erase_fx: the helpers measure, they do not compile.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

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


def build_seeded(build: Callable[[], torch.nn.Module], seed: int) -> torch.nn.Module:
    """``build()`` with its weights drawn from ``seed``; torch's global RNG is left as it was.

    The variants of one seed start from deep copies of this one module, so
    they share their initial weights exactly.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


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


# -- metrics -------------------------------------------------------------------


def binary_entropy(rate: float) -> float:
    """``H(p) = -(p log p + (1-p) log(1-p))`` in nats (0 at p = 0 or 1)."""
    if rate <= 0.0 or rate >= 1.0:
        return 0.0
    return -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """NE: mean BCE of the predicted click logits over the entropy of the labels' base rate.

    ``NE = mean BCE / H(p)`` with ``p`` the click rate of ``labels``: 1.0 is
    what always predicting the base rate scores; lower is better. Computed in
    float64 so that two runs' NE are equal exactly when their logits are.
    """
    logits = logits.detach().double().flatten()
    labels = labels.detach().double().flatten()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).item()
    return bce / binary_entropy(labels.mean().item())


# -- results ---------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    """``"NVIDIA H200"`` on a GPU; the CPU's architecture and thread count otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"


def git_commit() -> str | None:
    """The repository's HEAD commit, or None where there is no git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


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
