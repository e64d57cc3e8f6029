"""Where a captured step's memory goes, by stream: ``python -m bench.memory_profile``.

Under CUDA graph capture torch's native caching allocator hands the memory
freed on a stream only to later allocations on that stream, so a whole-step
graph's private pool is, stream by stream, the most that stream ever had
alive at once (plus rounding). This script builds each variant's step
(`bench.harness.build_step`: compile, warm-up, capture) with the allocator's
history on (``torch.cuda.memory._record_memory_history``), then reads its
snapshot and says, for every stream that allocated in a CUDA graph pool:

- the pool memory the stream holds (the segments made for it);
- the most bytes it had alive at once during capture (its high-water mark),
  and the largest allocations alive at that moment, each with the line that
  made it (Inductor's generated code shows the buffer, its shape and dtype)
  and the erase_fx function it ran under, if any;
- where its pool is larger than its high-water mark (the slack): each time
  the pool grew by a large segment while at least as much as the request was
  free in its large segments (`pool_growths`: the free memory was cut into
  pieces too small, so the allocator made a new segment), with the
  allocation that grew it.

Streams are named where the script knows them: ``main`` (the caller's),
``capture`` (``compile_step``'s capture stream), ``side N`` (erase's side
streams), ``update N`` (the early optimizer's update streams), else by
number. The pure parts (`pool_by_stream`, `high_water_marks`) take a
snapshot dict and have CPU tests; the run needs a GPU.

``--keep-code DIR`` copies the generated files those allocations were made in;
with ``--keep-ir`` each comes with Inductor's scheduler IR of its graph, before
and after fusion (``<file>.ir_pre_fusion.txt``, ``.ir_post_fusion.txt``: the
nodes in the order the scheduler holds them, from Inductor's debug trace,
matched to the file by its code, `debug_ir_of`), to read why a kernel runs
where it does.

Each config and variant's report updates its section of the current table,
``bench/results/memory.md`` (``--out``; `bench.tables`): profiled again, a
config and variant replaces its section, the others stay with their date and
command. Example::

    python -m bench.memory_profile --configs gpt:16:384:256:8 \\
        --variants inductor+step,erase+step,erase+step/streams=0 --top 6
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import gc
import json
import linecache
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from bench.harness import in_graph_pool
from bench.tables import RESULTS, this_run, update_sections

MIB = 2**20
#: A frame whose file lies under one of these is the allocator's caller's machinery, not
#: the code that asked for the memory.
_MACHINERY = (os.sep + "torch" + os.sep, os.sep + "bench" + os.sep + "memory_profile.py")


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One allocation alive at a stream's high-water mark."""

    size: int
    made_by: str  # the first frame outside torch: "file:line: source text"
    under: str  # the innermost erase_fx function on the stack ("" if none)
    source: str = ""  # the path of the file ``made_by`` names


@dataclasses.dataclass(frozen=True)
class StreamMemory:
    """One stream's share of the graph pools: held, its high-water mark, what was alive then."""

    stream: int
    pool_bytes: int
    peak_bytes: int
    at_peak: tuple[Allocation, ...]


def pool_by_stream(snapshot: Mapping[str, Any]) -> dict[int, int]:
    """Bytes of CUDA graph pool segments, by the stream each segment serves."""
    held: dict[int, int] = {}
    for segment in snapshot["segments"]:
        if in_graph_pool(segment):
            held[segment["stream"]] = held.get(segment["stream"], 0) + segment["total_size"]
    return held


def _pool_ranges(snapshot: Mapping[str, Any]) -> list[tuple[int, int]]:
    return sorted((s["address"], s["address"] + s["total_size"])
                  for s in snapshot["segments"] if in_graph_pool(s))


def _inside(ranges: Sequence[tuple[int, int]], address: int) -> bool:
    """Whether ``address`` lies in one of ``ranges`` (sorted, disjoint ``[start, end)``)."""
    k = bisect.bisect_right(ranges, (address, math.inf)) - 1
    return k >= 0 and address < ranges[k][1]


def describe_frames(frames: Iterable[Mapping[str, Any]]) -> tuple[str, str, str]:
    """``(made_by, under, source)`` of an allocation's Python stack (innermost frame first)."""
    frames = list(frames)
    made_by, under, source_file = "?", "", ""
    for frame in frames:
        filename = frame.get("filename", "")
        if any(part in filename for part in _MACHINERY):
            continue
        source = linecache.getline(filename, frame.get("line", 0)).strip()
        made_by = f"{os.path.basename(filename)}:{frame.get('line')}: {source[:110]}"
        source_file = filename
        break
    for frame in frames:
        filename = frame.get("filename", "")
        if os.sep + "erase_fx" + os.sep in filename:
            under = f"erase_fx/{filename.split(os.sep + 'erase_fx' + os.sep)[-1]}:{frame['name']}"
            break
    return made_by, under, source_file


def _graph_pool_traces(snapshot: Mapping[str, Any]) -> Iterator[list[Mapping[str, Any]]]:
    """Per device trace of the allocator (``device_traces``), its entries inside the graph
    pools' segments, from the creation of the first of them on.

    NB: an address a graph pool holds now may have served the default pool before (a
    segment given back and mapped again): only what follows the graph pools' first segment
    counts.
    """
    ranges = _pool_ranges(snapshot)
    starts = {start for start, _ in ranges}
    for trace in snapshot.get("device_traces", []):
        first = next((k for k, e in enumerate(trace)
                      if e.get("action") == "segment_alloc" and e.get("addr") in starts), None)
        yield [] if first is None else [e for e in trace[first:]
                                        if _inside(ranges, e.get("addr", -1))]


def high_water_marks(snapshot: Mapping[str, Any], top: int = 8,
                     describe: Callable[[Iterable[Mapping[str, Any]]], tuple[str, str, str]]
                     = describe_frames) -> list[StreamMemory]:
    """Per stream with graph pool memory: what it holds, its high-water mark during capture
    and the ``top`` largest allocations alive then (largest pool first).

    The allocator's trace (``device_traces``) is replayed for the allocations
    inside graph pool segments, from the first of those segments' creation:
    ``alloc`` adds a block to its stream's live set, ``free_completed``
    takes it away (under capture a free completes when the block may be
    reused by its stream).
    """
    pools = pool_by_stream(snapshot)
    live: dict[int, dict[int, Mapping[str, Any]]] = {}
    live_bytes: dict[int, int] = {}
    peaks: dict[int, tuple[int, list[Mapping[str, Any]]]] = {}
    for trace in _graph_pool_traces(snapshot):
        for entry in trace:
            action, address = entry.get("action"), entry.get("addr", -1)
            if action not in ("alloc", "free_completed"):
                continue
            stream = entry["stream"]
            blocks = live.setdefault(stream, {})
            if action == "alloc":
                blocks[address] = entry
                live_bytes[stream] = live_bytes.get(stream, 0) + entry["size"]
                if live_bytes[stream] > peaks.get(stream, (0, []))[0]:
                    peaks[stream] = (live_bytes[stream], list(blocks.values()))
            elif address in blocks:
                live_bytes[stream] -= blocks.pop(address)["size"]
    report = []
    for stream in sorted(set(pools) | set(peaks), key=lambda s: -pools.get(s, 0)):
        peak, alive = peaks.get(stream, (0, []))
        largest = sorted(alive, key=lambda e: -e["size"])[:top]
        at_peak = tuple(Allocation(e["size"], *describe(e.get("frames", ()))) for e in largest)
        report.append(StreamMemory(stream, pools.get(stream, 0), peak, at_peak))
    return report


#: The native allocator's small blocks (requests up to 1 MiB) live in 2 MiB segments of their
#: own; the rest share the large segments. Free memory of one kind cannot serve the other.
SMALL_REQUEST = 2**20
SMALL_SEGMENT = 2 * 2**20


@dataclasses.dataclass(frozen=True)
class Growth:
    """One new large segment of a stream's graph pool during capture, and the allocation it
    served.

    ``free_before`` is the stream's large-segment memory not alive when the
    segment was made: at least ``request`` of it means the pool had room in
    total but no free block large enough (fragmentation); less means the
    stream needed more. ``largest_free`` is the largest run of that memory in
    one segment, what one request could have had: the 1.6 MiB tails of many
    26 MiB segments add up to a large ``free_before`` with a small
    ``largest_free``.
    """

    stream: int
    segment: int
    request: int
    held_before: int
    free_before: int
    largest_free: int
    made_by: str
    under: str

    @property
    def fragmented(self) -> bool:
        return self.free_before >= self.request


def pool_growths(snapshot: Mapping[str, Any],
                 describe: Callable[[Iterable[Mapping[str, Any]]], tuple[str, str, str]]
                 = describe_frames) -> list[Growth]:
    """Every large segment the graph pools gained, in order, with the stream's free
    large-segment memory then and the first allocation placed in it (the one that asked for
    it). Small blocks (`SMALL_REQUEST`) and their segments are left out; a segment freed
    (an earlier graph's, at an address a pool holds now) takes its blocks and its growth
    with it."""
    growths: dict[int, Growth] = {}  # by segment address, in order
    for trace in _graph_pool_traces(snapshot):
        segments: dict[int, dict[int, int]] = {}  # stream -> its large segments' sizes
        alive: dict[int, dict[int, int]] = {}
        waiting: dict[int, Mapping[str, Any]] = {}  # stream -> its new segment's entry
        for entry in trace:
            action, address = entry.get("action"), entry.get("addr", -1)
            stream, size = entry["stream"], entry.get("size", 0)
            blocks = alive.setdefault(stream, {})
            held = segments.setdefault(stream, {})
            if action in ("segment_alloc", "segment_free") and size == SMALL_SEGMENT:
                continue
            if action == "segment_alloc":
                waiting[stream] = {**entry, "held": sum(held.values()),
                                   "alive": sum(blocks.values()),
                                   "largest_free": _largest_free_run(held, blocks)}
                held[address] = size
            elif action == "segment_free":
                held.pop(address, None)
                growths.pop(address, None)
                for block in [b for b in blocks if address <= b < address + size]:
                    del blocks[block]
            elif action == "alloc" and size > SMALL_REQUEST:
                blocks[address] = size
                segment = waiting.get(stream)
                if segment is not None and segment["addr"] <= address < (
                        segment["addr"] + segment["size"]):
                    del waiting[stream]
                    made_by, under, _ = describe(entry.get("frames") or segment.get("frames", ()))
                    growths[segment["addr"]] = Growth(
                        stream, segment["size"], size, segment["held"],
                        segment["held"] - segment["alive"], segment["largest_free"], made_by,
                        under)
            elif action == "free_completed":
                blocks.pop(address, None)
    return list(growths.values())


def _largest_free_run(segments: Mapping[int, int], blocks: Mapping[int, int]) -> int:
    """The longest stretch of ``segments`` (address -> size) that no block in ``blocks``
    (address -> size) covers, within one segment."""
    largest = 0
    for start, size in segments.items():
        cursor, end = start, start + size
        for address in sorted(b for b in blocks if start <= b < end):
            largest = max(largest, address - cursor)
            cursor = max(cursor, address + blocks[address])
        largest = max(largest, end - cursor)
    return largest


def stream_names(program: Any = None) -> dict[int, str]:
    """Names of the streams this process knows: the caller's, the capture's, erase's."""
    from erase_fx.emit import streams

    names = {torch.cuda.current_stream().cuda_stream: "main"}
    index = torch.cuda.current_device()
    for label, pool in (("side", streams._pool), ("update", streams._update_pool),
                        ("comm", streams._comm_pool)):
        for k, stream in enumerate(pool.get(index, []), start=1):
            names[stream.cuda_stream] = f"{label} {k}"
    capture = getattr(program, "_side", None)
    if capture is not None:
        names[capture.cuda_stream] = "capture"
    return names


def format_report(title: str, report: Sequence[StreamMemory], names: Mapping[int, str],
                  growths: Sequence[Growth] = ()) -> str:
    total = sum(s.pool_bytes for s in report)
    lines = [f"## {title}: graph pools {total / MIB:.0f} MiB",
             "", "| stream | pool MiB | high-water MiB | largest alive then |", "|---|---|---|---|"]
    for s in report:
        largest = "; ".join(f"{a.size / MIB:.1f}" for a in s.at_peak[:6])
        lines.append(f"| {names.get(s.stream, s.stream)} | {s.pool_bytes / MIB:.0f} "
                     f"| {s.peak_bytes / MIB:.0f} | {largest} |")
    for s in report:
        if not s.at_peak:
            continue
        lines += ["", f"{names.get(s.stream, s.stream)} at its high-water mark:"]
        lines += [f"- {a.size / MIB:.1f} MiB {a.made_by}" + (f" (under {a.under})" if a.under else "")
                  for a in s.at_peak]
    for s in report:
        own = [g for g in growths if g.stream == s.stream]
        fragmented = [g for g in own if g.fragmented]
        if not fragmented:
            continue
        name = names.get(s.stream, s.stream)
        lines += ["", f"{name}'s pool grew by {len(own)} large segments, {len(fragmented)} of "
                      f"them with the request's size free in the others (fragmentation, "
                      f"{sum(g.segment for g in fragmented) / MIB:.1f} MiB):"]
        lines += [f"- +{g.segment / MIB:.1f} MiB for {g.request / MIB:.1f} MiB, "
                  f"{g.free_before / MIB:.1f} of {g.held_before / MIB:.1f} MiB free, the "
                  f"largest run {g.largest_free / MIB:.1f}: {g.made_by}"
                  + (f" (under {g.under})" if g.under else "") for g in fragmented]
    return "\n".join(lines)


def generated_files(report: Sequence[StreamMemory], streams: Iterable[int] | None = None) -> set[str]:
    """The generated (Inductor) source files the listed allocations were made in (of the
    ``streams`` given, or of all)."""
    wanted = None if streams is None else set(streams)
    return {a.source for s in report if wanted is None or s.stream in wanted
            for a in s.at_peak if a.source}


#: The files of Inductor's debug trace (one folder per compiled graph) kept with a graph's
#: generated code: the scheduler's nodes before and after fusion.
IR_FILES = ("ir_pre_fusion.txt", "ir_post_fusion.txt")


def debug_ir_of(code_path: str, trace_root: str) -> dict[str, str]:
    """The IR files (`IR_FILES`, by name) of the graph whose generated code is ``code_path``:
    from the folder under ``trace_root`` whose ``output_code.py`` has the same text (Inductor
    writes the module it runs there). Empty when none matches."""
    with open(code_path) as f:
        code = f.read()
    for folder, _, files in os.walk(trace_root):
        if "output_code.py" not in files:
            continue
        with open(os.path.join(folder, "output_code.py")) as f:
            if f.read() != code:
                continue
        return {name: os.path.join(folder, name) for name in IR_FILES if name in files}
    return {}


def profile_variant(cfg_text: str, variant: str, top: int, keep_code: str | None = None,
                    keep_streams: Sequence[str] | None = None,
                    keep_ir: bool = False) -> tuple[str, dict]:
    """Build one variant's step with the allocator's history on; its report, as text and data."""
    from bench.harness import WARMUP_STEPS, Variant, build_step, set_tf32
    from bench.models import build_config, parse_config

    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model, inputs = build_config(parse_config(cfg_text), torch.device("cuda"))
    set_tf32(True)
    trace_root = tempfile.mkdtemp(prefix="memory_profile_trace_") if keep_ir else None
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    try:
        with Variant.parse(variant).patched(), _inductor_trace(trace_root):
            built = build_step(variant, model, inputs)
            built.warm_up(WARMUP_STEPS)
            torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    names = stream_names(built.program)
    report = high_water_marks(snapshot, top=top)
    growths = pool_growths(snapshot)
    text = format_report(f"{cfg_text} {variant}", report, names, growths)
    if keep_code:
        os.makedirs(keep_code, exist_ok=True)
        streams = None if not keep_streams else [
            stream for stream, name in names.items() if name in keep_streams]
        for path in generated_files(report, streams):
            shutil.copy(path, keep_code)
            if trace_root is not None:
                for name, ir in debug_ir_of(path, trace_root).items():
                    shutil.copy(ir, os.path.join(keep_code, f"{os.path.basename(path)}.{name}"))
    if trace_root is not None:
        shutil.rmtree(trace_root, ignore_errors=True)
    data = {"config": cfg_text, "variant": variant,
            "capture": built.capture_info(),
            "streams": [{"stream": names.get(s.stream, str(s.stream)), "pool_bytes": s.pool_bytes,
                         "peak_bytes": s.peak_bytes,
                         "at_peak": [dataclasses.asdict(a) for a in s.at_peak]}
                        for s in report],
            "pool_growths": [{**dataclasses.asdict(g), "stream": names.get(g.stream, str(g.stream))}
                             for g in growths]}
    del built, model, inputs, snapshot
    return text, data


def _inductor_trace(root: str | None) -> Any:
    """Inside: Inductor writes its debug trace under ``root`` (nothing when None). Its FX
    graph cache is off there, so that every graph is compiled and traced."""
    if root is None:
        return contextlib.nullcontext()
    import torch._dynamo.config as dynamo_config
    from torch._inductor import config as inductor_config

    stack = contextlib.ExitStack()
    stack.enter_context(dynamo_config.patch(debug_dir_root=root))
    stack.enter_context(inductor_config.patch({"trace.enabled": True, "fx_graph_cache": False}))
    return stack


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="gpt:16:384:256:8")
    parser.add_argument("--variants", default="inductor+step,erase+step")
    parser.add_argument("--top", type=int, default=8,
                        help="allocations listed per stream at its high-water mark")
    parser.add_argument("--out", default=str(RESULTS / "memory.md"),
                        help="the sections file to update ('' for none)")
    parser.add_argument("--json", help="write the reports here as JSON too")
    parser.add_argument("--keep-code", metavar="DIR",
                        help="copy the generated files the listed allocations were made in here")
    parser.add_argument("--keep-code-of", metavar="STREAMS",
                        help="with --keep-code: only the files of these streams, by the names the "
                             "report gives them (comma-separated: 'side 1,capture')")
    parser.add_argument("--keep-ir", action="store_true",
                        help="with --keep-code: each file's scheduler IR before and after fusion "
                             "too (Inductor's debug trace; compiles without its FX graph cache)")
    args = parser.parse_args(argv)
    if args.keep_ir and not args.keep_code:
        parser.error("--keep-ir needs --keep-code DIR")
    if not torch.cuda.is_available():
        print("bench.memory_profile needs a CUDA device", file=sys.stderr)
        return 2
    results, sections, run = [], [], this_run("bench.memory_profile", argv)
    for cfg_text in args.configs.split(","):
        for variant in args.variants.split(","):
            print(f"{cfg_text} {variant} ...", flush=True)
            try:
                text, data = profile_variant(
                    cfg_text, variant, args.top, args.keep_code,
                    args.keep_code_of.split(",") if args.keep_code_of else None,
                    keep_ir=args.keep_ir)
            except Exception as error:  # one variant's failure is reported, the run goes on
                text, data = f"## {cfg_text} {variant}: failed: {error!r}", {
                    "config": cfg_text, "variant": variant, "error": repr(error)}
            print(text + "\n", flush=True)
            results.append(data)
            sections.append(section_of(text))
            if args.out:  # NB: after each variant, so a run cut short keeps what it measured
                update_sections(Path(args.out), title=TITLE, intro=INTRO, sections=sections,
                                run=run)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


TITLE = "bench.memory_profile: where each stream's graph pool goes"
INTRO = """\
Written by `python -m bench.memory_profile` (on the GPU, `bash bench/device_run.sh <part>`):
a section per config and variant, replaced when that pair is profiled again; `git log -p
bench/results/memory.md` shows what each run changed. Each: the step graph's pools by
stream (pool, high-water mark, the largest allocations alive then, each with the generated
line that made it), and where a pool grew while the request's size was free in it."""


def section_of(text: str) -> tuple[str, str]:
    """A report (`format_report`, or a failure) as a section: (config and variant, the rest)."""
    heading, _, rest = text.partition("\n")
    key, _, summary = heading.removeprefix("## ").partition(": ")
    return key, f"{summary}\n{rest}".strip("\n")


if __name__ == "__main__":
    sys.exit(main())
