"""compile_step's side of the tuning of ``release_lag`` and ``side_cuda_streams`` across captures.

The rules (which candidates, which one wins) and the per-signature state
machine (`CaptureTuner`) are `erase_fx.capture_tuning`'s. Here is what a step
does with them: after its first capture, a signature whose programs can tune
something (`erase_fx.emit.capture_scope.Tunables`) gets a tuner; its replays
are timed; after a few, the graph is dropped and the next call captures the
next candidate (not counted toward ``max_captures``), until the chosen one
is in hand; a candidate whose capture fails ends the tuning with what was
measured. Every call is still one real training step.

The stock candidate (``Tuning.stock_candidate``: `erase_fx.emit.stock_switch`)
is a program whose compiled code has never run: capturing it cold would
initialise it under the capture, which fails. Before its capture the graph
in hand is dropped with the warm-ups of a new signature (``warmup`` real
steps, uncaptured), and those warm-ups run with the candidate's choice set
on the programs, as every warm-up runs with the choice of the capture it
prepares (`choice_for`). If stock's program is chosen, a warning says by
how much erase's fastest candidate was slower, once per step.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from erase_fx.capture_tuning import (
    KEEP, TIME_TOLERANCE, CaptureTuner, candidates_for, erase_over_stock, pool_bytes,
)
from erase_fx.emit.capture_scope import DEFAULT_CHOICE, CaptureChoice, Tunables
from erase_fx.step.capture import Entry

log = logging.getLogger(__name__)


class StepTuning:
    """The tuning of one compiled step's signatures.

    Attributes:
        tuners: per signature tuned, in order, its `CaptureTuner`
            (`CompiledStep.capture_tunings`).
        captures: captures made to time a candidate or to keep the chosen one
            (`CompiledStep.tuning_captures`).
    """

    def __init__(self, name: Callable[[], str], end_module_discovery: Callable[[], None]):
        self.tuners: list[CaptureTuner] = []
        self.captures = 0
        self._warned_stock = False
        self._name = name
        self._end_module_discovery = end_module_discovery

    def under_way(self, entries: Iterable[Entry]) -> bool:
        """Whether a signature's ``"auto"`` options are still being chosen."""
        return any(e.tuning_capture or (e.tuner is not None and not e.tuner.done)
                   for e in entries)

    @staticmethod
    def choice_for(entry: Entry) -> CaptureChoice:
        """What the next capture of ``entry``, and the warm-ups before it, set on its
        programs."""
        return entry.tuner.choice if entry.tuner is not None else DEFAULT_CHOICE

    @staticmethod
    def candidates(entry: Entry, met: list[Tunables]) -> tuple[CaptureChoice, ...]:
        """After the signature's first capture: the candidates worth timing, from what its
        programs can tune (none once it has a tuner)."""
        return candidates_for(met) if entry.tuner is None else ()

    @staticmethod
    def is_open(entry: Entry, candidates: tuple[CaptureChoice, ...]) -> bool:
        """Whether the signature's tuning goes on after this capture."""
        return len(candidates) > 1 or (entry.tuner is not None and not entry.tuner.done)

    def start(self, entry: Entry, candidates: tuple[CaptureChoice, ...]) -> None:
        """More than one candidate: the signature is tuned from now on."""
        if len(candidates) > 1:
            entry.tuner = CaptureTuner(candidates)
            self.tuners.append(entry.tuner)

    def captured(self, entry: Entry, choice: CaptureChoice, pool: object, is_open: bool,
                 tuning: bool) -> None:
        """A capture is kept: count and log one of the tuning's; time its replays while the
        tuning is open; once the choice is captured again, end the tuning."""
        if tuning:
            self.captures += 1
            log.info("erase_fx compile_step %s: captured with %s", self._name(),
                     choice.describe())
        if is_open:
            entry.tuner.captured(pool_bytes(pool))
        elif tuning:
            self.end()  # the choice captured again: the candidates' graphs are gone

    @staticmethod
    def replay(entry: Entry) -> None:
        """Replay the signature's graph, timed while its tuning measures."""
        tuner = entry.tuner
        if tuner is None or tuner.done:
            entry.graph.replay()
        else:
            tuner.replay(entry.graph)

    def after_replay(self, entry: Entry) -> None:
        """Go on timing, or drop the graph so that the next call captures the next candidate."""
        tuner = entry.tuner
        if tuner is None or tuner.done:
            return
        verdict = tuner.next_capture()
        if tuner.done:
            self._log_choice(tuner)
        if verdict == KEEP:
            if tuner.done:
                self.end()
            return
        # NB: the stock program's compiled code has never run: warm it up before its capture
        entry.drop(warm_up_again=verdict.stock)
        entry.tuning_capture = True
        if verdict.stock:
            log.info("erase_fx compile_step %s: warming up with %s before its capture (its "
                     "compiled code has not run yet)", self._name(), verdict.describe())

    def _log_choice(self, tuner: CaptureTuner) -> None:
        """The tuning's choice with every candidate's time and memory; if it is the stock
        program, a warning (once per step) with how much slower erase was."""
        log.info("erase_fx compile_step %s: %s chosen (least memory within %.0f%% of the "
                 "fastest): %s", self._name(), tuner.chosen.describe(), 100 * TIME_TOLERANCE,
                 "; ".join(m.describe() for m in tuner.measured))
        ratio = erase_over_stock(tuner.measured)
        if not tuner.chosen.stock or ratio is None or self._warned_stock:
            return
        self._warned_stock = True
        log.warning("erase_fx compile_step %s: erase's fastest candidate took %.2fx the time of "
                    "the stock program on this step, so the step runs the stock program (no "
                    "early blocks; Tuning.stock_candidate: the least memory within %.0f%% of the "
                    "fastest); erase_fx.explain(model, *inputs) says what erase found",
                    self._name(), ratio, 100 * TIME_TOLERANCE)

    def capture_failed(self, entry: Entry, choice: CaptureChoice, reason: str) -> None:
        """A candidate's capture raised: the tuning ends with what it measured, and the next
        call captures the choice (a failure then is the step's own)."""
        chosen = entry.tuner.capture_failed()
        log.warning("erase_fx compile_step %s: capturing with %s failed (%s); the tuning keeps "
                    "%s", self._name(), choice.describe(), reason, chosen.describe())
        entry.tuning_capture = True

    def end(self) -> None:
        """The chosen graph is in hand: the module hook goes, and so does the memory of the
        candidates' dropped graphs (`release_dropped_pools`)."""
        self._end_module_discovery()
        release_dropped_pools()


def release_dropped_pools() -> None:
    """Once a tuning has chosen, give the caching allocator's free memory back to the driver:
    the pools of the candidates' dropped graphs (once, when the tuning ends). A pool's segment
    goes back only once every block in it is free: call it when nothing references a tensor
    of those graphs (their ``.grad`` tensors included)."""
    torch.cuda.empty_cache()
