"""The results JSON of the CTR experiment (``bench/paper/ctr.py``): `summarize`.

From the runs (`RunResult`, one per variant and seed), the payload of the
results contract (``bench/paper/README.md``): the tables (per variant,
exactness, speed gains, erase_fx's decisions, gradient audits, the
no-local-loss demonstration), the figures (NE curves, QPS bars), the summary
text, the paper comparison with its verdicts, and the raw numbers
(`run_data`; `run_from_data` reads them back for ``--merge``). Nothing here
trains or times anything: a merge re-summarizes stored runs with this code.

The variants' names are defined here because the tables are ordered and
compared by them; ``ctr.py`` documents them and imports them from here.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from bench.harness import LEGACY_NAMES
from bench.paper import common
from bench.paper.common import fmt, fmt_mean_std, mean_std
from bench.paper.ctr_data import Dataset
from bench.paper.ctr_model import group_of_param

#: Variants in run order (and row order of the tables); see ``bench/paper/ctr.py``'s docstring.
VARIANTS = ("baseline", "eager", "eager/1ulp", "inductor", "reduce-overhead", "erase/aot_eager",
            "erase", "erase+graphs")
#: Variants whose throughput is compared with the paper's: erase, fastest first.
ERASE_VARIANTS = ("erase+graphs", "erase", "erase/aot_eager")
#: Stock compilations of the same detached model, the fair baselines of erase.
STOCK_VARIANTS = ("eager", "inductor", "reduce-overhead")
#: The rounding control: ``eager`` from initial weights one float step away.
ROUNDING_CONTROL = "eager/1ulp"

#: The paper's claim: p90 QPS gain on its CTR model (percent).
PAPER_P90_GAIN = 9.51


@dataclasses.dataclass
class RunResult:
    """What one (variant, seed) run measured."""

    variant: str
    seed: int
    losses: list[float] = dataclasses.field(default_factory=list)
    ne_curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    timed_steps: list[int] = dataclasses.field(default_factory=list)
    qps: dict[str, float] = dataclasses.field(default_factory=dict)
    compile_seconds: float = math.nan
    peak_mib: float = math.nan
    audit: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    erase_reports: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    error: str | None = None
    #: largest |parameter difference| at the end from the same seed's eager / inductor run
    param_diffs: dict[str, float] = dataclasses.field(default_factory=dict)
    final_params: dict[str, torch.Tensor] | None = None

    @property
    def final_ne(self) -> float:
        return self.ne_curve[-1][1] if self.ne_curve else math.nan


@dataclasses.dataclass(frozen=True)
class DataFacts:
    """What a summary needs to know of the data (a merge has no `Dataset`)."""

    oracle_ne: float
    train_ctr: float


def by_variant(runs: Sequence[RunResult]) -> dict[str, list[RunResult]]:
    grouped: dict[str, list[RunResult]] = {}
    for run in runs:
        if run.error is None:
            grouped.setdefault(run.variant, []).append(run)
    return grouped


def paired(a: list[RunResult], b: list[RunResult]) -> list[tuple[RunResult, RunResult]]:
    """Runs of two variants with the same seed."""
    seeds = {run.seed: run for run in b}
    return [(run, seeds[run.seed]) for run in a if run.seed in seeds]


def exactness(a: list[RunResult], b: list[RunResult]) -> dict[str, Any]:
    """Largest train-loss, NE and final-parameter differences between two variants, all seeds."""
    pairs = paired(a, b)
    if not pairs:
        return {}
    reference = b[0].variant
    loss_diff = max(max(abs(x - y) for x, y in zip(r.losses, s.losses)) for r, s in pairs)
    ne_diff = max(abs(r.final_ne - s.final_ne) for r, s in pairs)
    curve_diff = max(max(abs(x[1] - y[1]) for x, y in zip(r.ne_curve, s.ne_curve))
                     for r, s in pairs)
    diffs = [r.param_diffs.get(reference) for r, _ in pairs]
    param_diff = None if None in diffs else max(diffs)
    return {"seeds": len(pairs), "max_train_loss_diff": loss_diff, "final_ne_diff": ne_diff,
            "ne_curve_max_diff": curve_diff, "max_param_diff": param_diff,
            "final_ne_signed_diff_mean": mean_std([r.final_ne - s.final_ne for r, s in pairs])[0],
            "final_ne_abs_diff_mean": mean_std([abs(r.final_ne - s.final_ne)
                                                for r, s in pairs])[0]}


def gain(a: list[RunResult], b: list[RunResult], stat: str = "p90") -> tuple[float, float]:
    """Percent QPS gain of ``a`` over ``b`` (paired by seed): mean and std."""
    return mean_std([100 * (r.qps[stat] / s.qps[stat] - 1) for r, s in paired(a, b)])


def verdict(gain_mean: float, gain_std: float, paper: float) -> str:
    """``equal`` within max(2 std, 1 point) of the paper's gain; else ``better`` or ``worse``."""
    if math.isnan(gain_mean):
        return "not comparable"
    if abs(gain_mean - paper) <= max(2 * gain_std, 1.0):
        return "equal"
    return "better" if gain_mean > paper else "worse"


def summarize(runs: Sequence[RunResult], demo: dict[str, Any] | None, data: Dataset | DataFacts,
              args: argparse.Namespace, meta: dict[str, Any]) -> dict[str, Any]:
    """The results JSON (contract of bench/paper/README.md) from the runs so far."""
    grouped = by_variant(runs)
    name, k = args.name, args.blocks
    # NB: runs before the fix kept each run's final parameters on the GPU until the seed ended
    kept_on = meta.get("final_params_kept_on", "gpu")
    peak_note = ("" if kept_on == "cpu" else
                 " (peak memory includes the final parameters of the seed's earlier variants, "
                 "kept on the GPU for the exactness table: one model's worth per variant "
                 f"before it in the row order; final parameters kept on: {kept_on})")
    tables = [_variant_table(grouped, data, peak_note)]
    exact = exactness_rows(grouped)
    if exact:
        tables.append(common.table(
            "Exactness: largest difference from the reference over every step and seed "
            "(erase/aot_eager vs eager must be exactly 0; the rounding control "
            f"{ROUNDING_CONTROL}, eager from weights one float step away, shows how far "
            "rounding alone carries a run)",
            ["variant", "reference", "seeds", "max |d train loss|", "max |d final NE|",
             "mean |d final NE|", "max |d NE curve|", "max |d param|", "exact"],
            [row["cells"] for row in exact]))
    speed = _speed_rows(grouped)
    if speed:
        tables.append(common.table(
            "QPS gain of each variant over the stock compilations of the same detached model "
            "(percent, paired by seed, mean ± std)",
            ["variant", *[f"p90 vs {r}" for r in STOCK_VARIANTS], "median vs best stock"],
            speed))
    decisions = _erase_decisions_table(grouped)
    if decisions["rows"]:
        tables.append(decisions)
    audit_rows = [row for run in runs for row in run.audit]
    if audit_rows:
        tables.append(_audit_table(audit_rows, "Gradient audit (first seed): norm of each "
                                   "group's own parameter gradients and the local loss it "
                                   "came from; zero is FAIL"))
    if demo:
        demo_rows = [row for run in demo["runs"] for row in run.audit]
        tables.append(_audit_table(demo_rows, f"No-local-loss demonstration: blocks 1-{k - 1} "
                                   "without a local loss (FAIL is the expected freezing "
                                   "artifact)"))
        tables.append(_explain_table(demo["explain"]))
    errors = [[run.variant, run.seed, run.error] for run in runs if run.error]
    if errors:
        tables.append(common.table("Runs that failed", ["variant", "seed", "error"], errors))
    failures = _failures(runs, exact)
    title = f"CTR model with {k} detached dense blocks"
    if args.no_local_loss:
        title += f" (no local losses on blocks 1-{k - 1})"
    subset = tuple(args.variants) != VARIANTS
    if subset:
        title += f": {', '.join(args.variants)} only"
    return {
        "title": title,
        "order": 11 if subset else 10,  # NB: the run of every variant first
        "meta": meta,
        "summary": _summary_text(grouped, data, args, failures),
        "tables": tables,
        "figures": _figures(grouped, name, data.oracle_ne),
        "paper_comparison": _paper_comparison(grouped, demo, exact, audit_rows, args),
        "data": {
            "failures": failures,
            "oracle_ne": data.oracle_ne,
            "train_ctr": data.train_ctr,
            "runs": [run_data(run) for run in runs],
            "freeze_demo": ({"runs": [run_data(run) for run in demo["runs"]],
                             "explain": demo["explain"]} if demo else None),
            "exactness": {f"{r['variant']} vs {r['reference']}": r["numbers"] for r in exact},
        },
    }


def run_data(run: RunResult) -> dict[str, Any]:
    fields = dataclasses.asdict(dataclasses.replace(run, final_params=None))
    fields.pop("final_params")
    return fields


def run_from_data(fields: dict[str, Any]) -> RunResult:
    """A `RunResult` back from its JSON (``null`` was NaN)."""
    fields = dict(fields, ne_curve=[tuple(point) for point in fields["ne_curve"]])
    # NB: results written before the variant names settled (bench.harness)
    fields["variant"] = LEGACY_NAMES.get(fields["variant"], fields["variant"])
    for key in ("compile_seconds", "peak_mib"):
        if fields[key] is None:
            fields[key] = math.nan
    fields["qps"] = {k: math.nan if v is None else v for k, v in fields.get("qps", {}).items()}
    return RunResult(**fields)


def _variant_table(grouped: dict[str, list[RunResult]], data: Dataset | DataFacts,
                   peak_note: str = "") -> dict[str, Any]:
    baseline = grouped.get("baseline", [])
    rows = []
    for variant in VARIANTS:
        runs = grouped.get(variant)
        if not runs:
            continue
        stat = {key: mean_std([run.qps[key] for run in runs]) for key in ("median", "p90", "p10")}
        gap = mean_std([r.final_ne - s.final_ne for r, s in paired(runs, baseline)])
        early = {len(report["blocks"]) for run in runs for report in run.erase_reports}
        rows.append([
            variant, len(runs),
            *(fmt_mean_std(*stat[key], digits=4) for key in ("median", "p90", "p10")),
            fmt_mean_std(*mean_std([run.qps["mean_step_ms"] for run in runs]), digits=3),
            fmt_mean_std(*mean_std([run.final_ne for run in runs]), digits=5),
            fmt_mean_std(*gap, digits=3) if variant != "baseline" else "-",
            fmt(mean_std([run.compile_seconds for run in runs])[0], 3),
            fmt(mean_std([run.peak_mib for run in runs])[0], 5),
            ",".join(str(n) for n in sorted(early)) if early else "-",
        ])
    return common.table(
        f"Per variant, mean ± std over seeds: per-step QPS (samples/s), step time, final eval "
        f"NE (oracle NE {data.oracle_ne:.4f}), NE gap vs the end-to-end baseline, first-step "
        f"seconds (compilation), peak memory, early blocks erase found" + peak_note,
        ["variant", "seeds", "median QPS", "p90 QPS", "p10 QPS", "step ms", "final NE",
         "NE - baseline NE", "first step s", "peak MiB", "early blocks"],
        rows)


#: (variant, reference) pairs of the exactness table, in its order. The first
#: must be exact; the rounding control's row is the yardstick of the others.
EXACTNESS_PAIRS = (
    ("erase/aot_eager", "eager"), ("erase/aot_eager", "inductor"),
    ("erase", "eager"), ("erase", "inductor"),
    ("erase+graphs", "eager"), ("erase+graphs", "inductor"),
    ("inductor", "eager"), ("reduce-overhead", "eager"),
    (ROUNDING_CONTROL, "eager"),
)


def exactness_rows(grouped: dict[str, list[RunResult]]) -> list[dict[str, Any]]:
    rows = []
    for variant, reference in EXACTNESS_PAIRS:
        if variant not in grouped or reference not in grouped:
            continue
        numbers = exactness(grouped[variant], grouped[reference])
        is_exact = (numbers["max_train_loss_diff"] == 0 and numbers["final_ne_diff"] == 0
                    and numbers["max_param_diff"] in (0, 0.0, None))
        required = variant == "erase/aot_eager" and reference == "eager"
        flag = ("yes" if is_exact else "FAIL" if required
                else "no (control)" if variant == ROUNDING_CONTROL else "no (rounding)")
        rows.append({"variant": variant, "reference": reference, "numbers": numbers,
                     "required": required, "exact": is_exact, "cells": [
                         variant, reference, numbers["seeds"],
                         fmt(numbers["max_train_loss_diff"], 3),
                         fmt(numbers["final_ne_diff"], 3),
                         fmt(numbers["final_ne_abs_diff_mean"], 3),
                         fmt(numbers["ne_curve_max_diff"], 3),
                         fmt(numbers["max_param_diff"], 3), flag]})
    return rows


def _speed_rows(grouped: dict[str, list[RunResult]]) -> list[list[Any]]:
    stock = [v for v in STOCK_VARIANTS if v in grouped]
    rows = []
    for variant in ("erase/aot_eager", "erase", "erase+graphs", "inductor", "reduce-overhead"):
        if variant not in grouped or not stock:
            continue
        cells = [fmt_mean_std(*gain(grouped[variant], grouped[ref]), digits=3)
                 if ref in grouped and ref != variant else "-" for ref in STOCK_VARIANTS]
        best = _best_stock(grouped, "median", exclude=variant)
        cells.append(fmt_mean_std(*gain(grouped[variant], grouped[best], "median"), digits=3)
                     if best else "-")
        rows.append([variant, *cells])
    return rows


def _erase_decisions_table(grouped: dict[str, list[RunResult]]) -> dict[str, Any]:
    """What erase_fx did with each erase variant's graph (first seed): early or left, and why."""
    rows = []
    for variant in ERASE_VARIANTS[::-1]:
        for report in (grouped[variant][0].erase_reports if variant in grouped else []):
            early = ["+".join(sorted({group_of_param(p) for p in block["params"]}))
                     for block in report["blocks"]]
            left = [f"{'+'.join(sorted({group_of_param(p) for p in c['params']}))} "
                    f"({c['reason']}: {c['detail']})" for c in report["rejected"]]
            rows.append([variant, report["inner"], ", ".join(early) or "none",
                         "; ".join(left) or "-", report.get("fallback_reason") or "-"])
    return common.table("What erase_fx did with each erase variant's graph: the blocks whose "
                        "backward runs early, and what stays in the backward, with the reason",
                        ["variant", "inner", "early blocks", "left in the backward",
                         "stock path"], rows)


def _best_stock(grouped: dict[str, list[RunResult]], stat: str, exclude: str = "") -> str | None:
    """The stock variant with the highest mean ``stat`` QPS."""
    candidates = [v for v in STOCK_VARIANTS if v in grouped and v != exclude]
    if not candidates:
        return None
    return max(candidates, key=lambda v: mean_std([r.qps[stat] for r in grouped[v]])[0])


def _audit_table(rows: list[dict[str, Any]], caption: str) -> dict[str, Any]:
    """One row per (variant, step); a cell per group: ``norm (Lk = loss value)`` or FAIL."""
    groups = list(dict.fromkeys(r["group"] for r in rows))
    cells: dict[tuple[str, int], dict[str, str]] = {}
    for r in rows:
        text = f"{r['grad_norm']:.3g} ({r['loss_from']} = {fmt(r['local_loss'], 4)})"
        if r["status"] == "FAIL":
            text = f"**FAIL** {r['grad_norm']:.3g} (loss: {r['loss_from']})"
        cells.setdefault((r["variant"], r["step"]), {})[r["group"]] = text
    key = (". Cell: gradient norm of the group's own parameters (the local losses Lk that "
           "reach them = their value at that step)")
    return common.table(caption + key, ["variant", "step", *groups],
                        [[variant, step, *(row.get(g, "-") for g in groups)]
                         for (variant, step), row in cells.items()])


def _explain_table(explained: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for model, found in explained.items():
        for block in found["early_blocks"]:
            rows.append([model, f"early block {block['id']} (stream {block['stream']})",
                         " + ".join(block["groups"]), "runs during the forward"])
        for component in found["rejected"]:
            rows.append([model, "left in the backward", " + ".join(component["groups"]),
                         f"{component['reason']}: {component['detail']}"])
        if not found["early_blocks"] and not found["rejected"]:
            rows.append([model, "nothing found", "-", "; ".join(found["summaries"])])
    return common.table("What erase_fx.explain finds, with and without local losses",
                        ["model", "component", "parameters of", "why"], rows)


def zero_gradients(run: RunResult) -> list[str]:
    """One line per audited step with a zero-gradient group: ``eager step 1: front, block1``."""
    lines = []
    for step in dict.fromkeys(row["step"] for row in run.audit):
        frozen = [row["group"] for row in run.audit
                  if row["step"] == step and row["status"] == "FAIL"]
        if frozen:
            lines.append(f"{run.variant} step {step}: zero gradient in {', '.join(frozen)}")
    return lines


def _failures(runs: Sequence[RunResult], exact: list[dict[str, Any]]) -> list[str]:
    failures = [f"{r['variant']} vs {r['reference']} not exact" for r in exact
                if r["required"] and not r["exact"]]
    failures += [failure for run in runs for failure in zero_gradients(run)]
    failures += [f"{run.variant} seed {run.seed}: {run.error}" for run in runs if run.error]
    return failures


def _summary_text(grouped: dict[str, list[RunResult]], data: Dataset | DataFacts,
                  args: argparse.Namespace, failures: list[str]) -> str:
    k = args.blocks
    text = (
        f"Synthetic Criteo-like data (26 fields, Criteo Kaggle cardinalities capped at "
        f"{args.cap}, base CTR {data.train_ctr:.3f}, planted logistic model with interactions; "
        f"oracle NE {data.oracle_ne:.4f}). Model: DLRM front, {k} dense blocks "
        f"(d={args.width}, h={args.hidden}) in a chain, block k+1 reading block k's output "
        f"detached, each with a BCE head on the click (weight {args.local_weight} for blocks "
        f"1-{k - 1}, 1.0 for block {k}); NE from block {k}'s head. {args.optimizer} lr {args.lr}, "
        f"batch {args.batch}, {args.steps} steps, seeds {args.seed}..{args.seed + args.seeds - 1}."
        f" QPS: per-step batch/step time after {args.warmup} warm-up steps; p90 = 90th "
        f"percentile of per-step QPS, p10 = 10th. Paper verdict rule: equal within "
        f"max(2 std, 1 point) of +{PAPER_P90_GAIN}%."
    )
    if ROUNDING_CONTROL in grouped:
        text += (f" {ROUNDING_CONTROL} is the rounding control: eager training from initial "
                 "weights each one float step away; its differences from eager are what "
                 "rounding alone does to a run.")
    if args.no_local_loss:
        text += f" Blocks 1-{k - 1} have no local loss here: they are frozen (zero gradient)."
    if failures:
        text += " **FAIL:** " + "; ".join(failures[:10])
    return text


def _frozen_ne(demo: dict[str, Any], grouped: dict[str, list[RunResult]]) -> str:
    """The frozen model's eval NE next to the trained one's at the same step (first seed)."""
    frozen = demo["runs"][0]
    if frozen.error or not frozen.ne_curve:
        return ""
    step, ne = frozen.ne_curve[-1]
    text = f"; eval NE after {step} steps: {ne:.4f} frozen"
    trained = grouped.get("eager", [])
    at_step = [v for s, v in trained[0].ne_curve if s == step] if trained else []
    if at_step:
        text += f" vs {at_step[0]:.4f} with local losses (eager)"
    return text


def _ne_ylim(curves: list[dict[str, Any]], oracle: float) -> list[float | None]:
    """A y range that shows training, not the untrained model's NE at step 0."""
    later = [y for c in curves for x, y in zip(c["x"], c["y"]) if x > 0 and not math.isnan(y)]
    if not later:
        return [None, None]
    low, high = min(min(later), oracle), max(later)
    margin = 0.05 * (high - low) or 0.01
    return [low - margin, high + margin]


def _against_rounding(exact: list[dict[str, Any]], variant: str) -> str:
    """``variant``'s |d final NE| from eager next to the rounding control's, or ''."""
    numbers = {row["variant"]: row["numbers"] for row in exact if row["reference"] == "eager"}
    if variant not in numbers or ROUNDING_CONTROL not in numbers:
        return ""
    return "; |d final NE| from eager, mean (max) over seeds: " + ", ".join(
        f"{v} {numbers[v]['final_ne_abs_diff_mean']:.3g} ({numbers[v]['final_ne_diff']:.3g})"
        for v in (variant, ROUNDING_CONTROL)) + " (the rounding control)"


def _figures(grouped: dict[str, list[RunResult]], name: str,
             oracle_ne: float) -> list[dict[str, Any]]:
    curves = []
    for variant in VARIANTS:
        runs = grouped.get(variant)
        if not runs:
            continue
        steps = [step for step, _ in runs[0].ne_curve]
        stats = [mean_std([run.ne_curve[i][1] for run in runs if i < len(run.ne_curve)])
                 for i in range(len(steps))]
        curves.append({"label": variant, "x": steps, "y": [m for m, _ in stats],
                       "yerr": [s for _, s in stats]})
    bars = []
    for variant in VARIANTS:
        runs = grouped.get(variant)
        if runs and variant != ROUNDING_CONTROL:
            stats = [mean_std([run.qps[key] for run in runs]) for key in ("median", "p90", "p10")]
            bars.append({"label": variant, "y": [m for m, _ in stats],
                         "yerr": [s for _, s in stats]})
    figures = []
    if curves:
        figures.append({"file": f"{name}_ne_curves.png", "kind": "line",
                        "caption": "Eval NE of the last block's head during training, mean ± std "
                                   "over seeds (lower is better; the step-0 point is above the "
                                   "plotted range when it is cut)",
                        "xlabel": "training step", "ylabel": "eval NE", "series": curves,
                        "ylim": _ne_ylim(curves, oracle_ne),
                        "hlines": [{"y": oracle_ne, "label": "oracle NE (planted model)"}]})
    if bars:
        figures.append({"file": f"{name}_qps.png", "kind": "bar",
                        "caption": "Per-step QPS: median, p90 and p10 over the timed steps, "
                                   "mean ± std over seeds",
                        "xlabel": "statistic", "ylabel": "samples / s",
                        "categories": ["median", "p90", "p10"], "series": bars})
    return figures


def _paper_comparison(grouped: dict[str, list[RunResult]], demo: dict[str, Any] | None,
                      exact: list[dict[str, Any]], audit_rows: list[dict[str, Any]],
                      args: argparse.Namespace) -> list[dict[str, Any]]:
    rows, k = [], args.blocks
    fastest = next((v for v in ERASE_VARIANTS if v in grouped and v != "erase/aot_eager"), None)
    best = _best_stock(grouped, "p90")
    if fastest and best:
        mean, std = gain(grouped[fastest], grouped[best])
        per_seed = ", ".join(f"{100 * (r.qps['p90'] / s.qps['p90'] - 1):+.1f}"
                             for r, s in paired(grouped[fastest], grouped[best]))
        rows.append({
            "claim": f"p90 QPS gain of the early-backward schedule, CTR model with {k} "
                     "detached dense blocks",
            "paper": f"+{PAPER_P90_GAIN}%",
            "erase_fx": f"{mean:+.2f}% ± {std:.2f} ({fastest} vs {best}, the fastest stock "
                        f"compilation of the same detached model; per seed: {per_seed})",
            "verdict": verdict(mean, std, PAPER_P90_GAIN),
            "note": "different model sizes, GPU and baseline: the paper's baseline and local "
                    "losses are unspecified",
        })
        if "eager" in grouped and best != "eager":
            mean, std = gain(grouped[fastest], grouped["eager"])
            rows.append({
                "claim": "p90 QPS gain over eager training of the same detached model",
                "paper": f"+{PAPER_P90_GAIN}% (baseline unspecified)",
                "erase_fx": f"{mean:+.2f}% ± {std:.2f} ({fastest} vs eager)",
                "verdict": verdict(mean, std, PAPER_P90_GAIN),
                "note": "most of this gain is compilation (Inductor, CUDA graphs), not the "
                        "schedule: compare the row above",
            })
    else:
        rows.append({"claim": "p90 QPS gain of the early-backward schedule",
                     "paper": f"+{PAPER_P90_GAIN}%",
                     "erase_fx": "not measured in this run (no erase variant with Inductor, "
                                 "or no stock baseline; CPU runs measure no speed)",
                     "verdict": "not comparable"})
    ne_variant = fastest or ("erase/aot_eager" if "erase/aot_eager" in grouped else None)
    if ne_variant:
        parts = [f"{v} {fmt_mean_std(*mean_std([r.final_ne for r in grouped[v]]), digits=5)}"
                 for v in (ne_variant, "eager", "baseline") if v in grouped]
        rows.append({"claim": "NE of the fastest configuration",
                     "paper": "not measured",
                     "erase_fx": "final eval NE: " + "; ".join(parts)
                                 + _against_rounding(exact, ne_variant),
                     "verdict": "not comparable",
                     "note": "the paper gives no NE to compare with"})
    proof = next((r for r in exact if r["required"]), None)
    if proof:
        numbers = proof["numbers"]
        rows.append({"claim": "the early backward leaves training unchanged",
                     "paper": "not shown",
                     "erase_fx": f"erase/aot_eager vs eager over {args.steps} steps x "
                                 f"{numbers['seeds']} seeds: max |d train loss| "
                                 f"{numbers['max_train_loss_diff']:.3g}, |d NE| "
                                 f"{numbers['final_ne_diff']:.3g}, max |d param| "
                                 f"{fmt(numbers['max_param_diff'], 3)}",
                     "verdict": "not comparable",
                     "note": "exact equality is the erase_fx guarantee; the paper has no number"})
    zero = sorted({r["group"] for r in audit_rows if r["status"] == "FAIL"})
    text = ("every block's gradient is non-zero at the audited steps" if not zero
            else "zero gradient in " + ", ".join(zero))
    if demo:
        found = demo["explain"]
        text += (f"; without local losses on blocks 1-{k - 1} their gradient is exactly zero "
                 f"(frozen): erase_fx finds {len(found['no_local_loss']['early_blocks'])} early "
                 f"blocks, vs {len(found['with_local_losses']['early_blocks'])} with local "
                 f"losses")
        text += _frozen_ne(demo, grouped)
    losses = (f"BCE head on block {k} only (this run: --no-local-loss)" if args.no_local_loss
              else f"BCE head per block (weight {args.local_weight})")
    rows.append({"claim": "local losses of the detached blocks",
                 "paper": "not specified",
                 "erase_fx": f"{losses}; {text}",
                 "verdict": "not comparable",
                 "note": "without local losses a speed-up comes from freezing blocks, not from "
                         "scheduling"})
    return rows
