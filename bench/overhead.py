"""Where the CPU time of a training step goes: ``python -m bench.overhead``.

On small models a step replayed from CUDA graphs is bound by the CPU work
around the replays (AOTAutograd's wrappers, the autograd engine, copies into
static buffers, gradient clones). This profiles that work with cProfile for
each variant (`bench.harness`'s names: ``reduce-overhead``, ``erase+graphs``,
``erase+step``, ...), side by side, and prints the functions with the most
own time. Needs a GPU.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from bench.harness import build_step
from bench.models import build_config, parse_config


def profile_variant(cfg, name: str, steps: int, top: int,
                    trace_dir: str | None = None) -> None:
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
    print(f"=== {cfg} {name}: {1e3 * cpu_s:.3f} ms of CPU per step to issue it "
          f"(no profiler); cProfile over {steps} steps, by own time:")
    print(out.getvalue())
    if trace_dir:
        trace_steps(step, f"{trace_dir}/{name.replace('+', '_').replace('/', '_')}.json", top)


def trace_steps(step, path: str, top: int, steps: int = 10) -> None:
    """torch.profiler over a few steps: the CPU calls and kernels that take the time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(f"torch.profiler over {steps} steps, by self CPU time:")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=top))
    print(f"torch.profiler over {steps} steps, by device time:")
    print(averages.table(sort_by="self_device_time_total", row_limit=top))
    prof.export_chrome_trace(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="mlp:128:2000:2000:4",
                        help="any bench.run config (bench.models.parse_config)")
    parser.add_argument("--variants", default="reduce-overhead,erase+graphs")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--trace-dir", help="also run torch.profiler and write Chrome traces here")
    args = parser.parse_args(argv)
    cfg = parse_config(args.config)
    for name in args.variants.split(","):
        profile_variant(cfg, name, args.steps, args.top, args.trace_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
