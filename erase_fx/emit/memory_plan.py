"""One memory plan for a captured forward: the lifetime of every value over every stream.

Under CUDA graph capture the caching allocator hands memory freed on a stream
only to later allocations on that stream, and does not order that reuse
against other streams' reads (``../shared/RESEARCH.md``): each side stream's
pool keeps its own peak, and `erase_fx.emit.release` decides, value by value,
when a captured run may drop one (today's rule). Here the same program is one
lifetime problem. Its steps (`StepIO`: the stream, the slots read and
written, the earlier steps whose events it waits for), the bytes of each
slot's storage (`SlotMemory`, from the FX meta) and a release plan
(`CapturePlan`) give:

- `Order`, the happens-before order of the steps on the GPU: each CUDA
  stream runs its steps in launch order (side streams folded as
  ``side_cuda_streams`` folds them), and each event wait orders the waited
  step before the waiting one; closed transitively. Every edge goes from an
  earlier step to a later one in launch order, so the order is a DAG.
- `Buffer`, one per allocation the forward makes (the slots that share one
  storage): the step that made it and the stream whose pool it came from,
  and the steps that read it.
- `Peaks`, the predicted high-water mark of those buffers under three rules:
  ``today``: the release plan, one pool per CUDA stream, the pools added;
  ``record_stream``: each value dropped after its last reader is launched,
  marked as used by every stream that read it, and reused on its own
  stream once those streams' work at the drop happens before
  (``PYTORCH_ALLOC_CONF=graph_capture_record_stream_reuse:True``, pytorch
  #158352, #162186: one candidate); ``one_pool``: one pool for
  every stream, a buffer's memory reused by any step that all its uses
  happen before: the heaviest set of buffers no two of which may share
  memory (`heaviest_overlap`), the least memory any captured allocation of
  these values needs in this program's order.
- `Race`: a release of the plan after which the step that may be handed the
  memory does not come after every use (`check_releases`); none on a
  correct plan.

What it does not see: what a segment allocates and frees inside its own
kernels (a head's logits within one segment), the cuBLAS workspaces (one
per stream), and the caching allocator's rounding and fragmentation. The
peaks are of the values the steps hand each other, and of the forward only.

`plan_memory` is a pure function of its arguments; `StreamProgram.memory_plan`
builds it for a compiled program; ``python -m bench.plan_peaks`` prints it for
the bench configs.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from erase_fx.emit.release import CapturePlan, SlotUses, StepIO
from erase_fx.emit.streams import fold


@dataclasses.dataclass(frozen=True)
class SlotMemory:
    """What each slot's value occupies, read from the FX meta of the split module.

    Attributes:
        nbytes: per slot, the bytes of the storage its value lives in (0: not a tensor).
        storage: per slot, which storage (slots with one number share memory: views of
            one another; -1: not a tensor).
        external: the storages the forward does not allocate: its inputs' and constants'
            (parameters, views of them).
    """

    nbytes: tuple[int, ...]
    storage: tuple[int, ...]
    external: frozenset[int]

    def owned(self, slot: int) -> bool:
        """Whether the forward allocates the slot's memory."""
        return self.storage[slot] >= 0 and self.storage[slot] not in self.external


def slot_memory(values: Sequence[Any], external_slots: Iterable[int]) -> SlotMemory:
    """`SlotMemory` of a program from each slot's example value (fake tensors of one trace,
    whose views share their base's storage, as the real values will).

    ``external_slots``: the inputs' and constants' slots.
    """
    ids: dict[StorageWeakRef, int] = {}
    nbytes, storage = [], []
    for value in values:
        if not isinstance(value, torch.Tensor):
            nbytes.append(0)
            storage.append(-1)
            continue
        stored = value.untyped_storage()
        storage.append(ids.setdefault(StorageWeakRef(stored), len(ids)))
        nbytes.append(_storage_bytes(stored))
    external = frozenset(storage[s] for s in external_slots if storage[s] >= 0)
    return SlotMemory(tuple(nbytes), tuple(storage), external)


def segment_temporaries(gm: fx.GraphModule) -> int:
    """The most bytes a segment holds at once beyond its inputs and outputs, from its FX graph.

    Each node's value is allocated when the node runs (a view takes no memory
    of its own: it shares its base's storage) and freed after the last node
    that reads a value of its storage; the inputs' and outputs' storages are not
    counted (the caller's and the program's buffers). This is the graph's
    order at the level of aten ops: Inductor fuses elementwise chains and
    reuses buffers, so it is an estimate from above of what an Inductor
    segment allocates inside.
    """
    nodes = list(gm.graph.nodes)
    values = {node: _tensors_of(node.meta.get("val")) for node in nodes}
    outside = {StorageWeakRef(t.untyped_storage()) for node in nodes if node.op == "placeholder"
               for t in values[node]}
    returned = nodes[-1].all_input_nodes if nodes and nodes[-1].op == "output" else []
    outside.update(StorageWeakRef(t.untyped_storage()) for node in returned for t in values[node])
    last: dict[StorageWeakRef, int] = {}
    for i, node in enumerate(nodes):
        for read in (node, *node.all_input_nodes):
            for t in values[read]:
                last[StorageWeakRef(t.untyped_storage())] = i
    frees_at: dict[int, list[StorageWeakRef]] = {}
    for key, i in last.items():
        frees_at.setdefault(i, []).append(key)
    live: dict[StorageWeakRef, int] = {}
    held = peak = 0
    for i, node in enumerate(nodes):
        for t in values[node]:
            key = StorageWeakRef(t.untyped_storage())
            if key not in outside and key not in live:
                live[key] = _storage_bytes(t.untyped_storage())
                held += live[key]
        peak = max(peak, held)
        # NB: a storage's last reader never runs before its maker: freed once, at its last read
        for key in frees_at.get(i, ()):
            held -= live.pop(key, 0)
    return peak


def _tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a node's example value (one, or those of a tuple or list)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _storage_bytes(stored: Any) -> int:
    """A storage's bytes, at its hint where the size is symbolic (0 without one)."""
    size = stored.nbytes()
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else 0
    return int(size)


@dataclasses.dataclass(frozen=True)
class Order:
    """Which steps of a program happen before which on the GPU.

    Attributes:
        streams: per step, the CUDA stream it runs on.
        before: per step, a bit mask of the steps that happen before it (bit ``j``: step j).
    """

    streams: tuple[int, ...]
    before: tuple[int, ...]

    def precedes(self, first: int, then: int) -> bool:
        """Whether step ``first`` is done before step ``then`` starts, whatever the timing."""
        return bool(self.before[then] >> first & 1)

    def first_on(self, stream: int, start: int) -> int | None:
        """The first step on ``stream`` launched at or after step ``start`` (None: none)."""
        return next((k for k in range(start, len(self.streams)) if self.streams[k] == stream),
                    None)


def happens_before(streams: Sequence[int], waits: Sequence[Iterable[int]]) -> Order:
    """The `Order` of steps on ``streams`` (in launch order) where step k's stream waits for
    the events recorded after each step in ``waits[k]``: stream order plus event edges,
    closed transitively. An event is recorded after a step is launched, so a step can only
    wait for an earlier one (ValueError otherwise)."""
    before: list[int] = []
    last: dict[int, int] = {}
    for k, stream in enumerate(streams):
        mask = 0
        edges = ([last[stream]] if stream in last else []) + list(waits[k])
        for w in edges:
            if not 0 <= w < k:
                raise ValueError(f"step {k} waits for step {w}, which is not launched before it")
            mask |= before[w] | 1 << w
        before.append(mask)
        last[stream] = k
    return Order(tuple(streams), tuple(before))


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One allocation of the forward: the slots that share a storage it made.

    Attributes:
        slots: the slots that hold it (a value and the views of it other steps return;
            none: the temporaries of its producer, held while that step runs).
        nbytes: its bytes.
        producer: the step that made it (the first to return one of its slots).
        stream: the CUDA stream of that step, whose pool the memory comes from.
        uses: the other steps that read one of its slots or return a view of it, in
            launch order.
        kept: a slot is a forward output: autograd holds it past the forward.
    """

    slots: tuple[int, ...]
    nbytes: int
    producer: int
    stream: int
    uses: tuple[int, ...]
    kept: bool

    @property
    def last_use(self) -> int:
        return max(self.uses, default=self.producer)

    def done_before(self, step: int, order: Order) -> bool:
        """Whether the producer and every use happen before ``step`` (its memory is free
        for ``step`` to write)."""
        return all(order.precedes(k, step) for k in (self.producer, *self.uses))


def buffers_of(steps: Sequence[StepIO], memory: SlotMemory, kept: set[int],
               order: Order) -> tuple[Buffer, ...]:
    """Every allocation the steps make (slots grouped by storage, the inputs' and constants'
    memory left out), in the order of their producers."""
    uses = SlotUses.of(steps)
    groups: dict[int, list[int]] = {}
    for slot in sorted(uses.producer):
        if memory.owned(slot):
            groups.setdefault(memory.storage[slot], []).append(slot)
    found = []
    for slots in groups.values():
        made = sorted({uses.producer[s] for s in slots})
        producer = made[0]
        used = sorted({*made[1:], *(k for s in slots for k in uses.readers.get(s, ()))}
                      - {producer})
        found.append(Buffer(tuple(slots), max(memory.nbytes[s] for s in slots), producer,
                            order.streams[producer], tuple(used), any(s in kept for s in slots)))
    return tuple(sorted(found, key=lambda b: (b.producer, b.slots)))


def temporaries_of(temporaries: Sequence[int], order: Order) -> tuple[Buffer, ...]:
    """A buffer per step that holds temporaries (``temporaries[k]`` bytes, as
    `segment_temporaries` estimates them): made by the step, used by nothing after it."""
    return tuple(Buffer((), size, k, order.streams[k], (), False)
                 for k, size in enumerate(temporaries) if size > 0)


def pinned_slots(steps: Sequence[StepIO], memory: SlotMemory) -> frozenset[int]:
    """The step outputs a captured run holds to the join because their memory was alive
    before their step (`StreamProgram._run_captured`): views of an input, a constant or an
    earlier step's value. Outputs of one step sharing memory that step made are not."""
    seen = set(memory.external)
    pinned = set()
    for step in steps:
        made = [s for s in step.outputs if s >= 0 and memory.storage[s] >= 0]
        pinned.update(s for s in made if memory.storage[s] in seen)
        seen.update(memory.storage[s] for s in made)
    return frozenset(pinned)


def released_by_plan(buffers: Sequence[Buffer], plan: CapturePlan, pinned: frozenset[int],
                     num_steps: int) -> tuple[int, ...]:
    """Per buffer, the step before which a captured run with ``plan`` releases it: once its
    last slot is dropped (``drops_after[k]``: before step k + 1; ``releases_before[k]``:
    before step k); ``num_steps``: held to the join (a slot kept, pinned or never dropped)."""
    when: dict[int, int] = {}
    for k, slots in enumerate(plan.drops_after):
        when.update((s, k + 1) for s in slots)
    for k, slots in enumerate(plan.releases_before):
        when.update((s, k) for s in slots)
    # NB: a step's temporaries (no slot) are its stream's again once it is done
    return tuple(max((num_steps if s in pinned else when.get(s, num_steps) for s in b.slots),
                     default=b.producer + 1) for b in buffers)


def reused_after(buffers: Sequence[Buffer], released: Sequence[int], order: Order,
                 num_steps: int) -> tuple[int, ...]:
    """Per buffer released before step ``released[i]``, the first step its pool may hand the
    memory to: the first on its stream from then on (``num_steps``: none in the forward)."""
    found = (order.first_on(b.stream, end) for b, end in zip(buffers, released))
    return tuple(num_steps if k is None else k for k in found)


def reused_with_record_stream(buffers: Sequence[Buffer], order: Order,
                              num_steps: int) -> tuple[int, ...]:
    """Per buffer, the first step that may reuse it when each value is dropped right after its
    last use is launched and marked with ``record_stream`` by every stream that used it.

    Under ``graph_capture_record_stream_reuse`` the allocator keeps, for a freed
    block, the last work captured on each of those streams when it was freed
    (pytorch#162186: the streams' terminals), and hands the block to a later
    allocation on its own stream once all of that work happens before it. The
    block's own stream needs no mark (its work is in order). ``num_steps``:
    no such step in the forward, or the buffer is kept.
    """
    freed = []
    for b in buffers:
        if b.kept:
            freed.append(num_steps)
            continue
        drop = b.last_use + 1
        marked = {order.streams[k] for k in b.uses} - {b.stream}
        terminals = [max(k for k in range(drop) if order.streams[k] == s) for s in marked]
        k = order.first_on(b.stream, drop)
        while k is not None and not all(order.precedes(t, k) for t in terminals):
            k = order.first_on(b.stream, k + 1)
        freed.append(num_steps if k is None else k)
    return tuple(freed)


@dataclasses.dataclass(frozen=True)
class Peaks:
    """The predicted high-water mark of the forward's buffers under one rule.

    Attributes:
        by_stream: per CUDA stream, its pool's peak (``one_pool``: that stream's share of
            the buffers alive together at the one pool's peak).
        total: the memory those buffers need: the pools' peaks added (no pool reuses
            another's memory), or the one pool's peak.
    """

    by_stream: dict[int, int]
    total: int


def pool_peaks(buffers: Sequence[Buffer], reused: Sequence[int], num_steps: int) -> Peaks:
    """Per stream pool, the most bytes of its buffers held at once in launch order: a buffer
    is held from its producer until the first step its pool may hand it to (``reused``)."""
    peaks: dict[int, int] = {}
    for k in range(num_steps):
        live: dict[int, int] = {}
        for b, end in zip(buffers, reused):
            if b.producer <= k < end:
                live[b.stream] = live.get(b.stream, 0) + b.nbytes
        for stream, size in live.items():
            peaks[stream] = max(peaks.get(stream, 0), size)
    return Peaks(peaks, sum(peaks.values()))


def heaviest_overlap(buffers: Sequence[Buffer], order: Order) -> tuple[int, ...]:
    """The heaviest set of buffers no two of which may share memory in one pool (indices).

    Buffer a may hand its memory to b when a's producer and every use happen
    before b's producer (and a is not kept); that relation is a partial order,
    and sets of pairwise overlapping buffers are its antichains. The heaviest
    antichain comes from a minimum cut (weighted Dilworth): a source edge to
    ``in_i`` and an edge ``out_i`` to the sink, both of buffer i's bytes, and an
    uncapped edge ``in_a -> out_b`` wherever a may hand its memory to b; the
    antichain is the buffers whose ``in`` is on the source's side of the cut
    and whose ``out`` is not.
    """
    if not buffers:
        return ()
    graph = nx.DiGraph()
    for i, b in enumerate(buffers):
        graph.add_edge("source", ("in", i), capacity=b.nbytes)
        graph.add_edge(("out", i), "sink", capacity=b.nbytes)
    for i, a in enumerate(buffers):
        if a.kept:
            continue
        for j, b in enumerate(buffers):
            if i != j and a.done_before(b.producer, order):
                graph.add_edge(("in", i), ("out", j))  # NB: no capacity: uncapped
    _, (source_side, _) = nx.minimum_cut(graph, "source", "sink")
    return tuple(i for i in range(len(buffers))
                 if ("in", i) in source_side and ("out", i) not in source_side)


@dataclasses.dataclass(frozen=True)
class Race:
    """A release after which a step may be handed the memory before a use of it is done.

    Attributes:
        slots: the buffer's slots.
        use: the step that may still read it.
        reuse: the first step on the buffer's stream after the release.
    """

    slots: tuple[int, ...]
    use: int
    reuse: int

    def __str__(self) -> str:
        return (f"slots {list(self.slots)}: step {self.reuse} may reuse the memory before "
                f"step {self.use} is done with it")


def check_releases(buffers: Sequence[Buffer], released: Sequence[int],
                   order: Order) -> tuple[Race, ...]:
    """The releases (``released[i]``: the step before which buffer i is released) whose memory
    the next step on the buffer's stream could be handed while a use may still run: a use not
    ordered before that step, or launched after the release. A buffer released after the
    last step of its stream is reused after the join, where every stream is ordered."""
    races = []
    for b, end in zip(buffers, released):
        reuse = order.first_on(b.stream, end)
        if reuse is None:
            continue
        races.extend(Race(b.slots, k, reuse) for k in b.uses
                     if k >= end or not order.precedes(k, reuse))
    return tuple(races)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What a captured forward's buffers need under each rule; see the module docstring.

    Attributes:
        order: the program's own order (its steps' event waits), on the CUDA streams the
            plan is for (side streams folded).
        captured: that order plus the release plan's waits: today's captured run.
        buffers: the forward's allocations, by producer.
        released_today: per buffer, the step before which today's captured run releases it
            (the number of steps: held to the join).
        reused_today: per buffer, the first step its pool may hand its memory to after that
            release (the number of steps: none in the forward).
        reused_record_stream: the same under the ``record_stream`` rule.
        peak_set: the buffers alive together at the one pool's peak (indices).
        today, record_stream, one_pool: the predicted peaks under each rule.
        races: today's releases that may hand memory to a step before a use of it is
            done (`check_releases`): none on a correct release plan.
    """

    order: Order
    captured: Order
    buffers: tuple[Buffer, ...]
    released_today: tuple[int, ...]
    reused_today: tuple[int, ...]
    reused_record_stream: tuple[int, ...]
    peak_set: tuple[int, ...]
    today: Peaks
    record_stream: Peaks
    one_pool: Peaks
    races: tuple[Race, ...]


def plan_memory(steps: Sequence[StepIO], memory: SlotMemory, kept: set[int],
                capture: CapturePlan, width: int | None = None,
                temporaries: Sequence[int] | None = None) -> MemoryPlan:
    """The memory plan of a captured forward.

    Args:
        steps: the program's steps in launch order, with the steps each waits for.
        memory: what each slot occupies (`slot_memory`).
        kept: the slots the forward returns.
        capture: today's release plan (`erase_fx.emit.release.plan_captured_releases`).
        width: ``side_cuda_streams``: the side streams folded onto this many CUDA streams
            (None: one each), as the captured run folds them.
        temporaries: per step, the bytes it holds inside beyond its inputs and outputs
            (`segment_temporaries`), each a buffer of its own; None: values only.
    """
    streams = [fold(step.stream, width) for step in steps]
    order = happens_before(streams, [step.waits for step in steps])
    captured = happens_before(streams, [(*step.waits, *capture.waits_before[k])
                                        for k, step in enumerate(steps)])
    buffers = buffers_of(steps, memory, kept, order)
    if temporaries is not None:
        buffers = tuple(sorted(buffers + temporaries_of(temporaries, order),
                               key=lambda b: (b.producer, b.slots == (), b.slots)))
    n = len(steps)
    released = released_by_plan(buffers, capture, pinned_slots(steps, memory), n)
    today = reused_after(buffers, released, captured, n)
    marked = reused_with_record_stream(buffers, order, n)
    peak_set = heaviest_overlap(buffers, order)
    share: dict[int, int] = {}
    for i in peak_set:
        share[buffers[i].stream] = share.get(buffers[i].stream, 0) + buffers[i].nbytes
    return MemoryPlan(order, captured, buffers, released, today, marked, peak_set,
                      pool_peaks(buffers, today, n), pool_peaks(buffers, marked, n),
                      Peaks(share, sum(share.values())),
                      check_releases(buffers, released, captured))
