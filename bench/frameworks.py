"""A Lightning ``Trainer`` step, compiled each way, side by side: ``python -m bench.frameworks``.

What a Lightning user gets from each way of compiling the same model, in one
run: eager; stock ``torch.compile`` as Lightning's docs say
(``torch.compile(module)``, then ``trainer.fit``), default mode and
``mode="reduce-overhead"``; ``backend="erase"`` the same way (the drop-in); and
the whole step in one CUDA graph (manual optimization, the step method
decorated by `erase_fx.integrations.lightning.compile_manual_step`), with stock
Inductor and with erase. Rows (`ROWS`):

==================  ======================================================================
``eager``           automatic optimization, no compile
``inductor``        automatic, ``torch.compile(module)``
``reduce-overhead`` automatic, ``torch.compile(module, mode="reduce-overhead")``
``erase+graphs``    automatic, ``torch.compile(module, backend="erase")``: the drop-in, with
                    its own CUDA graphs (the default options)
``inductor+step``   manual, ``torch.compile(module)``, the step in ``compile_manual_step``
``erase+step``      manual, ``torch.compile(module, backend="erase")``, the same
==================  ======================================================================

The names are `bench.harness`'s, whose `bench.run` rows these match outside Lightning.

Every row trains a fresh copy of a `bench.models` config (``--configs``; by default
``tv-resnet18-dgl:256:32`` and ``ctr:1024:512:1024:6``) with Adam (``capturable``
on CUDA, as `bench.harness` does for every variant), one fixed batch on the device
repeated by the DataLoader. A callback times ``--trials`` windows of
``--steps-per-trial`` Trainer steps each (the GPU synchronized at the window's
ends, Lightning's own work between steps included) after ``--warmup`` steps (and,
for the ``+step`` rows, once compile_step has captured and chosen its ``"auto"``
options). Per row: the median of the windows' mean step time, their min and
max, the ratio to ``reduce-overhead``'s and to ``inductor+step``'s median, the
early blocks erase found, and compile_step's captures and replays. The table
prints last; on a GPU it also updates ``bench/results/frameworks.md``
(`bench.tables`). Needs ``lightning``; torchvision for the ``tv-`` configs.

``--smoke``: a tiny chain on the CPU, two short windows, and ``aot_eager``
instead of Inductor (stock rows: ``backend="aot_eager"``, the mode dropped;
erase rows: ``inner="aot_eager"``), one step of warm-up and two windows of one
step, so that the whole script runs in seconds a row (a test runs it). On CPU nothing is captured and no time means anything.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

import erase_fx
from bench.harness import ADAM_LR
from bench.models import build_config, parse_config
from bench.tables import default_out, this_run, update_table

#: Each row: (optimization, what torch.compile gets; None: no compile).
ROWS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "eager": ("automatic", None),
    "inductor": ("automatic", {}),
    "reduce-overhead": ("automatic", {"mode": "reduce-overhead"}),
    "erase+graphs": ("automatic", {"backend": "erase"}),
    "inductor+step": ("manual", {}),
    "erase+step": ("manual", {"backend": "erase"}),
}
CONFIGS = ("tv-resnet18-dgl:256:32", "ctr:1024:512:1024:6")
SMOKE_CONFIG = "mlp:8:16:32:3"
#: Steps at most before a ``+step`` row's timing starts (warm-up, capture, tuning).
MAX_READY_STEPS = 200
COLUMNS = ("config", "row", "median ms", "min-max ms", "vs reduce-overhead", "vs inductor+step",
           "early blocks", "captured")


def lightning_module(model: torch.nn.Module, manual: bool) -> Any:
    """``model`` (whose ``forward(*batch)`` returns the loss) as a LightningModule: automatic
    optimization, or manual with the whole step in `compile_manual_step`."""
    import lightning as L

    from erase_fx.integrations.lightning import compile_manual_step

    class Bench(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.automatic_optimization = not manual

        def forward(self, *batch):
            return self.model(*batch)

        @compile_manual_step
        def whole_step(self, *batch):
            opt = self.optimizers()
            opt.zero_grad(set_to_none=True)
            loss = self(*batch)
            self.manual_backward(loss)
            opt.step()
            return loss.detach()

        def training_step(self, batch, batch_idx):
            return self.whole_step(*batch) if manual else self(*batch)

        def configure_optimizers(self):
            on_cuda = self.device.type == "cuda"
            return torch.optim.Adam(self.parameters(), lr=ADAM_LR, foreach=True,
                                    capturable=on_cuda)

    return Bench()


def step_timer(warmup: int, trials: int, steps_per_trial: int, module: Any) -> Any:
    """A callback timing ``trials`` windows of ``steps_per_trial`` steps; it stops the
    Trainer after the last. Windows start after ``warmup`` steps and once a manual
    module's compile_step is done capturing and tuning (or runs uncaptured)."""
    import lightning as L

    def synchronize() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def ready(batch_idx: int) -> bool:
        if batch_idx < warmup:
            return False
        if module.automatic_optimization:
            return True
        step = module.whole_step.compiled
        settled = step.uncaptured_reason is not None or (step.captures and not step.tuning)
        return bool(settled) or batch_idx >= MAX_READY_STEPS

    class StepTimer(L.Callback):
        def __init__(self):
            self.times: list[float] = []
            self.start: float | None = None
            self.first = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.first is None and ready(batch_idx):
                self.first = batch_idx
            if self.first is not None and (batch_idx - self.first) % steps_per_trial == 0:
                synchronize()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.first is None or (batch_idx - self.first + 1) % steps_per_trial:
                return
            synchronize()
            self.times.append((time.perf_counter() - self.start) / steps_per_trial)
            if len(self.times) == trials:
                trainer.should_stop = True

    return StepTimer()


def repeated(batch: tuple[torch.Tensor, ...]) -> Any:
    """A DataLoader that yields ``batch`` (already on the device) forever."""

    class Repeat(torch.utils.data.IterableDataset):
        def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
            return itertools.repeat(batch)

    return torch.utils.data.DataLoader(Repeat(), batch_size=None)


def measure(config: str, row: str, device: torch.device, args: argparse.Namespace) -> dict:
    """Train one row until its windows are timed; its cells."""
    import lightning as L

    torch._dynamo.reset()
    optimization, compile_kwargs = ROWS[row]
    torch.manual_seed(0)
    model, batch = build_config(parse_config(config), device)
    module = lightning_module(model, manual=optimization == "manual")
    compiled = module
    if compile_kwargs is not None:
        kwargs = dict(compile_kwargs)
        if args.smoke:  # NB: aot_eager compiles in seconds on CPU; a mode is Inductor's only
            erase = kwargs.pop("backend", None) == "erase"
            kwargs.pop("mode", None)
            kwargs["backend"] = "erase" if erase else "aot_eager"
            if erase:
                kwargs["options"] = {"inner": "aot_eager"}
        compiled = torch.compile(module, **kwargs)
    timer = step_timer(args.warmup, args.trials, args.steps_per_trial, module)
    with erase_fx.collect_reports() as reports, _quiet():
        trainer = L.Trainer(
            max_steps=MAX_READY_STEPS + args.warmup + args.trials * args.steps_per_trial,
            accelerator=device.type, devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
        trainer.fit(compiled, repeated(batch))
    cells: dict[str, Any] = {"config": config, "row": row, "times": timer.times,
                             "early blocks": sum(len(r.blocks) for r in reports)
                             if "erase" in row else "-"}
    if optimization == "manual":
        step = module.whole_step
        cells["captured"] = (f"{step.compiled.captures} capture(s), {step.compiled.replays} "
                             f"replays" + (f"; uncaptured: {step.uncaptured_reason}"
                                           if step.uncaptured_reason else ""))
    else:
        cells["captured"] = "-"
    del trainer, compiled, module, model, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return cells


def finish(rows: list[dict]) -> list[dict]:
    """Each row's median, spread and ratios (to the same config's reference rows)."""
    medians = {(r["config"], r["row"]): statistics.median(r["times"]) * 1e3
               for r in rows if r["times"]}
    for r in rows:
        times = [t * 1e3 for t in r["times"]]
        if not times:
            r.update({"median ms": "-", "min-max ms": "-"})
            continue
        median = statistics.median(times)
        r["median ms"] = f"{median:.3f}"
        r["min-max ms"] = f"{min(times):.3f}-{max(times):.3f}"
        for reference in ("reduce-overhead", "inductor+step"):
            base = medians.get((r["config"], reference))
            r[f"vs {reference}"] = f"{median / base:.2f}x" if base else "-"
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "-")) for c in COLUMNS) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No Lightning banners, no DataLoader advice."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers"
                                r"|LeafSpec|IterableDataset|max_epochs).*")
        try:
            yield
        finally:
            logger.setLevel(level)


TITLE = "bench.frameworks: a Lightning Trainer step, compiled each way"
INTRO = """\
Written by `python -m bench.frameworks` on a GPU: the median over timed windows of the mean
Trainer step (Lightning's work between steps included), min-max over the windows; ratios to
the same run's `reduce-overhead` and `inductor+step` rows. `+step` rows: manual optimization
with the step in `erase_fx.integrations.lightning.compile_manual_step`."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--steps-per-trial", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new row after this many seconds")
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_CONFIG} on CPU, aot_eager, two windows of one step")
    parser.add_argument("--out", help="the table to update (default on a GPU: "
                        "bench/results/frameworks.md; '' for none)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.configs, args.trials, args.steps_per_trial, args.warmup = SMOKE_CONFIG, 2, 1, 1
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("bench.frameworks needs a GPU (or --smoke)", file=sys.stderr)
        return 2
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; the rows are {', '.join(ROWS)}")
    out = default_out("frameworks.md", device.type == "cuda" and not args.smoke, args.out)
    run = this_run("bench.frameworks", argv)
    start = time.perf_counter()
    rows, skipped = [], []
    for config in args.configs.split(","):
        for row in args.rows.split(","):
            if time.perf_counter() - start > args.budget_s:
                skipped.append(f"{config} {row}")
                continue
            print(f"{config} {row}", flush=True)
            try:
                rows.append(measure(config, row, device, args))
            except Exception as error:  # noqa: BLE001 - one row's failure is its finding
                first = (str(error).strip().splitlines() or [""])[0][:120]
                rows.append({"config": config, "row": row, "times": [],
                             "captured": f"error: {type(error).__name__}: {first}"})
                torch._dynamo.reset()
    finish(rows)
    if out is not None:
        update_table(out, title=TITLE, intro=INTRO, columns=COLUMNS, key=("config", "row"),
                     rows=[r for r in rows if r["times"]], run=run)
    print()
    if device.type != "cuda":
        print("(CPU: nothing is captured, and these times say nothing about a GPU's)")
    if skipped:
        print(f"skipped (budget): {', '.join(skipped)}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
