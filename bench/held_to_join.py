"""What a captured erase forward holds until the join, by kind: ``python -m bench.held_to_join``.

Under CUDA graph capture erase's forward (`StreamProgram`) frees a value
before the join only when one stream made and read it (the caching
allocator's reuse is then ordered by that stream), or, with ``release_lag``,
a main-stream value side streams read once the main stream has waited for
them (`erase_fx.emit.release`); every other value one segment hands another
stays alive until every stream is ordered. This script runs one forward and
backward of each config (on CPU by default: the program, its slots and their
sizes are the same as on a GPU, only the kernels differ) through the
captured path's release plan, and sums the bytes still held at the join by
what they are:

- ``main -> side``: made on the main stream, read by a side stream (a block's
  activations, read by its early backward, when its stage runs on the main
  stream: ``stages_on_side=False``);
- ``side -> main``: made on a side stream, read by the main stream (the local
  losses after the join: scalars, unless a loss's tail runs on main; the
  last early stage's output, read by the stage after it);
- ``side -> side``: made on one side stream, read by another (a stage's
  output, read by the next block's stage);
- ``one stream``: made and read on one stream, still held (views of a value
  held for another reason);
- ``returned``: the forward's outputs (gradients of early blocks, tensors
  saved for the backward): held by autograd whatever the program does.

It also prints, per stream, the high-water mark of those values (the most
bytes made on that stream alive at once): under capture memory freed on a
stream is reused only by that stream, so the step's pool needs about their
sum, plus what the segments allocate inside (not seen here: a head's
log-softmax within a block's segment, say). ``--streams 4,2`` compares side
stream counts; ``--side-cuda-streams N`` gives the peaks of the CUDA streams
the side streams are folded onto (`Tuning.side_cuda_streams`);
``--largest N`` lists, after the table, the N largest values each row holds
at the join (kind, dtype and shape, the segment that made
them; a storage several slots share counts once, as its longest-held slot's
kind).

Storage shared with the forward's inputs (parameters, views of them) is not
counted. Bytes are of the config's dtype on CPU (no autocast): a config run
in bf16 on a GPU holds about half as many bytes for its activations.
``--out`` updates a table with the rows (``bash bench/device_run.sh`` gives
``bench/results/held_to_join.md``, the GPU's; `bench.tables`): a row of the
same config, device, side streams, folding and stages replaces its own.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.models import build_config, parse_config
from bench.tables import this_run, update_table
from erase_fx.emit import program as program_module
from erase_fx.emit.release import SlotUses, StepIO
from erase_fx.emit.streams import fold
from erase_fx.passes import MAIN_STREAM

KINDS = ("main -> side", "side -> main", "side -> side", "one stream", "returned")
#: The kinds from the longest-held: a storage several slots share takes its slots' first kind.
HOLD_ORDER = ("returned", "main -> side", "side -> main", "side -> side", "one stream")
#: How many of the largest held values (returns left out) a `Held` keeps.
LARGEST = 8


@dataclasses.dataclass(frozen=True)
class SlotStreams:
    """Per slot of a program: the stream that made it, and the streams that read it."""

    made_on: dict[int, int]
    read_on: dict[int, set[int]]
    #: the step that made each slot (its index in the program's steps)
    made_by: dict[int, int]

    @classmethod
    def of(cls, program: program_module.StreamProgram) -> SlotStreams:
        steps = program.steps
        uses = SlotUses.of([StepIO(s.stream, s.inputs, s.outputs) for s in steps])
        return cls({slot: steps[k].stream for slot, k in uses.producer.items()},
                   {slot: {steps[k].stream for k in ks} for slot, ks in uses.readers.items()},
                   uses.producer)


def _own_storages(program: program_module.StreamProgram, env: list
                  ) -> Iterator[tuple[list[int], int]]:
    """``(slots, bytes)`` of each storage the program's slots hold in ``env``, once each (with
    every slot that holds it), leaving out memory shared with the forward's inputs
    (parameters, views of them)."""
    inputs = {v.untyped_storage().data_ptr() for v in env[:program.num_inputs]
              if isinstance(v, torch.Tensor)}
    slots: dict[int, list[int]] = {}
    sizes: dict[int, int] = {}
    for slot, value in enumerate(env):
        if slot < program.num_inputs or not isinstance(value, torch.Tensor):
            continue
        key = value.untyped_storage().data_ptr()
        if key not in inputs:
            slots.setdefault(key, []).append(slot)
            sizes[key] = value.untyped_storage().nbytes()
    for key, held in slots.items():
        yield held, sizes[key]


@dataclasses.dataclass(frozen=True)
class HeldValue:
    """One storage held at the join: its bytes, kind, the segment that made it, and the
    value's dtype and shape."""

    size: int
    kind: str
    made_by: str
    value: str

    def __str__(self) -> str:
        return f"{self.size / 2**20:.1f} MiB {self.kind}: {self.value} from {self.made_by}"


def held_values(program: program_module.StreamProgram, env: list,
                streams: SlotStreams | None = None) -> list[HeldValue]:
    """Each storage held in ``env`` (a finished run's slots, None where freed), by kind."""
    streams = streams or SlotStreams.of(program)
    returned = {slot for kind, slot in program.results if kind == "slot"}
    producer = streams.made_by
    constants = {slot for slot, _ in program.constants}

    def kind_of(slot: int) -> str:
        home = streams.made_on.get(slot, MAIN_STREAM)
        read_on = streams.read_on.get(slot, set())
        if slot in returned:
            return "returned"
        if read_on <= {home}:
            return "one stream"
        if home == MAIN_STREAM:
            return "main -> side"
        return "side -> main" if MAIN_STREAM in read_on else "side -> side"

    found = []
    for slots, size in _own_storages(program, env):
        # NB: a storage is held for the slot that holds it longest: returned, else crossing
        kind, slot = min(((kind_of(s), s) for s in slots),
                         key=lambda pair: HOLD_ORDER.index(pair[0]))
        value = env[slot]
        made_by = (program.steps[producer[slot]].name if slot in producer
                   else "a constant" if slot in constants else "an input")
        found.append(HeldValue(size, kind, made_by,
                               f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"))
    return found


def by_kind(values: list[HeldValue]) -> dict[str, int]:
    """Bytes of held values, by kind (`KINDS`)."""
    held = dict.fromkeys(KINDS, 0)
    for value in values:
        held[value.kind] += value.size
    return held


@dataclasses.dataclass
class Held:
    """What one training step's captured forwards hold.

    Attributes:
        kinds: bytes held at the join, by kind (`KINDS`), summed over the programs.
        stream_peaks: per stream, the most bytes of values the segments hand each other
            that were alive at once, allocated on that stream (the forward's returns
            included; the segments' own temporaries not seen); the largest over the
            programs. Under capture memory freed on a stream is reused only by that
            stream, so a pool needs about the sum of these (plus temporaries).
    """

    kinds: dict[str, int]
    stream_peaks: dict[int, int]
    largest: list[HeldValue] = dataclasses.field(default_factory=list)

    def add(self, other: Held) -> None:
        """Sum ``other``'s kinds into these, keep the larger peak of each stream, and the
        largest held values of both (the forward's returns left out)."""
        for kind, size in other.kinds.items():
            self.kinds[kind] = self.kinds.get(kind, 0) + size
        for stream, size in other.stream_peaks.items():
            self.stream_peaks[stream] = max(self.stream_peaks.get(stream, 0), size)
        self.largest = sorted(self.largest + other.largest, key=lambda v: -v.size)[:LARGEST]


@contextlib.contextmanager
def recording() -> Iterator[list[Held]]:
    """Every `StreamProgram` run inside takes the captured path (its release plan), and
    reports what it holds at the join and each stream's high-water mark.

    NB: an observer around the program's private ``_run_captured``, ``_launch`` and
    ``stream_capturing`` (bench only): it changes when memory is freed, never what is computed.
    """
    found: list[Held] = []
    original, capturing = program_module.StreamProgram._run_captured, program_module.stream_capturing
    launch = program_module.StreamProgram._launch
    peaks: dict[int, int] = {}
    streams: dict[int, SlotStreams] = {}  # id(program) -> its slots' streams, once per run

    def launch_watching(self, k, step, env, events, stream_ops, record=False):
        launch(self, k, step, env, events, stream_ops, record)
        # NB: by the CUDA stream a value was made on (side streams folded: side_cuda_streams)
        live: dict[int, int] = {}
        for stream, size in live_bytes_by_stream(self, env, streams[id(self)]).items():
            cuda_stream = fold(stream, getattr(stream_ops, "width", None))
            live[cuda_stream] = live.get(cuda_stream, 0) + size
        for stream, size in live.items():
            peaks[stream] = max(peaks.get(stream, 0), size)

    def run_captured(self, env, plan, stream_ops, context=None):
        peaks.clear()
        streams[id(self)] = SlotStreams.of(self)
        original(self, env, plan, stream_ops, context)
        values = held_values(self, env, streams.pop(id(self)))
        kept = sorted((v for v in values if v.kind != "returned"), key=lambda v: -v.size)
        found.append(Held(by_kind(values), dict(peaks), kept[:LARGEST]))

    program_module.StreamProgram._run_captured = run_captured
    program_module.StreamProgram._launch = launch_watching
    program_module.stream_capturing = lambda: True
    try:
        yield found
    finally:
        program_module.StreamProgram._run_captured = original
        program_module.StreamProgram._launch = launch
        program_module.stream_capturing = capturing


def live_bytes_by_stream(program: program_module.StreamProgram, env: list,
                         streams: SlotStreams | None = None) -> dict[int, int]:
    """Bytes of the slots alive in ``env``, by the stream of the step that made them (memory
    shared with the forward's inputs not counted, shared memory counted once)."""
    made_on = (streams or SlotStreams.of(program)).made_on
    live: dict[int, int] = {}
    for slots, size in _own_storages(program, env):
        made = [made_on[slot] for slot in slots if slot in made_on]
        if made:
            live[made[0]] = live.get(made[0], 0) + size
    return live


def measure(text: str, device: torch.device, inner: str = "inductor",
            stages_on_side: bool = True, streams: int = 4,
            side_cuda_streams: int | None = None) -> Held:
    """What one training step's forwards hold; see `Held`. With ``side_cuda_streams``, the
    stream peaks are those of the CUDA streams the side streams are folded onto."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = build_config(parse_config(text), device)
    fn = torch.compile(model, backend="erase",
                       options={"on_error": "raise", "cudagraphs": False, "inner": inner,
                                "streams": streams,
                                "tuning": {"stages_on_side": stages_on_side,
                                           "side_cuda_streams": side_cuda_streams}})
    with recording() as found:
        fn(*inputs).backward()
    total = Held(dict.fromkeys(KINDS, 0), {})
    for held in found:
        total.add(held)
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="gpt:4:384:256:8,mlp:512:1024:2048:6,"
                        "ctr:1024:512:1024:6")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--inner", default="inductor",
                        help="erase's inner compiler (inductor: the segments a user gets)")
    parser.add_argument("--streams", default="4",
                        help="comma-separated side-stream counts to compare")
    parser.add_argument("--side-cuda-streams", type=int, default=None, metavar="N",
                        help="fold the side streams onto N CUDA streams "
                        "(Tuning.side_cuda_streams): the stream peaks are theirs")
    parser.add_argument("--largest", type=int, default=0, metavar="N",
                        help=f"after the table, the N (at most {LARGEST}) largest values each "
                        "row holds at the join, the forward's returns left out")
    parser.add_argument("--out", type=Path, help="a table to update with the rows (the GPU's: "
                        "bench/results/held_to_join.md)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print("| config | side streams | stages | " + " | ".join(f"{k} MiB" for k in KINDS)
          + " | stream peaks MiB (main, side 1, ...) | their sum MiB |")
    print("|---|---|---|" + "---|" * len(KINDS) + "---|---|")
    listed, rows = [], []
    for text in args.configs.split(","):
        for streams in (int(n) for n in args.streams.split(",")):
            for on_side in (True, False):
                held = measure(text, device, args.inner, on_side, streams,
                               args.side_cuda_streams)
                where = "on side streams" if on_side else "on the main stream"
                listed.append((f"{text}, {streams} side streams, stages {where}",
                               held.largest[:args.largest]))
                peaks = [held.stream_peaks.get(s, 0) for s in range(streams + 1)]
                print(f"| {text} | {streams} | {where} | "
                      + " | ".join(f"{held.kinds[k] / 2**20:.1f}" for k in KINDS)
                      + " | " + ", ".join(f"{p / 2**20:.0f}" for p in peaks)
                      + f" | {sum(peaks) / 2**20:.0f} |", flush=True)
                rows.append({
                    "config": text, "device": device.type, "side streams": str(streams),
                    "side CUDA streams": str(args.side_cuda_streams or streams),
                    "stages": where, **{f"{k} MiB": f"{held.kinds[k] / 2**20:.1f}" for k in KINDS},
                    "stream peaks MiB (main, side 1, ...)": ", ".join(
                        f"{p / 2**20:.0f}" for p in peaks),
                    "their sum MiB": f"{sum(peaks) / 2**20:.0f}"})
    for row, values in listed:
        if values:
            print(f"\nlargest held at the join, {row}:")
            for value in values:
                print(f"- {value}")
    if args.out:
        update_table(args.out, title=TITLE, intro=INTRO, columns=COLUMNS, key=KEY, rows=rows,
                     run=this_run("bench.held_to_join", argv),
                     order=lambda row: tuple(row.get(k, "") for k in KEY))
    return 0


KEY = ("config", "device", "side streams", "side CUDA streams", "stages")
COLUMNS = (*KEY, *(f"{k} MiB" for k in KINDS), "stream peaks MiB (main, side 1, ...)",
           "their sum MiB")
TITLE = "bench.held_to_join: what a captured forward holds until the join"
INTRO = """\
Written by `python -m bench.held_to_join --out bench/results/held_to_join.md` (on the GPU,
`bash bench/device_run.sh memory-f`): a row per config, device, side-stream count, folding
and place of the stages, replaced when run again; `git log -p bench/results/held_to_join.md`
shows what each run changed. MiB held at the join by kind, and each stream's high-water
mark of those values (`-` where the run that measured a row did not report it)."""


if __name__ == "__main__":
    sys.exit(main())
