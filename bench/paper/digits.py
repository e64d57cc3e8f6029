"""The paper's MNIST-MLP claim, on real handwritten digits: ``python -m bench.paper.digits``.

ERASE (arXiv 2608.18469) reports 58% lower backward time on an MNIST MLP
trained greedily layer by layer (each layer detached, with its own loss):
the backward of every layer but the last runs early, during the forward, so
what is left for ``loss.backward()`` shrinks. This script measures that
backward time, and the total step time next to it: the early work has moved
into the forward, not vanished, so only the total says whether a step got
faster.

Data
    ``sklearn.datasets.load_digits``: 1797 8x8 grey images of handwritten
    digits that ship inside scikit-learn (nothing is downloaded); pixels
    scaled to [0, 1]. ``--size 28`` (the default) upsamples them bilinearly
    to 28x28, so the input width (784) and the first layer match an MNIST
    MLP; ``--size 8`` keeps 64 inputs. A stratified 75/25 train/test split
    with a fixed seed (``--data-seed``); inputs standardised with the
    training set's mean and standard deviation.

Model (`DetachedMLP`)
    ``--layers`` hidden layers ``Linear-ReLU`` of ``--width`` units (4 x 2000
    by default, the MLP of Hinton's Forward-Forward MNIST experiments), each
    with a local head ``Linear(width, 10)`` and a cross-entropy loss. Layer
    k+1 reads layer k's output detached, so each layer learns from its own
    loss only (greedy layer-wise training); the loss is the sum. erase_fx
    should find ``layers - 1`` early blocks (the last layer's backward is
    ready only when the forward ends).

Variants (deep copies of one module: same initial weights; same Adam; same
batches in the same order)
    ``eager``             the detached model, eager;
    ``compile``           stock ``torch.compile`` (``--inner``: Inductor on CUDA,
                          ``aot_eager`` on CPU);
    ``erase``             ``backend="erase"``, inner ``--inner``, no CUDA graphs;
    ``erase+graphs``      the same with CUDA graphs (CUDA only);
    ``erase/one-stream``  the erase program with every segment on one stream (no
                          overlap: separates moving the work from overlapping it);
    ``erase/aot_eager``   ``backend="erase"``, inner ``aot_eager``: its trained
                          weights and accuracies must equal eager's exactly (on
                          CPU ``erase`` is this variant already).

Timing
    On one fixed training batch of ``--batch`` images, after ``--warmup``
    steps, for ``--steps`` steps: the forward (the call that returns the loss;
    for erase it includes the early backward) and the backward
    (``loss.backward()``), each bracketed by CUDA events on CUDA (device time
    as the stream sees it, no sync inside a step) or ``perf_counter`` on CPU;
    medians over the steps. ``zero_grad`` is outside both; the optimizer is
    the same for every variant and left out.

Paper comparison
    The backward-time reduction against the paper's 58%, with its own
    verdict for each of ``erase`` (no CUDA graphs) and ``erase+graphs`` (CUDA
    graph replay, erase_fx's default on CUDA), against eager and against stock
    ``torch.compile``; each note gives the forward's and the total step's
    change too (the early backward lengthens the forward). Neither reference
    replays CUDA graphs, so part of ``erase+graphs``' gain is replay, not the
    early backward. A last row gives the total step times (no verdict).

Training and accuracy
    ``--epochs`` over the training set in shuffled batches of ``--batch``
    (the last partial batch is dropped, so shapes stay static: no recompile,
    and CUDA graphs stay valid), Adam (``--lr``); then the test accuracy of
    every layer's head (the last one is the model's prediction), evaluated
    eagerly on the trained weights.

The GPU run is one-shot: erase compiles with ``--on-error fallback`` by
default (what kept a block from running early is recorded per variant), and
a variant that raises is recorded with its error while the others go on. The
exit status is 1 when an exactness check failed, a variant failed, or
explain found other than ``layers - 1`` early blocks.

Writes ``<out-dir>/digits.json`` (the results contract of ``bench/paper/README.md``;
``digits_phases.png`` is drawn from it by ``bench.paper.report``).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import erase_fx
from bench.paper.common import (GRAPHS_VARIANT, StepTimer, add_erase_arguments,
                                capture_erase_warnings, command_line, compile_summary,
                                compile_variant, compiled_notes, fmt, print_compiled, run_meta,
                                synchronize, table, variant_failed, write_results)

VARIANTS = ("eager", "compile", "erase", "erase+graphs", "erase/one-stream", "erase/aot_eager")
#: The paper's number: backward time of ERASE relative to standard backprop, MNIST MLP.
PAPER_BACKWARD_REDUCTION = 0.58
#: Reductions within this many points of the paper's count as ``equal``.
EQUAL_BAND = 0.05


# -- data ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Digits:
    """The digits, split and standardised: ``x_*`` float ``[n, size*size]``, ``y_*`` int64."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def features(self) -> int:
        return self.x_train.size(1)

    def to(self, device: torch.device) -> Digits:
        return Digits(*(t.to(device) for t in dataclasses.astuple(self)))


def load_digits(size: int = 28, test_share: float = 0.25, seed: int = 0) -> Digits:
    """scikit-learn's 8x8 digits, upsampled to ``size x size`` unless 8, split, standardised."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    images, labels = sklearn_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    if size != 8:
        x = F.interpolate(x.view(-1, 1, 8, 8), size=(size, size), mode="bilinear",
                          align_corners=False).flatten(1)
    y = torch.tensor(labels, dtype=torch.int64)
    train, test = train_test_split(range(len(y)), test_size=test_share, random_state=seed,
                                   stratify=labels)
    train, test = torch.tensor(train), torch.tensor(test)
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return Digits(x[train], y[train], x[test], y[test])


def batches(data: Digits, batch: int, epochs: int, seed: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Shuffled training batches, ``epochs`` times; each epoch's last partial batch is dropped."""
    generator = torch.Generator().manual_seed(seed)
    n = data.y_train.numel()
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator).to(data.y_train.device)
        for start in range(0, n - batch + 1, batch):
            index = order[start:start + batch]
            yield data.x_train[index], data.y_train[index]


# -- model ---------------------------------------------------------------------


class DetachedMLP(nn.Module):
    """``layers`` Linear-ReLU layers, each reading the previous one detached, each with a head."""

    def __init__(self, features: int, width: int, layers: int, classes: int = 10):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(features if i == 0 else width, width), nn.ReLU())
            for i in range(layers)
        )
        self.heads = nn.ModuleList(nn.Linear(width, classes) for _ in range(layers))

    def head_logits(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every layer's head's logits; each layer reads the previous one detached."""
        logits = []
        h = x
        for index, (layer, head) in enumerate(zip(self.layers, self.heads)):
            h = layer(h.detach() if index else h)
            logits.append(head(h))
        return logits

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = [F.cross_entropy(logits, labels) for logits in self.head_logits(x)]
        return sum(losses[1:], losses[0])


@torch.no_grad()
def accuracies(model: DetachedMLP, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Test accuracy of each layer's head (eager, on the trained weights)."""
    return [(logits.argmax(1) == y).float().mean().item() for logits in model.head_logits(x)]


# -- variants ------------------------------------------------------------------


def variants_for(requested: Sequence[str], device: torch.device, inner: str) -> tuple[str, ...]:
    """The requested variants that make sense here.

    NB: no CUDA graphs on CPU; ``erase/aot_eager`` duplicates ``erase`` when
    the inner compiler already is ``aot_eager`` (the CPU default).
    """
    keep = []
    for name in requested:
        if name == "erase+graphs" and device.type != "cuda":
            continue
        if name == "erase/aot_eager" and inner == "aot_eager" and "erase" in requested:
            continue
        keep.append(name)
    return tuple(keep)


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Everything a variant's run needs besides the model and the data."""

    device: torch.device
    inner: str
    streams: int
    batch: int
    warmup: int
    steps: int
    epochs: int
    lr: float
    seed: int
    on_error: str = "fallback"


def time_phases(model: nn.Module, fn: Callable, x: torch.Tensor, y: torch.Tensor,
                settings: RunSettings) -> dict[str, float]:
    """Median forward, backward and total milliseconds per step on one batch (no optimizer)."""
    for _ in range(settings.warmup):
        model.zero_grad(set_to_none=True)
        fn(x, y).backward()
    synchronize(settings.device)
    forward, backward = StepTimer(settings.device), StepTimer(settings.device)
    for _ in range(settings.steps):
        model.zero_grad(set_to_none=True)
        forward.start()
        loss = fn(x, y)
        forward.stop()
        backward.start()
        loss.backward()
        backward.stop()
    fwd = [1e3 * s for s in forward.seconds()]
    bwd = [1e3 * s for s in backward.seconds()]
    return {
        "forward_ms": statistics.median(fwd),
        "backward_ms": statistics.median(bwd),
        "total_ms": statistics.median(f + b for f, b in zip(fwd, bwd)),
    }


def train(model: DetachedMLP, fn: Callable, data: Digits, settings: RunSettings) -> list[float]:
    """Train with Adam for the configured epochs; the training losses, one per step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    losses = []
    for x, y in batches(data, settings.batch, settings.epochs, settings.seed):
        optimizer.zero_grad(set_to_none=True)
        loss = fn(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return [loss.item() for loss in losses]


def run_variant(name: str, base: DetachedMLP, data: Digits,
                settings: RunSettings) -> tuple[dict[str, Any], DetachedMLP | None]:
    """Compile, time and train one variant; its results and its trained model.

    NB: an exception is recorded as the variant's ``error`` (and no model) and
    the run goes on: the GPU runs are one-shot, and the other variants count.
    """
    try:
        return _run_variant(name, base, data, settings)
    except Exception as error:  # noqa: BLE001 - recorded in the results
        return variant_failed(name, error, 16), None


def _run_variant(name: str, base: DetachedMLP, data: Digits,
                 settings: RunSettings) -> tuple[dict[str, Any], DetachedMLP]:
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    fn = compile_variant(name, model, inner=settings.inner, streams=settings.streams,
                         on_error=settings.on_error)
    x, y = data.x_train[:settings.batch], data.y_train[:settings.batch]
    begin = time.perf_counter()
    with erase_fx.collect_reports() as reports, capture_erase_warnings() as warnings:
        timing = time_phases(model, fn, x, y, settings)
        losses = train(model, fn, data, settings)
    result: dict[str, Any] = {
        "variant": name, **timing, "seconds": time.perf_counter() - begin,
        "accuracy": accuracies(model, data.x_test, data.y_test),
        "final_loss": losses[-1] if losses else None, "train_steps": len(losses),
        "compiled": compile_summary(reports, warnings) if name.startswith("erase") else None,
    }
    print(f"    {name:16s} fwd {timing['forward_ms']:8.3f} ms, bwd {timing['backward_ms']:8.3f} "
          f"ms, total {timing['total_ms']:8.3f} ms; test accuracy (last head) "
          f"{result['accuracy'][-1]:.4f}; {result['seconds']:.1f} s", flush=True)
    if result["compiled"]:
        print_compiled(name, result["compiled"], 16)
    return result, model


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference between two models' parameters (0.0: bit-equal)."""
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


# -- results -------------------------------------------------------------------


def _row(rows: Sequence[dict[str, Any]], variant: str) -> dict[str, Any] | None:
    """The variant's row, if it ran without error."""
    return next((r for r in rows if r["variant"] == variant and "error" not in r), None)


def _change(new: float, old: float) -> str:
    return f"{new / old - 1:+.1%}"


def backward_verdict(reduction: float) -> str:
    """``better``/``equal``/``worse`` than the paper's 58%, with a band of `EQUAL_BAND`."""
    if abs(reduction - PAPER_BACKWARD_REDUCTION) <= EQUAL_BAND:
        return "equal"
    return "better" if reduction > PAPER_BACKWARD_REDUCTION else "worse"


#: The erase variants the paper rows judge, each with its own verdict.
JUDGED = (("erase", "without CUDA graphs"),
          (GRAPHS_VARIANT, "with CUDA graphs, erase_fx's default on CUDA"))


def paper_comparison(rows: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """The paper's 58% against erase's backward time, and the total step time next to it.

    One row, with its own verdict, per erase variant (`JUDGED`: ``erase``
    without CUDA graphs, and ``erase+graphs``, the default on CUDA) and per
    reference (eager, stock ``torch.compile``; neither replays CUDA graphs);
    then one row of total step times.
    """
    eager, stock = _row(rows, "eager"), _row(rows, "compile")
    judged = [(variant, how, row) for variant, how in JUDGED if (row := _row(rows, variant))]
    claim = "MNIST MLP (greedy layer-wise, detached layers): backward time 58% lower with ERASE"
    if not (eager and judged):
        return [{"claim": claim, "paper": "-58%", "erase_fx": "not measured",
                 "verdict": "not comparable",
                 "note": "needs the eager variant and erase or erase+graphs"}]
    comparison = []
    for variant, how, erase in judged:
        for reference, label in ((eager, "eager"), (stock, "stock torch.compile")):
            if reference is None:
                continue
            reduction = 1 - erase["backward_ms"] / reference["backward_ms"]
            note = [f"{variant}: {how}; 'equal' within {100 * EQUAL_BAND:.0f} percentage "
                    f"points of 58%",
                    f"the early backward runs inside the forward: forward "
                    f"{_change(erase['forward_ms'], reference['forward_ms'])}, total step "
                    f"{_change(erase['total_ms'], reference['total_ms'])} vs {label}"]
            if variant == GRAPHS_VARIANT:
                note.append(f"CUDA graph replay also drops the launch overhead that {label} "
                            f"keeps: part of the difference is replay, not the early backward")
            comparison.append({
                "claim": claim, "paper": "-58%",
                "erase_fx": f"{-reduction:+.0%} backward time ({variant} vs {label})",
                "verdict": backward_verdict(reduction), "note": "; ".join(note),
            })
    totals = []
    for variant, _, erase in judged:
        against = [f"{_change(erase['total_ms'], eager['total_ms'])} vs eager"]
        if stock:
            against.append(f"{_change(erase['total_ms'], stock['total_ms'])} vs stock "
                           f"torch.compile")
        totals.append(f"{variant} {', '.join(against)}")
    comparison.append({
        "claim": "MNIST MLP: total step time (forward + backward) with ERASE",
        "paper": "not given (the paper reports backward time)",
        "erase_fx": "; ".join(totals),
        "verdict": "not comparable",
        "note": "the honest measure of speed: a smaller backward paid for by a longer forward "
                "is not a faster step",
    })
    return comparison


def timing_table(settings: RunSettings, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    timer = "CUDA events" if settings.device.type == "cuda" else "perf_counter"
    eager = _row(rows, "eager")
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["variant"], *["-"] * 6, f"failed: {r['error'][:300]}"])
            continue
        compiled = r["compiled"]
        cells.append([
            r["variant"], fmt(r["forward_ms"]), fmt(r["backward_ms"]), fmt(r["total_ms"]),
            _change(r["backward_ms"], eager["backward_ms"]) if eager else "-",
            _change(r["total_ms"], eager["total_ms"]) if eager else "-",
            fmt(compiled and compiled["early_blocks"]),
            ("; ".join(compiled_notes(compiled))[:300] or "-") if compiled else "-",
        ])
    return table(
        f"Forward (erase: with the early backward), backward (loss.backward()) and total step "
        f"time, ms, median of {settings.steps} steps on a batch of {settings.batch} ({timer}); "
        f"no optimizer step",
        ["variant", "forward ms", "backward ms", "total ms", "backward vs eager",
         "total vs eager", "early blocks", "note"],
        cells)


def accuracy_table(epochs: int, data: Digits, layers: int,
                   rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    cells = [[r["variant"], *(f"{a:.4f}" for a in r["accuracy"]), fmt(r["max_param_diff"]),
              fmt(r["equal_to_eager"]), "yes" if r["must_equal_eager"] else "no"]
             for r in rows if "error" not in r]
    return table(
        f"Test accuracy of each layer's head after {epochs} epochs ({len(data.y_test)} test "
        f"images), and the largest parameter difference from eager after training (0: "
        f"bit-equal; must be 0 for erase with inner aot_eager)",
        ["variant", *(f"head {i + 1}" for i in range(layers)), "max |param - eager|",
         "equal to eager", "must equal eager"],
        cells)


def phases_figure(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Forward, backward and total time per variant, drawn by ``bench.paper.report``."""
    return {
        "file": "digits_phases.png",
        "caption": "Forward, backward and total step time per variant (ms, median)",
        "kind": "bar", "ylabel": "ms", "categories": ["forward", "backward", "total"],
        "series": [{"label": r["variant"], "y": [r["forward_ms"], r["backward_ms"], r["total_ms"]]}
                   for r in rows if "error" not in r],
    }


def build_results(args: argparse.Namespace, settings: RunSettings, data: Digits,
                  rows: Sequence[dict[str, Any]], explained_blocks: int,
                  command: str) -> dict[str, Any]:
    """The results JSON, per the contract of ``bench/paper/README.md``."""
    blocks_table = table("Early blocks erase_fx found (erase_fx.explain, aot_eager)",
                         ["layers", "expected (layers - 1)", "explain"],
                         [[args.layers, args.layers - 1, explained_blocks]])
    return {
        "title": "MNIST-style MLP with detached layers on scikit-learn's digits: backward time "
                 "(ERASE, 58% claim)",
        "meta": run_meta(settings.device, command, size=args.size, width=args.width,
                         layers=args.layers, batch=args.batch, epochs=args.epochs,
                         steps=args.steps, inner=settings.inner, streams=settings.streams,
                         on_error=settings.on_error, train_images=len(data.y_train),
                         test_images=len(data.y_test)),
        "summary": (
            f"{args.layers} detached Linear-ReLU layers of width {args.width}, each with a "
            f"10-class head and CE loss, on sklearn's 1797 handwritten digits "
            f"({args.size}x{args.size} inputs). The backward erase leaves for loss.backward() "
            f"is what the paper's 58% is about; its early part runs inside the forward, so "
            f"the total step time is reported next to it. erase (no CUDA graphs) and "
            f"erase+graphs (CUDA graph replay, erase_fx's default on CUDA) each get their own "
            f"verdict, against eager and against stock torch.compile (neither replays CUDA "
            f"graphs). Verdict rule: backward-time reduction within {100 * EQUAL_BAND:.0f} "
            f"percentage points of 58% is 'equal', more 'better', less 'worse'."
        ),
        "tables": [timing_table(settings, rows), accuracy_table(args.epochs, data, args.layers,
                                                                rows), blocks_table],
        "figures": [phases_figure(rows)],
        "paper_comparison": paper_comparison(rows),
        "data": {"runs": list(rows)},
    }


# -- command line --------------------------------------------------------------

#: ``--quick``: sized for well under two minutes on one H200 (compiling dominates).
QUICK = dict(size=28, width=2000, layers=4, batch=256, epochs=10, steps=50, warmup=10)
FULL = dict(size=28, width=2000, layers=4, batch=256, epochs=40, steps=200, warmup=20)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small preset, well under 2 minutes on one H200; explicit flags win")
    parser.add_argument("--size", type=int, choices=(8, 28), help="image side: 8 or 28 (upsampled)")
    parser.add_argument("--width", type=int, help="hidden layer width")
    parser.add_argument("--layers", type=int, help="hidden layers (detached, each with a head)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--steps", type=int, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, help="steps before timing")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    parser.add_argument("--data-seed", type=int, default=0, help="train/test split")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    add_erase_arguments(parser)
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def compare_with_eager(rows: list[dict[str, Any]], models: dict[str, nn.Module],
                       inner: str) -> list[str]:
    """Fill each row's exactness fields; the variants that must equal eager but do not.

    A variant must equal eager bit for bit (every trained parameter, every
    head's accuracy) when it is erase with the ``aot_eager`` inner compiler:
    its early backward replays eager's ops and is scaled by exactly 1.
    """
    eager = next((r for r in rows if r["variant"] == "eager" and "error" not in r), None)
    failures = []
    for row in rows:
        if "error" in row or eager is None:
            continue
        diff = max_param_diff(models["eager"], models[row["variant"]])
        row["max_param_diff"] = diff
        row["equal_to_eager"] = diff == 0.0 and row["accuracy"] == eager["accuracy"]
        row["must_equal_eager"] = row["variant"] == "erase/aot_eager" or (
            row["variant"] in ("erase", "erase/one-stream") and inner == "aot_eager")
        if row["must_equal_eager"] and not row["equal_to_eager"]:
            failures.append(row["variant"])
            print(f"    FAIL: {row['variant']} (inner aot_eager) differs from eager after "
                  f"training: max |param difference| {diff:.3g}", flush=True)
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    inner = args.inner or ("inductor" if cuda else "aot_eager")
    requested = [v for v in args.variants.split(",") if v]
    unknown = set(requested) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; allowed: {', '.join(VARIANTS)}")
    if "eager" not in requested:
        requested.insert(0, "eager")  # NB: the reference of every comparison
    settings = RunSettings(device=device, inner=inner, streams=args.streams, batch=args.batch,
                           warmup=args.warmup, steps=args.steps, epochs=args.epochs, lr=args.lr,
                           seed=args.seed, on_error=args.on_error)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    data = load_digits(args.size, seed=args.data_seed).to(device)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(device) if cuda else 'cpu'}; "
          f"digits {args.size}x{args.size}: {len(data.y_train)} train, {len(data.y_test)} test; "
          f"MLP {args.layers} x {args.width}, batch {args.batch}", flush=True)
    torch.manual_seed(args.seed)
    base = DetachedMLP(data.features, args.width, args.layers).to(device)
    reports = erase_fx.explain(base, data.x_train[:args.batch], data.y_train[:args.batch],
                               erase_options={"streams": args.streams, "cudagraphs": False})
    explained = sum(len(r.blocks) for r in reports)
    print(f"    explain: {'; '.join(r.summary() for r in reports)}", flush=True)
    print(f"    early blocks found: {explained} (expected layers - 1 = {args.layers - 1})",
          flush=True)

    rows, models = [], {}
    for name in variants_for(requested, device, inner):
        row, models[name] = run_variant(name, base, data, settings)
        rows.append(row)
    failures = compare_with_eager(rows, models, inner)
    failures += [r["variant"] for r in rows if "error" in r]

    command = command_line("bench.paper.digits", argv)
    results = build_results(args, settings, data, rows, explained, command)
    path = write_results("digits", results, args.out_dir)
    print(f"wrote {path}", flush=True)
    for row in results["paper_comparison"]:
        print(f"  paper: {row['claim']}: {row['paper']} | erase_fx: {row['erase_fx']} -> "
              f"{row['verdict']}", flush=True)
    return 1 if failures or explained != args.layers - 1 else 0


if __name__ == "__main__":
    sys.exit(main())
