"""A graph compiled twice, by erase_fx and by the stock backend, and the choice between them.

Why: erase's schedule is not faster on every model (side streams that cost
more than they overlap, segment boundaries that cut Inductor's fusions),
and the project's rule is "never slower than the stock path it replaces".
Only timing the user's step tells, and `erase_fx.compile_step` already times
captures of it for the ``"auto"`` options (`erase_fx.capture_tuning`). With
``Tuning.stock_candidate``, a graph with early blocks compiled inside a
compile_step is also compiled by the stock backend
(`erase_fx.backend.stock_backend`), from an untouched copy of Dynamo's graph,
and the backend returns a `StockSwitch` around the two: a program the step's
scope can tune like a `StreamProgram` (`Tunables.stock`), whose stock program
is the tuning's last candidate.

Each call meets the current `erase_fx.emit.capture_scope.StepScope` first
(which sets the choice of the warm-up or capture under way), then runs
erase's compiled function, or the stock one under ``CaptureChoice(stock=True)``.
Outside compile_step's warm-ups and captures it runs erase's (the default
choice), as the graph would without the option. The two are separate
AOTAutograd functions: each call's backward is the one of the function that
ran, so a step captured with one never mixes them.

Not built (`stock_candidate_refusal`, logged at INFO by the backend):

- under DistributedDataParallel: erase's program all-reduces early gradients
  during the forward and DDP's reducer skips them; a stock program would not;
- where the step updates parameters early (``compile_step(early_optimizer=True)``)
  and the graph has early updates planned (`erase_fx.early_update`): the
  optimizer skips the parameters erase updated during the forward, which the
  stock program never updates there;
- with dynamic shapes (SymInt inputs, sizes symbolic): not supported yet, as
  erase's own CUDA graphs are not (`erase_fx.emit.cudagraphs`); such a graph
  runs erase's program.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from erase_fx.emit.capture_scope import DEFAULT_CHOICE, CaptureChoice, Tunables, meet
from erase_fx.emit.inner import has_symbolic_shapes


class StockSwitch:
    """Runs a graph's erase program or its stock compilation, as the step's scope chooses.

    Attributes:
        erase: erase's compiled function (Dynamo's calling convention: positional args).
        stock: the stock backend's compiled function for the same graph.
        graph_id: the backend's number for the graph (for messages).
        tuned: the choice compile_step set (`tune`); `DEFAULT_CHOICE` outside its
            warm-ups and captures: erase's program.
    """

    #: what compile_step may choose for it: its stock compilation instead
    tunables = Tunables(stock=True)

    def __init__(self, erase: Callable[..., Any], stock: Callable[..., Any], graph_id: int):
        self.erase = erase
        self.stock = stock
        self.graph_id = graph_id
        self.tuned: CaptureChoice = DEFAULT_CHOICE

    def tune(self, choice: CaptureChoice) -> None:
        """Run the stock compilation from the next call on if ``choice`` says so, else erase's
        (set by `erase_fx.compile_step` through its scope)."""
        self.tuned = choice

    def __call__(self, *args: Any) -> Any:
        meet(self)  # a compile_step warming up or capturing sets which program runs
        run = self.stock if self.tuned.stock else self.erase
        return run(*args)


def stock_candidate_refusal(*, data_parallel: bool, updates_early: bool,
                            example_inputs: Sequence[Any]) -> str | None:
    """Why a graph with early blocks gets no stock candidate (see the module docstring), or
    None. ``updates_early``: the step updates parameters early and the graph has early
    updates planned."""
    if data_parallel:
        return ("under DistributedDataParallel (erase's program all-reduces early gradients "
                "in the forward and DDP's reducer skips them)")
    if updates_early:
        return ("the step updates this graph's early-block parameters during the forward "
                "(compile_step(early_optimizer=True)), which the stock program would not")
    if has_symbolic_shapes(example_inputs):
        return "dynamic shapes (not supported yet)"
    return None
