"""A captured forward's memory, as erase's memory plan predicts it: ``python -m bench.plan_peaks``.

For each config this compiles the model with erase, runs one forward (on CPU
by default: the program, its slots and their sizes are a GPU's, but for the
dtype of ops autocast runs differently on CPU) and prints, from each forward
program's `erase_fx.emit.memory_plan.MemoryPlan`, the predicted high-water
mark of the values its segments hand each other (MiB):

- ``today``: the captured run's release plan (`erase_fx.emit.release`), one
  pool per CUDA stream, the pools added; with ``release_lag=None`` and one
  CUDA stream per side stream (``side_cuda_streams=None``), then with
  ``release_lag=2`` and with the side streams folded onto 2 CUDA streams (the
  candidates `erase_fx.compile_step`'s tuning times);
- ``record_stream``: every value dropped after its last reader and marked with
  ``record_stream``, reused once its readers are ordered before its stream's
  next step (``PYTORCH_ALLOC_CONF=graph_capture_record_stream_reuse:True``);
- ``one pool``: one pool for every stream, memory reused by any step that
  every use of it happens before: the least any allocation of these values
  needs in the program's own order;

per stream for ``today`` and ``one pool`` (main, side 1, ...: a stream's pool,
or its share of the one pool's peak); then ``today`` and ``one pool`` again
with each segment's own temporaries counted, held on its stream while it runs
(`segment_temporaries`: a block's logits and their gradient inside its
segment; estimated from the FX graph, before Inductor fuses); and the races
the check finds in today's releases (`check_releases`) over every release lag
(None, 1, 2) and folding (none, 1, 2): 0 on a correct plan.

Not predicted: the cuBLAS workspaces (one per stream), the allocator's
rounding, and the backward. A GPU run compares these figures to the step
memory ``bench.run`` measures: the difference between the rules is what a
realization can win; what the step measures beyond ``today`` is the rest.
``--out`` updates a table
(``bench/results/plan_peaks.md`` on the GPU: ``bash bench/device_run.sh
plan-a``); a row of the same config, device and stages replaces its own.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.models import build_config, parse_config
from bench.tables import this_run, update_table
from erase_fx.emit import program as program_module
from erase_fx.emit.memory_plan import Peaks

MIB = 2**20
#: The release lags and foldings the race check runs over.
LAGS, WIDTHS = (None, 1, 2), (None, 1, 2)
STAGES = {"default": None, "side": True, "main": False}


@contextlib.contextmanager
def programs_run() -> Iterator[list[program_module.StreamProgram]]:
    """Every `StreamProgram` called inside, in call order (once each).

    NB: an observer around the program's ``__call__`` (bench only): it runs the program
    as it is.
    """
    found: list[program_module.StreamProgram] = []
    original = program_module.StreamProgram.__call__

    def call(self, args):
        if all(p is not self for p in found):
            found.append(self)
        return original(self, args)

    program_module.StreamProgram.__call__ = call
    try:
        yield found
    finally:
        program_module.StreamProgram.__call__ = original


def programs_of(text: str, device: torch.device, inner: str = "inductor",
                stages_on_side: bool | None = None,
                streams: int = 4) -> list[program_module.StreamProgram]:
    """The forward programs erase compiles for config ``text`` (one forward run)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = build_config(parse_config(text), device)
    fn = torch.compile(model, backend="erase",
                       options={"on_error": "raise", "cudagraphs": False, "inner": inner,
                                "streams": streams,
                                "tuning": {"stages_on_side": stages_on_side}})
    with programs_run() as found:
        fn(*inputs)
    return found


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What one config's forward programs need, by rule (peaks summed over its programs:
    each runs in turn, so this is an upper bound where there are several).

    Attributes:
        programs: how many forward programs it has.
        today: release_lag None, one CUDA stream per side stream.
        today_lag2, today_folded2: release_lag 2; the side streams folded onto 2.
        record_stream, one_pool: the plan's two rules (`MemoryPlan`).
        inside_today, inside_one_pool: today and one pool, the segments' temporaries
            counted.
        races: today's releases found racing, over `LAGS` x `WIDTHS`.
    """

    programs: int
    today: Peaks
    today_lag2: Peaks
    today_folded2: Peaks
    record_stream: Peaks
    one_pool: Peaks
    inside_today: Peaks
    inside_one_pool: Peaks
    races: int


def predict(programs: list[program_module.StreamProgram]) -> Prediction:
    """The `Prediction` of a config's programs."""
    # NB: each program planned once per lag and width (a plan's one pool is its costly part)
    by_setting = [{(lag, width): p.memory_plan(lag, width)
                   for lag, width in itertools.product(LAGS, WIDTHS)} for p in programs]
    plans = [settings[None, None] for settings in by_setting]
    inside = [p.memory_plan(temporaries=True) for p in programs]
    races = sum(len(plan.races) for settings in by_setting for plan in settings.values())
    return Prediction(
        programs=len(programs),
        today=_summed(plan.today for plan in plans),
        today_lag2=_summed(settings[2, None].today for settings in by_setting),
        today_folded2=_summed(settings[None, 2].today for settings in by_setting),
        record_stream=_summed(plan.record_stream for plan in plans),
        one_pool=_summed(plan.one_pool for plan in plans),
        inside_today=_summed(plan.today for plan in inside),
        inside_one_pool=_summed(plan.one_pool for plan in inside),
        races=races,
    )


def _summed(peaks: Iterator[Peaks] | list[Peaks]) -> Peaks:
    by_stream: dict[int, int] = {}
    total = 0
    for p in peaks:
        total += p.total
        for stream, size in p.by_stream.items():
            by_stream[stream] = by_stream.get(stream, 0) + size
    return Peaks(by_stream, total)


def _mib(size: int) -> str:
    return f"{size / MIB:.1f}"


def _streams(peaks: Peaks) -> str:
    return ", ".join(_mib(peaks.by_stream.get(s, 0)) for s in range(max(peaks.by_stream,
                                                                       default=0) + 1))


def row_of(text: str, device: torch.device, stages: str, found: Prediction) -> dict[str, str]:
    """One table row: the config, device and stages, then the MiB of each rule."""
    return {
        "config": text, "device": device.type, "stages": stages,
        "programs": str(found.programs),
        "today MiB": _mib(found.today.total), "today by stream": _streams(found.today),
        "lag 2 MiB": _mib(found.today_lag2.total),
        "folded to 2 MiB": _mib(found.today_folded2.total),
        "record_stream MiB": _mib(found.record_stream.total),
        "one pool MiB": _mib(found.one_pool.total), "one pool by stream": _streams(found.one_pool),
        "with temporaries: today MiB": _mib(found.inside_today.total),
        "with temporaries: today by stream": _streams(found.inside_today),
        "with temporaries: one pool MiB": _mib(found.inside_one_pool.total),
        "races": str(found.races),
    }


KEY = ("config", "device", "stages")
COLUMNS = (*KEY, "programs", "today MiB", "today by stream", "lag 2 MiB", "folded to 2 MiB",
           "record_stream MiB", "one pool MiB", "one pool by stream",
           "with temporaries: today MiB", "with temporaries: today by stream",
           "with temporaries: one pool MiB", "races")
TITLE = "bench.plan_peaks: the memory a captured forward's values need, predicted"
INTRO = """\
Written by `python -m bench.plan_peaks --out bench/results/plan_peaks.md` (on the GPU,
`bash bench/device_run.sh plan-a`): a row per config, device and place of the stages, replaced
when run again. MiB of the values the forward's segments hand each other at their predicted
peak, by rule (`erase_fx.emit.memory_plan`): today's release plan (release_lag None, lag 2,
side streams folded to 2), each value marked with record_stream, one pool for every stream;
by stream: main, side 1, ...; then today and one pool with each segment's temporaries held on
its stream while it runs (estimated from its FX graph, before Inductor fuses). Races: today's
releases that a reader may still use, over release lags None, 1, 2 and foldings none, 1, 2 (0
expected). cuBLAS workspaces and the backward are not predicted."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="gpt:16:384:256:8,mlp:128:2000:2000:4")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--inner", default="inductor",
                        help="erase's inner compiler (inductor: the segments a user gets)")
    parser.add_argument("--streams", type=int, default=4, help="side streams")
    parser.add_argument("--stages", default="default",
                        help=f"comma-separated places of the stages: {', '.join(STAGES)}")
    parser.add_argument("--out", type=Path, help="a table to update with the rows (the GPU's: "
                        "bench/results/plan_peaks.md)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    rows = []
    for text in args.configs.split(","):
        for stages in args.stages.split(","):
            found = predict(programs_of(text, device, args.inner, STAGES[stages], args.streams))
            rows.append(row_of(text, device, stages, found))
            print("| " + " | ".join(rows[-1][c] for c in COLUMNS) + " |", flush=True)
    if args.out:
        update_table(args.out, title=TITLE, intro=INTRO, columns=COLUMNS, key=KEY, rows=rows,
                     run=this_run("bench.plan_peaks", argv),
                     order=lambda row: tuple(row.get(k, "") for k in KEY))
    return 0


if __name__ == "__main__":
    sys.exit(main())
