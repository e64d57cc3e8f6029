"""The host time of one CUDA graph replay, by the graph's shape (issue 37: the drop-in's replays).

The drop-in's profile (``bench/results/overhead.md``) puts erase's forward and backward replays
at 85-265 µs of host time each against about 20 for reduce-overhead's graphs, with the same
kernels in all. A graph erase captures is not a straight line: its side streams fork from the
capture stream and join it, so it has parallel branches. This measures whether that shape is
what costs: the same ``N`` tiny kernels captured as one chain on one stream, as one chain that
hops between two streams (a straight line still, through events), and as ``B`` parallel
chains on ``B`` streams forked from the capture stream and joined to it; ``torch.cuda.CUDAGraph
.replay()``'s host time, median over replays (each followed by a synchronize, outside the
timed part).

Usage (GPU only)::

    python -m bench.graph_launch [--kernels 100,400,1600] [--replays 200]

It prints one table and writes it to ``bench/results/graph_launch.md`` (overwritten).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "graph_launch.md"


def _one_stream(x: torch.Tensor, kernels: int) -> None:
    for _ in range(kernels):
        x.add_(1)


def _hopping(x: torch.Tensor, kernels: int, every: int = 10) -> None:
    """One chain; every ``every`` kernels it moves to the other stream (a straight line)."""
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    for i in range(kernels):
        if i % every == 0 and i:
            here, there = streams[(i // every - 1) % 2], streams[(i // every) % 2]
            there.wait_stream(here)
        with torch.cuda.stream(streams[(i // every) % 2]):
            x.add_(1)
    streams[0].wait_stream(streams[((kernels - 1) // every) % 2])


def _branches(xs: list[torch.Tensor], kernels: int) -> None:
    """``len(xs)`` chains of ``kernels // len(xs)`` kernels on as many streams, forked from
    the capture stream and joined to it."""
    main = torch.cuda.current_stream()
    side = [main] + [torch.cuda.Stream() for _ in xs[1:]]
    for stream in side[1:]:
        stream.wait_stream(main)
    for stream, x in zip(side, xs):
        with torch.cuda.stream(stream):
            for _ in range(kernels // len(xs)):
                x.add_(1)
    for stream in side[1:]:
        main.wait_stream(stream)


def replay_host_us(body: Callable[[], None], replays: int) -> tuple[float, float, float]:
    """Median, min and max host µs of one ``replay()`` of ``body`` captured."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up, uncaptured
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        body()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = time.perf_counter()
        graph.replay()
        times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times), min(times), max(times)


def measure(kernel_counts: list[int], replays: int) -> list[tuple[str, int, float, float, float]]:
    rows = []
    for n in kernel_counts:
        x = torch.zeros(256, device="cuda")
        xs = [torch.zeros(256, device="cuda") for _ in range(4)]
        shapes: list[tuple[str, Callable[[], None]]] = [
            ("one stream, one chain", lambda: _one_stream(x, n)),
            ("two streams, one chain (hops every 10)", lambda: _hopping(x, n)),
            ("2 branches", lambda: _branches(xs[:2], n)),
            ("4 branches", lambda: _branches(xs, n)),
        ]
        for name, body in shapes:
            median, low, high = replay_host_us(body, replays)
            rows.append((name, n, median, low, high))
            print(f"  {n} kernels, {name}: {median:.1f} µs", file=sys.stderr)
    return rows


def markdown(rows: list[tuple[str, int, float, float, float]], command: str) -> str:
    device = torch.cuda.get_device_name()
    lines = [
        "# bench.graph_launch: host time of one CUDA graph replay, by the graph's shape",
        "",
        f"`{command}` on {device}, torch {torch.__version__}: `CUDAGraph.replay()`'s host "
        "time (µs, median over replays, min-max), each graph of tiny `add_` kernels.",
        "",
        "| kernels | shape | host µs per replay | min-max |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n} | {name} | {median:.1f} | {low:.1f}-{high:.1f} |"
              for name, n, median, low, high in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default="100,400,1600",
                        help="comma-separated kernel counts per graph (default 100,400,1600)")
    parser.add_argument("--replays", type=int, default=200, help="timed replays per graph")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("bench.graph_launch needs a CUDA device")
    counts = [int(k) for k in args.kernels.split(",") if k]
    if not counts or min(counts) < 4 or args.replays < 1:
        parser.error("--kernels: counts of at least 4; --replays: at least 1")
    table = markdown(measure(counts, args.replays),
                     "python -m bench.graph_launch " + " ".join(argv or sys.argv[1:]))
    RESULTS.write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
