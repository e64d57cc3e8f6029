"""The time erase's runtime adds to a step where no CUDA graph hides it: ``python -m
bench.driver_overhead``.

Without a replay (the first calls, a step ``compile_step`` cannot capture, a forward whose
CUDA graph is refused, the CPU), every step runs erase's own Python: the stream program's
driver, the backward's wrappers (the in-place scaling of early gradients), the hooks on
each forward's outputs. On a tiny model, where the kernels cost next to nothing, the
difference between erase's step and stock's is that runtime. Stock and erase are timed in
interleaved rounds (machines are noisy); the medians and their difference are printed.

Usage::

    python -m bench.driver_overhead [--config mlp:2:8:8:4] [--inner inductor]
                                    [--rounds 15] [--steps 100]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

from bench.harness import build_step
from bench.models import build_config, parse_config


def measure(config: str, inner: str, rounds: int, steps: int,
            device: torch.device) -> dict[str, list[float]]:
    """Per backend, the microseconds per step of each round."""
    torch.manual_seed(0)
    model, inputs = build_config(parse_config(config), device)
    # NB: stock is torch.compile(backend=inner); each its own copy of the model
    runs = {backend: build_step(variant, copy.deepcopy(model), inputs, inner=inner).step
            for backend, variant in (("stock", "inductor"), ("erase", "erase"))}
    for step in runs.values():
        for _ in range(20):  # warm
            step()
    times: dict[str, list[float]] = {backend: [] for backend in runs}
    for _ in range(rounds):
        for backend, step in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[backend].append((time.perf_counter() - start) / steps * 1e6)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="mlp:2:8:8:4", help="a bench.run config")
    parser.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps: at least 1")
    times = measure(args.config, args.inner, args.rounds, args.steps, torch.device(args.device))
    median = {backend: statistics.median(t) for backend, t in times.items()}
    print(f"{args.config}, inner {args.inner}, {args.device}, {args.rounds} interleaved rounds "
          f"of {args.steps} steps (us per step, median and range):")
    for backend, t in times.items():
        print(f"  {backend:5s} {median[backend]:8.1f}  ({min(t):.1f}-{max(t):.1f})")
    print(f"  erase's runtime above stock: {median['erase'] - median['stock']:.1f} us per step "
          f"({median['erase'] / median['stock']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
