"""The paper-reproduction report: ``python -m bench.paper.report [--results-dir DIR]``.

Reads every ``<results-dir>/*.json`` written by the experiments in
``bench/paper/`` (the results contract of ``bench/paper/README.md``), draws
the figures whose data the files carry (matplotlib, Agg backend), and writes
``<results-dir>/REPORT.md``:

1. one table gathering every file's ``paper_comparison`` rows (the paper's
   number, ours, the verdict);
2. one section per file, in ``(order, file name)`` order: the ``meta`` line
   (device, torch, date, command), the summary, the tables, the figures
   (each PNG stamped with device, torch version, date and command), the
   paper comparison;
3. the files that could not be read or break the contract, with the reasons.

Nothing is computed here beyond drawing: every number comes from the JSON
files, as written by the experiments.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.paper.common import DEFAULT_RESULTS_DIR, META_KEYS, validate_results

#: Sections without an ``order`` key sort after those with one.
DEFAULT_ORDER = 100
REPORT_NAME = "REPORT.md"


# -- reading -----------------------------------------------------------------------


def load_results(results_dir: Path) -> tuple[list[tuple[Path, dict]], list[tuple[Path, str]]]:
    """The valid results files, sorted by ``(order, name)``, and the rejected ones with why."""
    valid: list[tuple[Path, dict]] = []
    rejected: list[tuple[Path, str]] = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            rejected.append((path, f"not readable as JSON: {error}"))
            continue
        if not isinstance(payload, dict):
            rejected.append((path, "not a JSON object"))
            continue
        problems = validate_results(payload)
        if problems:
            rejected.append((path, "; ".join(problems)))
            continue
        valid.append((path, payload))
    valid.sort(key=lambda item: (item[1].get("order", DEFAULT_ORDER), item[0].name))
    return valid, rejected


# -- figures -----------------------------------------------------------------------


def stamp(meta: Mapping[str, Any]) -> str:
    """The provenance line drawn under every figure: device, torch, date, command."""
    head = f"{meta.get('device')} · torch {meta.get('torch')} · {meta.get('date')}"
    command = textwrap.fill(str(meta.get("command")), width=120, subsequent_indent="  ")
    return f"{head}\n{command}"


def _numbers(values: Sequence[Any] | None) -> list[float]:
    """JSON numbers as floats (null, written for NaN, back to NaN)."""
    return [math.nan if v is None else float(v) for v in (values or [])]


def draw_figure(figure: Mapping[str, Any], meta: Mapping[str, Any], path: Path) -> None:
    """Draw a ``line`` or ``bar`` figure from its series into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        if figure["kind"] == "line":
            _draw_lines(ax, figure["series"])
        else:
            _draw_bars(ax, figure["series"], figure.get("categories"))
        for line in figure.get("hlines", []):
            ax.axhline(float(line["y"]), color="gray", linestyle=":", linewidth=1,
                       label=line.get("label"))
        if figure.get("logy"):
            ax.set_yscale("log")
        if figure.get("ylim"):
            ax.set_ylim(*(None if v is None else float(v) for v in figure["ylim"]))
        ax.set_xlabel(figure.get("xlabel", ""))
        ax.set_ylabel(figure.get("ylabel", ""))
        ax.set_title(figure.get("title") or textwrap.fill(figure["caption"], 80), fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.text(0.01, 0.01, stamp(meta), fontsize=6.5, family="monospace", va="bottom")
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


#: Line styles and markers cycled over series, so identical curves (eager and
#: an exact erase variant) stay visible on top of each other.
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "v", "D", "x", "+")


def _draw_lines(ax: Any, series: Sequence[Mapping[str, Any]]) -> None:
    for index, line in enumerate(series):
        x, y = _numbers(line["x"]), _numbers(line["y"])
        yerr = _numbers(line.get("yerr")) or None
        ax.errorbar(x, y, yerr=yerr, label=line["label"], capsize=2, linewidth=1.2,
                    linestyle=LINE_STYLES[index % len(LINE_STYLES)],
                    marker=MARKERS[index % len(MARKERS)], markersize=4, fillstyle="none")


def _draw_bars(ax: Any, series: Sequence[Mapping[str, Any]],
               categories: Sequence[str] | None) -> None:
    groups = list(categories or [""])
    width = 0.8 / max(len(series), 1)
    for index, bars in enumerate(series):
        y = _numbers(bars["y"] if isinstance(bars["y"], list) else [bars["y"]])
        yerr = bars.get("yerr")
        yerr = _numbers(yerr if isinstance(yerr, list) else [yerr]) if yerr is not None else None
        x = [g + (index - (len(series) - 1) / 2) * width for g in range(len(y))]
        ax.bar(x, y, width=width, yerr=yerr, capsize=3, label=bars["label"])
    ax.set_xticks(range(len(groups)), groups)


# -- markdown ----------------------------------------------------------------------


def cell(value: Any) -> str:
    """A markdown table cell: pipes escaped, one line."""
    text = "-" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: Sequence[Any], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines


def meta_line(meta: Mapping[str, Any]) -> str:
    """``device · torch · date · `command```, then every other meta key but `settings`
    (a machine-readable record of every flag, left in the JSON)."""
    line = (f"*{meta['device']} · torch {meta['torch']} · {meta['date']}* · "
            f"`{meta['command']}`")
    extra = {k: v for k, v in meta.items() if k not in (*META_KEYS, "settings")}
    if extra:
        line += "  \n" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in extra.items())
    return line


def comparison_rows(path: Path, payload: Mapping[str, Any]) -> list[list[Any]]:
    return [[path.stem, row["claim"], row["paper"], row["erase_fx"], f"**{row['verdict']}**",
             row.get("note", "")] for row in payload["paper_comparison"]]


COMPARISON_COLUMNS = ("experiment", "claim", "paper", "erase_fx", "verdict", "note")


def render_section(path: Path, payload: Mapping[str, Any],
                   drawn: Mapping[str, str | None]) -> list[str]:
    """One file's section of the report."""
    meta = payload["meta"]
    lines = [f"## {payload['title']}", "", f"From `{path.name}`. " + meta_line(meta), ""]
    if payload.get("summary"):
        lines += [payload["summary"], ""]
    for table in payload["tables"]:
        lines += [f"**{table['caption']}**", "", *markdown_table(table["columns"], table["rows"]),
                  ""]
    for figure in payload["figures"]:
        problem = drawn.get(figure["file"])
        if problem:
            lines += [f"*Figure `{figure['file']}` missing: {problem}.* {figure['caption']}", ""]
            continue
        lines += [f"![{cell(figure['caption'])}]({figure['file']})", "",
                  f"*{figure['caption']}* ({meta['device']}, torch {meta['torch']}, "
                  f"{meta['date']}, `{meta['command']}`)", ""]
    if payload["paper_comparison"]:
        lines += ["**Against the paper**", "",
                  *markdown_table(COMPARISON_COLUMNS, comparison_rows(path, payload)), ""]
    return lines


def draw_all(payload: Mapping[str, Any], results_dir: Path) -> dict[str, str | None]:
    """Draw each figure that carries data; map each figure file to None or why it is missing."""
    drawn: dict[str, str | None] = {}
    for figure in payload["figures"]:
        target = results_dir / figure["file"]
        if figure.get("kind") is None:
            drawn[figure["file"]] = None if target.exists() else "not found"
            continue
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            draw_figure(figure, payload["meta"], target)
            drawn[figure["file"]] = None
        except ImportError:
            drawn[figure["file"]] = "matplotlib is not installed (pip install -e '.[paper]')"
        except Exception as error:  # noqa: BLE001 - one bad figure must not lose the report
            drawn[figure["file"]] = f"could not draw it ({type(error).__name__}: {error})"
    return drawn


def write_report(results_dir: Path, out: Path | None = None) -> Path:
    """Draw the figures and write the report; returns its path."""
    results_dir = Path(results_dir)
    out = Path(out) if out is not None else results_dir / REPORT_NAME
    valid, rejected = load_results(results_dir)
    lines = ["# The ERASE paper's experiments, reproduced with erase_fx", "",
             f"Generated by `python -m bench.paper.report` from {len(valid)} results file(s) in "
             f"this folder. Every number comes from those files; each section names the "
             f"device, torch version, date and command that produced it.", ""]
    if not valid:
        lines += ["No results yet: run the experiments (see `bench/paper/README.md`).", ""]
    comparison = [row for path, payload in valid for row in comparison_rows(path, payload)]
    if comparison:
        lines += ["## The paper's claims and what erase_fx measured", "",
                  *markdown_table(COMPARISON_COLUMNS, comparison), ""]
    for path, payload in valid:
        drawn = draw_all(payload, results_dir)
        lines += render_section(path, payload, drawn)
    if rejected:
        lines += ["## Files skipped", ""]
        lines += [f"- `{path.name}`: {why}" for path, why in rejected]
        lines.append("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.paper.report",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", default=str(DEFAULT_RESULTS_DIR),
                        help="where the experiments wrote their JSON")
    parser.add_argument("--out", default=None, help=f"report path (default: <results-dir>/"
                        f"{REPORT_NAME})")
    args = parser.parse_args(argv)
    results_dir = Path(args.results_dir)
    if not results_dir.is_dir():
        print(f"no results folder {results_dir}", file=sys.stderr)
        return 1
    path = write_report(results_dir, args.out)
    valid, rejected = load_results(results_dir)
    for source, payload in valid:
        for row in comparison_rows(source, payload):
            print(f"{row[0]}: {row[1]}: paper {row[2]}; erase_fx {row[3]} -> {row[4].strip('*')}")
    print(f"wrote {path} from {len(valid)} file(s)"
          + (f"; skipped {', '.join(p.name for p, _ in rejected)}" if rejected else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
