"""The current results tables in ``bench/results/``: each run updates the table of its kind.

One table per kind of run (`bench.run`'s rows in ``step.json``, each check's results,
``bench.memory_profile``'s streams, ...), as PyTorch keeps
``benchmarks/dynamo/ci_expected_accuracy/*.csv``: a run replaces the rows it measured
(same key: the same check, config and variant, ...) and leaves the others, each with the
date and the command of the run that measured it. What a run replaced is in git
(``git log -p bench/results/<table>``); nothing is written per run or per date.

Two forms, both Markdown that this module reads back:

- a table (`update_table`): one row per key, the columns ``date`` and ``run`` last, the
  runs listed under it by number;
- sections (`update_sections`): one ``## <key>`` section per key, for reports that are
  text rather than cells (a profile, a kernel listing), each opened by its date and run.

Pure file work, no torch: `machine` is the one function that asks the device.
"""
from __future__ import annotations

import dataclasses
import datetime
import re
import shlex
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

_RUN_LINE = re.compile(r"^(\d+)\. (\d{4}-\d\d-\d\d), (.*?): `(.*)`$")
_SECTION_RUN = re.compile(r"^_(\d{4}-\d\d-\d\d), run (\d+)_$")


@dataclasses.dataclass(frozen=True)
class Run:
    """What measured a row: the day, the machine (GPU, torch, allocator), the command."""

    date: str
    machine: str
    command: str

    def line(self, number: int) -> str:
        return f"{number}. {self.date}, {self.machine}: `{self.command.replace('`', chr(39))}`"


def this_run(module: str, argv: Sequence[str] | None = None, machine_text: str | None = None,
             date: str | None = None) -> Run:
    """The run of ``python -m <module> <argv>`` (``sys.argv[1:]`` when None), today."""
    words = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python -m", module, *(shlex.quote(w) for w in words)])
    return Run(date or datetime.date.today().isoformat(),
               machine() if machine_text is None else machine_text, command)


def machine() -> str:
    """``NVIDIA H200, torch 2.11.0+cu130`` (``, cudaMallocAsync`` where that allocator runs)."""
    import torch

    if not torch.cuda.is_available():
        return f"CPU, torch {torch.__version__}"
    text = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    allocator = torch.cuda.get_allocator_backend()
    return text if allocator == "native" else f"{text}, {allocator}"


def numbered(runs: Iterable[Run]) -> dict[Run, int]:
    """Each distinct run, numbered 1.. by date (then by first appearance)."""
    first = list(dict.fromkeys(runs))
    order = sorted(range(len(first)), key=lambda i: (first[i].date, i))
    return {first[i]: n for n, i in enumerate(order, start=1)}


def _runs_listed(lines: Iterable[str]) -> dict[int, Run]:
    runs = {}
    for line in lines:
        found = _RUN_LINE.match(line)
        if found:
            runs[int(found[1])] = Run(found[2], found[3], found[4])
    return runs


def _runs_text(numbers: Mapping[Run, int]) -> list[str]:
    return [run.line(n) for run, n in sorted(numbers.items(), key=lambda item: item[1])]


# -- tables ---------------------------------------------------------------------------


def _text(value: object) -> str:
    return "-" if value is None or value == "" else str(value).replace("\n", " ")


def _cell(value: object) -> str:
    return _text(value).replace("|", "\\|")


def _cells(line: str) -> list[str]:
    parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [part.strip().replace("\\|", "|") for part in parts]


def read_table(path: Path) -> tuple[list[str], list[tuple[dict[str, str], Run]]]:
    """A table file's columns (``date`` and ``run`` left out) and rows, each with its run;
    nothing when the file does not exist."""
    if not path.exists():
        return [], []
    lines = path.read_text().splitlines()
    runs = _runs_listed(lines)
    for i, line in enumerate(lines[:-1]):
        if line.startswith("| ") and lines[i + 1].startswith("|---"):
            header, start = _cells(line), i + 2
            break
    else:
        return [], []
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        row = dict(zip(header, _cells(line)))
        run = runs[int(row.pop("run"))]
        row.pop("date", None)
        rows.append((row, run))
    return [c for c in header if c not in ("date", "run")], rows


def merge_rows(old: Sequence[tuple[dict, Run]], new: Sequence[tuple[dict, Run]],
               key: Sequence[str]) -> list[tuple[dict, Run]]:
    """``old`` with each row that has a new row's key replaced by it (in its place) and the
    other new rows after the last old row that shares their first key column (else last)."""
    def key_of(row):
        return tuple(row.get(k, "") for k in key)

    fresh = {key_of(row): (row, run) for row, run in new}
    merged = [fresh.pop(key_of(row), (row, run)) for row, run in old]
    for k, entry in fresh.items():
        group = [i for i, (row, _) in enumerate(merged) if key_of(row)[:1] == k[:1]]
        merged.insert(group[-1] + 1 if group else len(merged), entry)
    return merged


def render_table(title: str, intro: str, columns: Sequence[str],
                 rows: Sequence[tuple[Mapping[str, object], Run]], after: str = "") -> str:
    """The Markdown of a table: its rows with their run's date and number, the runs under it.
    ``after``: text between the table and the runs (more tables of the same rows)."""
    numbers = numbered(run for _, run in rows)
    header = [*columns, "date", "run"]
    lines = [f"# {title}", "", intro.strip(), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row, run in rows:
        cells = [_cell(row.get(c)) for c in columns] + [run.date, str(numbers[run])]
        lines.append("| " + " | ".join(cells) + " |")
    if after:
        lines += ["", after.strip()]
    lines += ["", "Runs (the `run` column):", "", *_runs_text(numbers)]
    return "\n".join(lines) + "\n"


def update_table(path: Path, *, title: str, intro: str, columns: Sequence[str],
                 key: Sequence[str], rows: Sequence[Mapping[str, object]], run: Run,
                 order: Callable[[dict], object] | None = None) -> None:
    """Replace ``path``'s rows that have the key of one of ``rows`` (this run's) by it, add
    the others, and write the table again, in ``order`` (a sort key of a row) if given;
    columns an older row lacks show ``-``."""
    old_columns, old = read_table(path)
    new = [({c: _text(row.get(c)) for c in columns}, run) for row in rows]
    merged = merge_rows(old, new, key)
    if order is not None:
        merged.sort(key=lambda entry: order(entry[0]))
    every = list(dict.fromkeys([*columns, *old_columns]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_table(title, intro, every, merged))


# -- sections -------------------------------------------------------------------------


def read_sections(path: Path) -> list[tuple[str, str, Run]]:
    """A sections file's sections: (key, body, run); nothing when the file does not exist."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    runs = _runs_listed(lines[:first])
    sections, i = [], first
    while i < len(lines):
        key = lines[i][3:].strip()
        j = i + 1
        while j < len(lines) and not lines[j].startswith("## "):
            j += 1
        body = lines[i + 1:j]
        while body and not body[0].strip():
            body.pop(0)
        stamp = _SECTION_RUN.match(body[0]) if body else None
        if stamp is None:
            raise ValueError(f"{path}: section {key!r} does not open with its date and run")
        sections.append((key, "\n".join(body[1:]).strip("\n"), runs[int(stamp[2])]))
        i = j
    return sections


def render_sections(title: str, intro: str, sections: Sequence[tuple[str, str, Run]]) -> str:
    numbers = numbered(run for _, _, run in sections)
    lines = [f"# {title}", "", intro.strip(), "", "Runs (each section names its own):", "",
             *_runs_text(numbers)]
    for key, body, run in sections:
        lines += ["", f"## {key}", "", f"_{run.date}, run {numbers[run]}_", "", body.strip("\n")]
    return "\n".join(lines) + "\n"


def update_sections(path: Path, *, title: str, intro: str,
                    sections: Sequence[tuple[str, str]], run: Run) -> None:
    """Replace ``path``'s sections that have the key of one of ``sections`` (key, body) by
    it, add the others last, and write the file again."""
    old = [(key, body, old_run) for key, body, old_run in read_sections(path)]
    fresh = {key: (key, body, run) for key, body in sections}
    merged = [fresh.pop(key, (key, body, old_run)) for key, body, old_run in old]
    merged += fresh.values()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_sections(title, intro, merged))


def by_check(row: Mapping[str, str]) -> str:
    """The order of a table of checks: by name, so that a check's kind and config group."""
    return row["check"]


def default_out(name: str, on_gpu: bool, out: str | None) -> Path | None:
    """Where a script that also runs on CPU writes: ``out`` if given (``''``: nowhere), else
    its table in ``bench/results`` on a GPU and nowhere on CPU (CPU runs print)."""
    if out is not None:
        return Path(out) if out else None
    return RESULTS / name if on_gpu else None
