"""When a multi-stream forward may let go of a tensor under CUDA graph capture.

Outside capture, the caching allocator keeps a tensor's memory from being
reused while another stream may still read it (``record_stream``, which
`CudaStreams` calls on every cross-stream use), so `StreamProgram` drops
each slot right after its last reader. Under capture that guard is gone:
the allocator defers such frees to the end of the capture (no reuse at all),
and memory freed without it is handed to the next allocation of the stream
that made it, with no ordering against the other streams' reads. So under
capture erase_fx orders the reuse itself:

- a slot read only on the stream that made it is dropped after its last
  reader, as outside capture (one stream's work is ordered);
- a slot the **main stream** made and **side streams** read (a block's
  activations, read by its early backward, when its stage runs on the main
  stream) is, with a ``release_lag`` (None by default: held to the join),
  released later: an event is
  recorded on each side stream after its last read, and the main stream
  waits for those events before the main segment ``release_lag`` main
  segments on, then drops the slot. Memory the main stream reuses after
  that wait is written only after every read (the event orders them). The
  lag is the price: a main segment that waits for a side stream still
  busy stalls (a smaller lag frees sooner and risks more waiting);
- anything else (a side stream's values that the main stream reads, such as
  local losses; forward inputs, which the caller owns) is held until the
  join at the end of the forward, where every stream is ordered.

With each block's stage on its side stream (`Tuning.stages_on_side`),
the block's activations are made and read on that stream: the first rule
frees them right after the block's backward, and the side stream's next
stage reuses the memory, ordered by the stream itself.

Which lag pays depends on how long each side stream runs against the main
segments after its block: with ``release_lag="auto"`` `erase_fx.compile_step`
captures the step with each candidate lag and keeps one by timing
(`erase_fx.capture_tuning`); the program then plans with the lag of the
capture's trial (`StreamProgram.capture_plan_for`).

With ``release_lag="record_stream"`` (experimental, not yet measured on
the GPU) a captured run has no plan of erase's own: it drops every slot after
its last reader, as outside capture, and marks each step's inputs as used by
the step's stream (``record_stream``); under
``PYTORCH_ALLOC_CONF=graph_capture_record_stream_reuse:True`` the caching
allocator hands such memory to a later allocation of the stream that made it
once the captured graph orders every marked use before it (pytorch#162186).
`erase_fx.emit.memory_plan` predicts what that holds (its ``record_stream``
rule).

`plan_captured_releases` is a pure function of the program's steps; the
tests check its plans on CPU, the race stress in ``bench/check_cuda.py`` on
the GPU.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from erase_fx.passes import MAIN_STREAM


@dataclasses.dataclass(frozen=True)
class StepIO:
    """What the plan needs of one step: its stream, the slots it reads and writes; and the
    earlier steps whose events its stream waits for before it runs (`Step.waits`: what
    `erase_fx.emit.memory_plan` orders the steps by; the release plan does not read it)."""

    stream: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    waits: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class SlotUses:
    """Which step makes each slot and which steps read it (step indices, in launch order);
    shared by the release plan and the tools that explain it (``bench.held_to_join``)."""

    producer: dict[int, int]
    readers: dict[int, list[int]]

    @classmethod
    def of(cls, steps: Sequence[StepIO]) -> SlotUses:
        producer: dict[int, int] = {}
        readers: dict[int, list[int]] = {}
        for k, step in enumerate(steps):
            for slot in step.inputs:
                readers.setdefault(slot, []).append(k)
            for slot in step.outputs:
                if slot >= 0:
                    producer[slot] = k
        return cls(producer, readers)


@dataclasses.dataclass(frozen=True)
class CapturePlan:
    """Per step (by index), what a captured run does around it.

    Attributes:
        drops_after: slots dropped right after the step runs.
        records_event: the step (a side step) records an event on its stream
            after it runs.
        waits_before: for a main step, the side steps whose events the main
            stream waits for before it runs.
        releases_before: slots dropped after those waits, before the step runs.
    """

    drops_after: tuple[tuple[int, ...], ...]
    records_event: tuple[bool, ...]
    waits_before: tuple[tuple[int, ...], ...]
    releases_before: tuple[tuple[int, ...], ...]


def plan_captured_releases(
    steps: Sequence[StepIO], num_inputs: int, kept: set[int], release_lag: int | None
) -> CapturePlan:
    """The release plan of a captured run; see the module docstring.

    Args:
        steps: the program's steps in launch order.
        num_inputs: slots ``0 .. num_inputs - 1`` are the forward's inputs
            (held to the end: the caller owns them).
        kept: slots the forward returns (never dropped).
        release_lag: how many main steps after a block's last read of a main
            stream tensor the main stream waits for it and drops the tensor
            (None: such tensors are held to the join).
    """
    if release_lag is not None and release_lag < 1:
        raise ValueError(f"release_lag must be >= 1, not {release_lag}")
    uses = SlotUses.of(steps)
    producer, readers = uses.producer, uses.readers
    main_steps = [k for k, step in enumerate(steps) if step.stream == MAIN_STREAM]

    drops_after: list[list[int]] = [[] for _ in steps]
    records_event = [False] * len(steps)
    waits_before: list[set[int]] = [set() for _ in steps]
    releases_before: list[list[int]] = [[] for _ in steps]
    for slot, made_by in sorted(producer.items()):
        if slot in kept or slot < num_inputs or slot not in readers:
            continue
        home = steps[made_by].stream
        reads = readers[slot]
        cross = [k for k in reads if steps[k].stream != home]
        if not cross:
            drops_after[max(reads)].append(slot)
            continue
        if release_lag is None or home != MAIN_STREAM or any(
                steps[k].stream == MAIN_STREAM for k in cross):
            continue  # held to the join
        last_side_read = {}
        for k in cross:
            last_side_read[steps[k].stream] = max(k, last_side_read.get(steps[k].stream, k))
        release = _release_step(main_steps, max(reads), max(cross), release_lag)
        if release is None:
            continue  # no main step late enough: held to the join
        for k in last_side_read.values():
            records_event[k] = True
            waits_before[release].add(k)
        releases_before[release].append(slot)
    return CapturePlan(
        drops_after=tuple(tuple(d) for d in drops_after),
        records_event=tuple(records_event),
        waits_before=tuple(tuple(sorted(w)) for w in waits_before),
        releases_before=tuple(tuple(r) for r in releases_before),
    )


def _release_step(main_steps: list[int], last_read: int, last_side_read: int,
                  lag: int) -> int | None:
    """The main step before which a main tensor read by side steps is released, if any.

    It is the ``lag``-th main step after the last side read, and after every
    read of the slot (a main read after it must have run).
    """
    later = [k for k in main_steps if k > last_side_read]
    if len(later) < lag:
        return None
    candidate = later[lag - 1]
    if candidate <= last_read:
        after_reads = [k for k in later if k > last_read]
        return after_reads[0] if after_reads else None
    return candidate
