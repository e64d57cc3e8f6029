"""Where the CPU time of a training step goes: ``python -m bench.overhead``.

On small models a step replayed from CUDA graphs is bound by the CPU work
around the replays (AOTAutograd's wrappers, the autograd engine, copies into
static buffers, gradient clones). This profiles that work with cProfile for
each variant (`bench.harness`'s names: ``reduce-overhead``, ``erase+graphs``,
``erase+step``, ...), side by side, and prints the functions with the most
own time. Each config and variant updates its section of the current table,
``bench/results/overhead.md`` (``--out``; `bench.tables`). Needs a GPU.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import textwrap
import time
from pathlib import Path

import torch

from bench.harness import build_step
from bench.models import build_config, parse_config
from bench.tables import RESULTS, this_run, update_sections


def profile_variant(cfg, name: str, steps: int, top: int,
                    trace_dir: str | None = None, shapes: bool = False) -> str:
    """Profile one variant's step; what it prints, as one text (the CPU time per step first)."""
    torch._dynamo.reset()
    device = torch.device("cuda")
    torch.manual_seed(0)
    model, inputs = build_config(cfg, device)
    step = build_step(name, model, inputs).step
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    cpu_s = (time.perf_counter() - start) / steps  # CPU time to issue a step
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    text = (f"{1e3 * cpu_s:.3f} ms of CPU per step to issue it (no profiler); cProfile over "
            f"{steps} steps, by own time:\n{out.getvalue()}")
    print(f"=== {cfg} {name}: {text}")
    if trace_dir:
        text += trace_steps(
            step, f"{trace_dir}/{name.replace('+', '_').replace('/', '_')}.json", top)
    if shapes:
        text += ops_by_shape(step, top)
    return text


def ops_by_shape(step, top: int, steps: int = 10) -> str:
    """The CPU ops a step calls (those outside its CUDA graphs' replays), by input shapes and
    by count: which tensors a variant detaches, copies or allocates each step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages(group_by_input_shape=True)
    text = (f"torch.profiler over {steps} steps, CPU ops by input shapes, most called first:\n"
            f"{averages.table(sort_by='count', row_limit=top)}\n")
    text = textwrap.indent(text, "  ")
    print(text)
    return text


def trace_steps(step, path: str, top: int, steps: int = 10) -> str:
    """torch.profiler over a few steps: the CPU calls and kernels that take the time (printed
    and returned)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    wall_ms = 1e3 * (time.perf_counter() - start) / steps
    averages = prof.key_averages()
    # NB: kernels of several streams may overlap, so their sum can exceed the wall time
    kernel_ms = sum(a.self_device_time_total for a in averages
                    if a.device_type == DeviceType.CUDA) / 1e3 / steps
    text = (f"torch.profiler over {steps} steps: {wall_ms:.3f} ms per step (profiled), "
            f"device time summed over kernels {kernel_ms:.3f} ms per step "
            f"({kernel_ms / wall_ms:.0%} of the step; below 100%: the GPU idles)\n"
            f"torch.profiler over {steps} steps, by self CPU time:\n"
            f"{averages.table(sort_by='self_cpu_time_total', row_limit=top)}\n"
            f"torch.profiler over {steps} steps, by device time:\n"
            f"{averages.table(sort_by='self_device_time_total', row_limit=top)}\n")
    # NB: indented, so that no line of a table (a kernel named "## Call ...") reads as a
    # section's heading in bench/results/overhead.md
    text = textwrap.indent(text, "  ")
    print(text)
    prof.export_chrome_trace(path)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="mlp:128:2000:2000:4",
                        help="any bench.run config (bench.models.parse_config)")
    parser.add_argument("--variants", default="reduce-overhead,erase+graphs")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--trace-dir", help="also run torch.profiler and write Chrome traces here")
    parser.add_argument("--shapes", action="store_true",
                        help="also list the CPU ops each step calls by input shapes")
    parser.add_argument("--out", default=str(RESULTS / "overhead.md"),
                        help="the sections file to update ('' for none)")
    args = parser.parse_args(argv)
    cfg = parse_config(args.config)
    run, sections = this_run("bench.overhead", argv), []
    for name in args.variants.split(","):
        text = profile_variant(cfg, name, args.steps, args.top, args.trace_dir, args.shapes)
        sections.append((f"{cfg} {name}", f"```\n{text.rstrip()}\n```"))
        if args.out:
            update_sections(Path(args.out), title=TITLE, intro=INTRO, sections=sections, run=run)
    return 0


TITLE = "bench.overhead: where a step's CPU time goes"
INTRO = """\
Written by `python -m bench.overhead` (on the GPU, `bash bench/device_run.sh overhead-a`):
a section per config and variant, replaced when that pair is profiled again; `git log -p
bench/results/overhead.md` shows what each run changed. Each: the CPU time to issue one
step (no profiler), then cProfile's functions by own time (and torch.profiler's tables
where the run asked for traces)."""


if __name__ == "__main__":
    sys.exit(main())
