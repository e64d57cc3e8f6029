"""What erase_fx's segment boundaries cost: ``python -m bench.segment_cost``.

erase_fx compiles a forward that holds early blocks in segments, one
Inductor graph per run of nodes on one stream (`passes/split_segments.py`).
A boundary passes every value that crosses it, written out and read back,
and Inductor cannot fuse across it. This measures that cost on its own: for
each config, one training step through the step API (``compile_step``),
timed side by side in one process (median, min and max of ``--trials``
trials of ``--steps`` steps, CUDA events):

- ``stock``: stock Inductor (``inductor+step``);
- ``one stream, segments``: erase with ``overlap=False`` (``erase+step/one-stream``):
  the segments and kernels of the default, on one stream;
- ``one stream, forward whole``: the same early-backward program with its
  forward compiled as one Inductor graph on the main stream
  (``erase+step/streams=0``): what the same work costs without boundaries;
- ``side streams, segments``: erase's default (``erase+step``);
- with ``--no-recompute``, also the two segmented rows with
  ``recompute_boundary_values=False`` (``/no-recompute``: every value read
  across the boundary, the default before 2026-12-02).

The gap between the second and third rows is what the boundaries cost;
between the second and fourth, what the overlap wins. ``--trace-dir`` also
writes a torch.profiler trace of 10 steps of each row (kernels inside the
CUDA graph included) and prints the GPU time per step by kernel family.
The rows update the current table, ``bench/results/segment_cost.md``
(``--out``; `bench.tables`): a config and row measured again replaces its
own. Needs a GPU.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness import build_step
from bench.models import build_config, parse_config
from bench.tables import RESULTS, this_run, update_table

#: (label, bench variant)
ROWS = (
    ("stock", "inductor+step"),
    ("one stream, segments", "erase+step/one-stream"),
    ("one stream, forward whole", "erase+step/streams=0"),
    ("side streams, segments", "erase+step"),
)
NO_RECOMPUTE_ROWS = (
    ("one stream, segments, no recompute", "erase+step/one-stream/no-recompute"),
    ("side streams, segments, no recompute", "erase+step/no-recompute"),
)


def time_steps(step, trials: int, steps: int) -> list[float]:
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return times


def kernel_families(trace_path: str, steps: int) -> dict[str, float]:
    """GPU microseconds per step by kernel family, from a Chrome trace."""
    import json

    families: dict[str, float] = collections.Counter()
    for event in json.load(open(trace_path))["traceEvents"]:
        if event.get("ph") != "X" or event.get("cat") != "kernel":
            continue
        name = event["name"]
        if name.startswith("nvjet") or "gemm" in name or "cutlass" in name:
            family = "matrix products"
        elif "sdpa" in name or "cudnn" in name:
            family = "cuDNN (attention, conv)"
        elif name.startswith("triton_"):
            family = f"Triton {name.split('_')[1]}"
        else:
            family = "other"
        families[family] += event["dur"] / steps
    return dict(sorted(families.items(), key=lambda kv: -kv[1]))


def measure(cfg, label: str, variant: str, args) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = build_config(cfg, torch.device("cuda"))
    began = time.perf_counter()
    built = build_step(variant, model, inputs)
    for _ in range(5):
        built.step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - began
    times = time_steps(built.step, args.trials, args.steps)
    row = {"label": label, "median": statistics.median(times), "min": min(times),
           "max": max(times), "compile_s": compile_s}
    if args.trace_dir:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                built.step()
            torch.cuda.synchronize()
        path = f"{args.trace_dir}/{cfg}-{label}.json".replace(":", "_").replace(" ", "_")
        prof.export_chrome_trace(path.replace(",", ""))
        row["families"] = kernel_families(path.replace(",", ""), 10)
    print(f"  {cfg} {label}: {row['median']:.3f} ms (min {row['min']:.3f}, max "
          f"{row['max']:.3f}), compile and warm-up {compile_s:.0f} s", flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="gpt:8:768:1024:6,gpt:16:384:256:8")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-recompute", action="store_true",
                        help="also the segmented rows with recompute_boundary_values=False")
    parser.add_argument("--trace-dir", help="write a profiler trace of each row here")
    parser.add_argument("--out", default=str(RESULTS / "segment_cost.md"),
                        help="the table to update ('' for none)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.segment_cost needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    rows = list(ROWS) + list(NO_RECOMPUTE_ROWS if args.no_recompute else ())
    tables, run = [], this_run("bench.segment_cost", argv)
    for text in args.configs.split(","):
        cfg = parse_config(text)
        measured = [measure(cfg, *row, args) for row in rows]
        tables.append((cfg, measured))
        if args.out:
            update_table(Path(args.out), title=TITLE, intro=INTRO, columns=COLUMNS,
                         key=("config", "row"), rows=table_rows(cfg, measured, args), run=run)
    print(f"\ntorch {torch.__version__} on {torch.cuda.get_device_name()}: one step through "
          f"compile_step, median (min, max) of {args.trials} x {args.steps} steps")
    for cfg, measured in tables:
        stock = measured[0]["median"]
        print(f"\n| {cfg} | ms | min | max | vs stock |\n|---|---|---|---|---|")
        for row in measured:
            print(f"| {row['label']} | {row['median']:.3f} | {row['min']:.3f} | "
                  f"{row['max']:.3f} | {row['median'] / stock:.2f}x |")
        if args.trace_dir:
            families = sorted({f for row in measured for f in row.get("families", {})})
            print(f"\nGPU time per step by kernel family (us), {cfg}:\n| family | "
                  + " | ".join(row["label"] for row in measured) + " |\n|---|"
                  + "---|" * len(measured))
            for family in families:
                print(f"| {family} | " + " | ".join(
                    f"{row['families'].get(family, 0):.0f}" for row in measured) + " |")
    return 0


COLUMNS = ("config", "row", "variant", "ms median", "min", "max", "vs stock", "compile s")
TITLE = "bench.segment_cost: what the segment boundaries cost"
INTRO = """\
Written by `python -m bench.segment_cost` (on the GPU, `bash bench/device_run.sh
segments-a`): one training step through `compile_step`, median (min, max) of the run's
trials; a config's row measured again replaces its own; `git log -p
bench/results/segment_cost.md` shows what each run changed. The gap between `one stream,
segments` and `one stream, forward whole` is what the boundaries cost; between `one stream,
segments` and `side streams, segments`, what the overlap wins."""


def table_rows(cfg, measured: list[dict], args) -> list[dict]:
    variants = dict(ROWS + NO_RECOMPUTE_ROWS)
    stock = measured[0]["median"]
    return [{"config": str(cfg), "row": row["label"], "variant": variants[row["label"]],
             "ms median": f"{row['median']:.3f}", "min": f"{row['min']:.3f}",
             "max": f"{row['max']:.3f}", "vs stock": f"{row['median'] / stock:.2f}x",
             "compile s": f"{row['compile_s']:.0f}"} for row in measured]


if __name__ == "__main__":
    sys.exit(main())
