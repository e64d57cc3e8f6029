"""The GPU benchmark: every variant of every config, side by side, in one run.

``python -m bench.run`` times one training step (forward and backward) of
the detached chains in `bench.models` under each variant:

- ``eager``: the model as written;
- ``paper``: the ERASE paper's eager scheme (`PaperSchedule`): each block's
  forward and ``loss.backward()`` on a side stream inside the forward;
- ``inductor``: ``torch.compile(model)``;
- ``reduce-overhead``: ``torch.compile(model, mode="reduce-overhead")``;
- ``inductor+graph``: ``torch.compile(model)`` with the whole step captured
  by hand in one ``torch.cuda.CUDAGraph`` (the strongest plain baseline);
- ``erase``: ``backend="erase"``, Inductor inside, no CUDA graphs;
- ``erase+graphs``: ``backend="erase"`` with its CUDA graphs;
- ``erase+step-graph``: ``backend="erase"`` (its own CUDA graphs off) with
  the whole step captured by hand in one ``torch.cuda.CUDAGraph``, exactly
  as ``inductor+graph``: the schedule's worth once the CPU is out of the way;
- ``erase+graphs/streams=N`` (``--streams``): erase+graphs with N side streams,
  and ``erase+graphs/one-stream``, ``erase+step-graph/one-stream``: every
  segment on the main stream (no overlap: what the schedule alone is worth).

Each row: the median, min and max over trials of the mean step time of
``--steps-per-trial`` steps (CUDA events, after warm-up), peak memory
allocated while timing, compile time (first calls: compile and capture),
the largest relative gradient error of any parameter against eager on the
first step (tf32 off for that step; Inductor variants differ from eager by
Inductor's own rounding, about 1e-3 here, and ``bench.check_cuda`` holds
erase to stock Inductor instead), and achieved TFLOP/s (matrix FLOPs).
Timing runs with tf32 on. Writes ``bench/results/<date>-<gpu>.json`` and a
Markdown table beside it; prints a progress line per variant. Needs a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import re
import sys
import time
from pathlib import Path

import torch

from bench.check_cuda import OneStream, compile_erase, grads_of, max_rel_err, time_steps
from bench.check_cuda import whole_step_graph
from bench.models import ChainConfig, DetachedChain, PaperSchedule, make_inputs, step_flops

CONFIGS = ("ctr:1024:512:1024:6", "mlp:512:1024:2048:6", "mlp:128:2000:2000:4",
           "ctr:4096:1024:2048:6", "ctr:16384:1024:2048:6")
VARIANTS = ("eager", "paper", "inductor", "reduce-overhead", "inductor+graph", "erase",
            "erase+graphs", "erase+step-graph")
#: The variants whose step is captured whole, by hand, in one CUDA graph.
STEP_GRAPHS = ("inductor+graph", "erase+step-graph")
#: The erase variants judged against the targets.
JUDGED = ("erase+graphs", "erase+step-graph")
SMALL = CONFIGS[:3]
RESULTS = Path(__file__).parent / "results"


def build_step(name: str, model: DetachedChain, inputs):
    """A callable running one training step of ``model`` under variant ``name``."""
    if name == "eager":
        fn = model
    elif name == "paper":
        fn = PaperSchedule(model)
    elif name == "inductor":
        fn = torch.compile(model)
    elif name == "reduce-overhead":
        fn = torch.compile(model, mode="reduce-overhead")
    elif name.split("/")[0] in STEP_GRAPHS:
        raise ValueError(f"{name} is built by measure(): it captures a compiled step")
    elif name == "erase":
        fn = compile_erase(model, inner="inductor", cudagraphs=False)
    elif name.startswith("erase+graphs"):
        streams = re.fullmatch(r"erase\+graphs(?:/streams=(\d+)|/one-stream)?", name)
        if streams is None:
            raise ValueError(f"unknown variant {name!r}")
        options = {"streams": int(streams.group(1))} if streams.group(1) else {}
        fn = compile_erase(model, inner="inductor", cudagraphs=True, **options)
    else:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")

    def step():
        model.zero_grad(set_to_none=True)
        fn(*inputs).backward()

    return step


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def measure(cfg: ChainConfig, name: str, base: DetachedChain, inputs, reference, args) -> dict:
    """One row: build the variant, check its first step, time it."""
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    one_stream = OneStream() if name.endswith("/one-stream") else contextlib.nullcontext()
    start = time.perf_counter()
    with one_stream:
        set_tf32(False)
        if name.split("/")[0] in STEP_GRAPHS:
            if name == "inductor+graph":
                fn = torch.compile(model)
            else:
                fn = compile_erase(model, inner="inductor", cudagraphs=False)
            fn(*inputs).backward()  # compiles; the graph below captures the same function
            err = max_rel_err(reference, grads_of(model))
            set_tf32(True)
            step = whole_step_graph(model, fn, inputs)
        else:
            step = build_step(name, model, inputs)
            step()  # compiles; the CUDA graph variants warm up here (no capture yet)
            err = max_rel_err(reference, grads_of(model))
            set_tf32(True)
            step()  # the CUDA graph variants capture here
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        torch.cuda.reset_peak_memory_stats()
        median, low, high = time_steps(step, args.trials, args.steps_per_trial, warmup=5)
        peak = torch.cuda.max_memory_allocated()
    del step, model
    gc.collect()
    torch.cuda.empty_cache()
    row = {
        "config": str(cfg), "variant": name, "ms_median": median, "ms_min": low, "ms_max": high,
        "peak_mem_bytes": peak, "compile_s": compile_s, "grad_max_rel_err": err,
        "tflops": step_flops(cfg) / (median * 1e-3) / 1e12,
    }
    print(f"  {cfg} {name:26s} {median:8.3f} ms (min {low:.3f}, max {high:.3f}) "
          f"{row['tflops']:6.1f} TFLOP/s, peak {peak / 2**20:6.0f} MiB, "
          f"compile {compile_s:5.1f} s, grad err {err:.1e}", flush=True)
    return row


def run_config(cfg: ChainConfig, variants, args, out_of_time=lambda: False) -> list[dict]:
    device = torch.device("cuda")
    torch.manual_seed(0)
    base = DetachedChain(cfg).to(device)
    inputs = make_inputs(cfg, device, torch.Generator(device=device).manual_seed(0))
    set_tf32(False)
    reference_model = copy.deepcopy(base)
    reference_model(*inputs).backward()
    reference = grads_of(reference_model)
    del reference_model
    rows = []
    for name in variants:
        if out_of_time():
            print(f"  {cfg} {name}: skipped, --budget-s spent", flush=True)
            continue
        if name == "paper" and cfg.towers:
            print(f"  {cfg} {name}: skipped, the paper's scheme needs a detached chain",
                  flush=True)
            continue
        rows.append(measure(cfg, name, base, inputs, reference, args))
    return rows


# -- the targets of the GPU issue, judged on ratios measured in this run ----------


def ratio(rows, config, variant, baseline) -> float | None:
    times = {(r["config"], r["variant"]): r["ms_median"] for r in rows}
    if (config, variant) not in times or (config, baseline) not in times:
        return None
    return times[(config, variant)] / times[(config, baseline)]


def judge_targets(rows) -> list[dict]:
    """The erase variants against the targets: ratios from this run, met or missed."""
    return [dict(t, variant=variant) for variant in JUDGED
            for t in _judge_variant(rows, variant)]


def _judge_variant(rows, variant: str) -> list[dict]:
    targets = []
    for config in CONFIGS:
        limits = []
        if config in SMALL:
            limits = [("inductor+graph", 0.85), ("reduce-overhead", 0.75)]
        elif config.startswith("ctr:4096"):
            limits = [("inductor+graph", 0.97)]
        elif config.startswith("ctr:16384"):
            limits = [("inductor+graph", 1.0)]
        for baseline, limit in limits:
            value = ratio(rows, config, variant, baseline)
            if value is not None:
                targets.append({"config": config, "vs": baseline, "ratio": value,
                                "limit": limit, "met": value <= limit})
        peaks = {r["variant"]: r["peak_mem_bytes"] for r in rows if r["config"] == config}
        if variant in peaks and "inductor" in peaks:
            value = peaks[variant] / peaks["inductor"]
            targets.append({"config": config, "vs": "inductor peak memory", "ratio": value,
                            "limit": 1.0, "met": value <= 1.0})
    return targets


def markdown(meta: dict, rows: list[dict], targets: list[dict]) -> str:
    lines = [
        f"# erase_fx GPU benchmark, {meta['date']}",
        "",
        f"{meta['gpu']}, torch {meta['torch']}, tf32 on; one training step (forward and "
        f"backward); median, min and max of {meta['trials']} trials of "
        f"{meta['steps_per_trial']} steps (CUDA events). Command: `{meta['command']}`.",
        "",
        "| config | variant | ms median | min | max | vs inductor+graph | vs reduce-overhead "
        "| TFLOP/s | peak MiB | compile s | grad max rel err vs eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs_graph = ratio(rows, r["config"], r["variant"], "inductor+graph")
        vs_reduce = ratio(rows, r["config"], r["variant"], "reduce-overhead")
        lines.append(
            f"| {r['config']} | {r['variant']} | {r['ms_median']:.3f} | {r['ms_min']:.3f} | "
            f"{r['ms_max']:.3f} | {_x(vs_graph)} | {_x(vs_reduce)} | {r['tflops']:.1f} | "
            f"{r['peak_mem_bytes'] / 2**20:.0f} | {r['compile_s']:.1f} | "
            f"{r['grad_max_rel_err']:.1e} |")
    lines += ["", "Targets (ratios of medians in this run):", "",
              "| variant | config | against | ratio | target | |", "|---|---|---|---|---|---|"]
    for t in targets:
        lines.append(f"| {t['variant']} | {t['config']} | {t['vs']} | {t['ratio']:.2f} | "
                     f"<= {t['limit']:.2f} | {'met' if t['met'] else 'MISSED'} |")
    return "\n".join(lines) + "\n"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="kind:B:d:h:K, comma-separated, kind one of ctr, mlp (detached "
                             "chains), ctr-towers, mlp-towers (towers over a shared front), "
                             "ctr-towers-top, mlp-towers-top (and a top head over the detached "
                             "towers; default: the five chains of the issue)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--streams", default="1,2,8",
                        help="extra erase+graphs rows with these side-stream counts ('' for "
                        "none); the sweep configs also get one-stream rows of erase+graphs "
                        "and erase+step-graph")
    parser.add_argument("--sweep-configs", default=",".join(CONFIGS[:4]),
                        help="configs that get the stream-count and one-stream rows ('' for "
                        "none)")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--steps-per-trial", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default bench/results/<date>-<gpu>.json)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new row after this many seconds (a device call has a "
                        "time limit); the results file is rewritten after every config, so "
                        "what ran is kept either way")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="no run: merge results files of runs split across device calls "
                        "(same GPU and torch) into --out")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if not torch.cuda.is_available():
        print("bench.run needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    words = sys.argv[1:] if argv is None else argv
    meta = {"date": date, "gpu": gpu, "torch": torch.__version__, "trials": args.trials,
            "steps_per_trial": args.steps_per_trial, "tf32": True,
            "command": " ".join(["python -m bench.run", *words])}
    print(f"torch {meta['torch']} on {gpu}", flush=True)
    sweep = [f"erase+graphs/streams={n}" for n in args.streams.split(",") if n]
    sweep += ["erase+graphs/one-stream", "erase+step-graph/one-stream"]
    out = args.out or RESULTS / f"{date}-{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}.json"
    start = time.perf_counter()

    def out_of_time() -> bool:
        return args.budget_s is not None and time.perf_counter() - start > args.budget_s

    rows = []
    for text in args.configs.split(","):
        variants = args.variants.split(",")
        if text in args.sweep_configs.split(","):
            variants += sweep
        print(f"{text}: {len(variants)} variants", flush=True)
        rows += run_config(ChainConfig.parse(text), variants, args, out_of_time)
        write(out, meta, rows, quiet=True)  # NB: a killed run keeps what it measured
    write(out, meta, rows)
    return 0


def write(out: Path, meta: dict, rows: list[dict], quiet: bool = False) -> None:
    targets = judge_targets(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows, "targets": targets}, indent=1) + "\n")
    table = markdown(meta, rows, targets)
    out.with_suffix(".md").write_text(table)
    if not quiet:
        print("\n" + table)
        print(f"wrote {out} and {out.with_suffix('.md')}")


def merge(parts: list[Path], out: Path | None) -> int:
    """One results file from runs split across device calls (each call has a time limit)."""
    loaded = [json.loads(p.read_text()) for p in parts]
    first = loaded[0]["meta"]
    for other in loaded[1:]:
        if (other["meta"]["gpu"], other["meta"]["torch"]) != (first["gpu"], first["torch"]):
            print(f"cannot merge runs on different GPUs or torch versions: {parts}",
                  file=sys.stderr)
            return 2
    meta = dict(first, command=" ; ".join(part["meta"]["command"] for part in loaded))
    slug = re.sub(r"[^a-z0-9]+", "-", first["gpu"].lower()).strip("-")
    write(out or RESULTS / f"{first['date']}-{slug}.json", meta,
          [row for part in loaded for row in part["rows"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
