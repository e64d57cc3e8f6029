"""How much of the early work the GPU hid under the forward, measured from a profile.

erase_fx puts each early block's head, local loss and early backward on a
side stream (``1 + block % streams``); the forward stays on the main stream.
Side-stream kernel time that overlaps main-stream kernels is early work hidden
under the forward; side-stream time with the main stream idle is not hidden
(it would have cost the same on one stream). `kernel_overlap` computes that
share from a list of kernel intervals, a pure function of its input::

    kernels = kernels_from_chrome_trace("trace.json")   # or kernels_from_profiler(prof)
    overlap = kernel_overlap(kernels)
    print(f"{overlap.fraction:.0%} of {overlap.side_us:.0f} us side-stream time overlapped")

Definitions (all times in microseconds):

- the *main stream* is the stream that ran the most kernel time, unless
  ``main_stream`` names it; every other stream is a *side stream*;
- ``side_us``: the time during which at least one side-stream kernel ran
  (the union of all side-stream kernel intervals, so two side kernels running
  at once count once);
- ``main_us``: the same for the main stream;
- ``overlapped_us``: the side-stream time during which at least one
  main-stream kernel was also running;
- ``fraction = overlapped_us / side_us`` (0 when there is no side-stream time).

The trace readers keep only device kernels (Chrome trace events with
``"cat": "kernel"``; profiler events on a CUDA device that are not memory
copies or sets).

`profile_training` runs training steps of a model compiled with
``backend="erase"`` under ``torch.profiler``, exports the Chrome trace and
measures the overlap: the ``erase-fx profile`` command. Each driver step is
labelled ``erase_fx/<segment>`` in the trace (``seg_1_block_0_stream_1``
names its block and stream). It profiles the backend as configured (by
default with CUDA graphs on a GPU, as training runs), whose replay hides
these labels: ``{"cudagraphs": False}`` shows them, at the price of the CPU
launching every segment (on small models that leaves the GPU idle, and the
overlap near zero).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: Where `profile_training` and ``erase-fx profile`` write the trace by default: a
#: folder of erase_fx's own (made if need be), which a checkout's ``.gitignore`` lists.
DEFAULT_TRACE_PATH = os.path.join("erase_fx_traces", "trace.json")
#: Chrome trace categories that count as kernels.
KERNEL_CATEGORIES = ("kernel",)
#: Profiler event name prefixes that are device work but not kernels.
_NOT_KERNEL_PREFIXES = ("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")


@dataclasses.dataclass(frozen=True, order=True)
class KernelInterval:
    """One kernel's run on the device.

    Attributes:
        stream: the stream id the kernel ran on (as the profiler reports it).
        start_us: start time, microseconds.
        end_us: end time, microseconds (``>= start_us``).
        name: the kernel's name.
    """

    stream: int
    start_us: float
    end_us: float
    name: str = ""

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


@dataclasses.dataclass(frozen=True)
class Overlap:
    """Side-stream kernel time and how much of it ran under main-stream kernels.

    Attributes:
        side_us: time during which at least one side-stream kernel ran.
        main_us: time during which at least one main-stream kernel ran.
        overlapped_us: side-stream time during which a main-stream kernel ran too.
        fraction: ``overlapped_us / side_us``; 0 when ``side_us`` is 0.
        main_stream: the stream taken as main (``None`` when there were no kernels).
        side_streams: the other streams, sorted.
    """

    side_us: float
    main_us: float
    overlapped_us: float
    fraction: float
    main_stream: int | None = None
    side_streams: tuple[int, ...] = ()

    def summary(self) -> str:
        """One line, e.g. for the ``erase-fx profile`` command."""
        if self.main_stream is None:
            return "no kernels in the trace"
        if not self.side_streams:
            return f"all kernels ran on one stream ({self.main_stream}): no side-stream time"
        return (
            f"side-stream kernel time {self.side_us:.1f} us (streams "
            f"{', '.join(map(str, self.side_streams))}), overlapped with main-stream "
            f"(stream {self.main_stream}) kernels {self.overlapped_us:.1f} us: "
            f"overlap fraction {self.fraction:.1%}; main-stream kernel time {self.main_us:.1f} us"
        )


# -- the math (pure) -----------------------------------------------------------

Span = tuple[float, float]


def merge_intervals(spans: Iterable[Span]) -> list[Span]:
    """The union of ``(start, end)`` spans, as sorted disjoint spans (empty ones dropped)."""
    merged: list[Span] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total_length(spans: Sequence[Span]) -> float:
    """Summed length of disjoint spans."""
    return sum(end - start for start, end in spans)


def intersection_length(a: Sequence[Span], b: Sequence[Span]) -> float:
    """Length of the intersection of two sorted lists of disjoint spans (a two-pointer sweep)."""
    i = j = 0
    length = 0.0
    while i < len(a) and j < len(b):
        start = max(a[i][0], b[j][0])
        end = min(a[i][1], b[j][1])
        if end > start:
            length += end - start
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return length


def busiest_stream(kernels: Iterable[KernelInterval]) -> int | None:
    """The stream with the most (merged) kernel time; the lowest id on a tie."""
    spans: dict[int, list[Span]] = {}
    for kernel in kernels:
        spans.setdefault(kernel.stream, []).append((kernel.start_us, kernel.end_us))
    if not spans:
        return None
    busy = {stream: total_length(merge_intervals(s)) for stream, s in spans.items()}
    # NB: deterministic on ties: the most time first, then the lowest stream id.
    return min(busy, key=lambda stream: (-busy[stream], stream))


def kernel_overlap(
    kernels: Iterable[KernelInterval], main_stream: int | None = None
) -> Overlap:
    """How much side-stream kernel time ran while a main-stream kernel was running.

    ``main_stream`` defaults to the stream that ran the most kernel time (see
    `busiest_stream`). See the module docstring for the definitions.
    """
    kernels = list(kernels)
    if main_stream is None:
        main_stream = busiest_stream(kernels)
    main = merge_intervals((k.start_us, k.end_us) for k in kernels if k.stream == main_stream)
    side = merge_intervals((k.start_us, k.end_us) for k in kernels if k.stream != main_stream)
    side_us = total_length(side)
    overlapped_us = intersection_length(side, main)
    return Overlap(
        side_us=side_us,
        main_us=total_length(main),
        overlapped_us=overlapped_us,
        fraction=overlapped_us / side_us if side_us > 0 else 0.0,
        main_stream=main_stream,
        side_streams=tuple(sorted({k.stream for k in kernels} - {main_stream})),
    )


# -- reading traces ------------------------------------------------------------


def kernels_from_chrome_trace(
    trace: str | os.PathLike | Mapping[str, Any] | Sequence[Mapping[str, Any]],
) -> list[KernelInterval]:
    """The kernels of a Chrome trace (``prof.export_chrome_trace(path)``), sorted by start.

    ``trace`` is a path (``.json`` or ``.json.gz``), the loaded JSON object
    (``{"traceEvents": [...]}``) or its list of events. A kernel is a complete
    event (``"ph": "X"``) with ``"cat": "kernel"``; its stream is
    ``args.stream`` (torch's Kineto traces), else the event's ``tid``.
    """
    if isinstance(trace, (str, os.PathLike)):
        trace = _load_json(trace)
    events = trace.get("traceEvents", ()) if isinstance(trace, Mapping) else trace
    kernels = []
    for event in events:
        if event.get("cat") not in KERNEL_CATEGORIES or event.get("ph", "X") != "X":
            continue
        if "ts" not in event or "dur" not in event:
            continue
        args = event.get("args") or {}
        stream = args.get("stream", event.get("tid"))
        start = float(event["ts"])
        kernels.append(KernelInterval(
            stream=int(stream), start_us=start, end_us=start + float(event["dur"]),
            name=str(event.get("name", "")),
        ))
    return sorted(kernels)


def kernels_from_profiler(prof: Any) -> list[KernelInterval]:
    """The device kernels of a finished ``torch.profiler.profile``, sorted by start.

    Reads ``prof.events()`` (``FunctionEvent``): events whose ``device_type``
    is CUDA, with ``time_range`` in microseconds and the stream in
    ``device_resource_id``; memory copies and sets are left out. When the
    events do not carry streams, `kernels_from_chrome_trace` on an exported
    trace is the robust route.
    """
    from torch.autograd import DeviceType

    kernels = []
    for event in prof.events() or ():
        if getattr(event, "device_type", None) != DeviceType.CUDA:
            continue
        if str(event.name).startswith(_NOT_KERNEL_PREFIXES):
            continue
        kernels.append(KernelInterval(
            stream=int(getattr(event, "device_resource_id", 0) or 0),
            start_us=float(event.time_range.start),
            end_us=float(event.time_range.end),
            name=str(event.name),
        ))
    return sorted(kernels)


def _load_json(path: str | os.PathLike) -> Any:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as file:
        return json.load(file)


# -- profiling training steps (the ``erase-fx profile`` command) ----------------

class NotALossError(TypeError):
    """The profiled model's forward did not return a scalar loss tensor."""


@dataclasses.dataclass(frozen=True)
class ProfileRun:
    """What `profile_training` measured.

    Attributes:
        trace_path: the Chrome trace it exported.
        device: where the model ran (``"cpu"``, ``"cuda:0"``).
        steps: the profiled training steps (warm-up steps not included).
        options: the erase backend options given (the rest are `EraseConfig`'s defaults).
        segment_labels: the distinct ``erase_fx/<segment>`` labels in the trace.
        overlap: the kernel overlap; None on CPU (no kernels, no streams).
    """

    trace_path: str
    device: str
    steps: int
    options: Mapping[str, Any]
    segment_labels: tuple[str, ...]
    overlap: Overlap | None


def profile_training(
    model: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    steps: int,
    warmup: int = 2,
    options: Mapping[str, Any] | None = None,
    trace_path: str | os.PathLike = DEFAULT_TRACE_PATH,
    device: str | None = None,
) -> ProfileRun:
    """Train ``model`` with ``backend="erase"`` under ``torch.profiler``; measure the overlap.

    Compiles ``model`` (whose forward returns a scalar loss) with the erase
    backend and ``options`` (the backend's defaults otherwise), moves it and its
    tensor inputs to ``device`` (default: CUDA when available, else CPU), runs
    ``warmup`` steps (compilation happens there), then ``steps`` steps of
    ``loss = model(*args, **kwargs); loss.backward()`` under the profiler (CPU
    activity, and CUDA when on a GPU), exports the Chrome trace to
    ``trace_path`` (its folder made if missing; default `DEFAULT_TRACE_PATH`)
    and reads the kernel overlap from it (`kernel_overlap`).
    """
    import torch

    from erase_fx.backend import make_backend
    from erase_fx.emit.program import PROFILE_LABEL_PREFIX

    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = target.type == "cuda"
    if isinstance(model, torch.nn.Module):
        model = model.to(target)
    args = _to_device(tuple(args), target)
    kwargs = _to_device(dict(kwargs or {}), target)
    options = dict(options or {})
    compiled = torch.compile(model, backend=make_backend(**options))

    def train_step() -> None:
        if isinstance(model, torch.nn.Module):
            model.zero_grad(set_to_none=True)
        loss = compiled(*args, **kwargs)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise NotALossError(
                f"the model must return a scalar loss tensor, got {_describe(loss)}")
        loss.backward()

    for _ in range(warmup):
        train_step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(target)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            train_step()
        if on_gpu:
            torch.cuda.synchronize(target)
    trace_path = os.fspath(trace_path)
    os.makedirs(os.path.dirname(os.path.abspath(trace_path)), exist_ok=True)
    prof.export_chrome_trace(trace_path)
    trace = _load_json(trace_path)
    labels = sorted({
        str(event.get("name")) for event in trace.get("traceEvents", ())
        if str(event.get("name", "")).startswith(PROFILE_LABEL_PREFIX)
    })
    return ProfileRun(
        trace_path=trace_path,
        device=str(target),
        steps=steps,
        options=options,
        segment_labels=tuple(labels),
        overlap=kernel_overlap(kernels_from_chrome_trace(trace)) if on_gpu else None,
    )


def _to_device(value: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"a {type(value).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else "")
