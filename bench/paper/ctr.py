"""The ERASE paper's CTR experiment, reproduced with erase_fx: ``python -m bench.paper.ctr``.

The paper reports up to +9.51% p90 QPS on a large CTR model with six
detached dense subarchitectures. Its reviewers found that (1) the local
losses of the detached blocks were never specified (without one, a detached
block gets no gradient at all: it is frozen, and skipping its backward is
not a schedule but a freezing artifact) and (2) the normalized entropy (NE)
of the fastest configuration was never measured. This script measures both
on a synthetic Criteo-like task, with every block's local loss explicit.

Data (`PlantedCriteo`, ``bench/paper/ctr_data.py``)
    13 dense features and 26 categorical fields with the Criteo Kaggle
    cardinalities, each capped at ``--cap``; Zipf-distributed categories;
    clicks drawn from a planted logistic model with pairwise and field x
    dense interactions, at click rate ``--ctr`` (0.25). The data seed is
    fixed (``--data-seed``); seeds vary the model's initial weights only, and
    every variant sees the same rows in the same order. The NE of the planted
    probabilities on the eval set is the "oracle" NE, the best any model can
    score. That module's docstring has the details.

Model (`BlockChainCTR`, ``bench/paper/ctr_model.py``)
    A DLRM-style front (embeddings, bottom MLP, DLRM's pairwise dot
    interaction, a projection to width ``d``), then six dense blocks
    ``LayerNorm(h + MLP(h))`` in a chain, each with a click head. Block k+1
    reads block k's output *detached*; block 1 reads the front as is, so the
    front trains through block 1's loss. That module's docstring has the
    details (why a chain; ``--interaction mask`` or ``select``).

Local losses (the reviewers' first point)
    Every block has an explicit local objective: BCE-with-logits of its head
    on the click label, weight ``--local-weight`` (1.0) for blocks 1-5 and
    1.0 for block 6. With weight 1.0 every block is trained as a click model
    on its own input (greedy layer-wise training, as in deep supervision);
    in the detached model a block's weight only scales its own gradient. The
    training loss is the sum of the six local losses; the prediction NE is
    computed on is block 6's head. ``--no-local-loss`` drops the local losses
    of blocks 1-5 (only block 6's loss is left): then blocks 1-5 and the
    front get exactly zero gradient, the freezing artifact.

Variants (same initial weights: deep copies of one module per seed; same
optimizer, Adam by default; same data order)
    ``baseline``          the same architecture without detach, trained end to
                          end on the same total loss (eager);
    ``eager``             the detached model, eager;
    ``eager/1ulp``        the rounding control: ``eager`` with every initial
                          weight moved one float step (``torch.nextafter``);
                          how far rounding alone carries the loss, NE and
                          weights over a run;
    ``inductor``          stock ``torch.compile`` of the detached model;
    ``reduce-overhead``   stock ``torch.compile(mode="reduce-overhead")``
                          (Inductor and CUDA graph trees; CUDA only);
    ``erase/aot_eager``   ``backend="erase"``, inner ``aot_eager``, no CUDA
                          graphs: the exactness proof, its losses and NE must
                          equal ``eager``'s exactly;
    ``erase``             ``backend="erase"``, inner ``--inner`` (Inductor on
                          CUDA), no CUDA graphs;
    ``erase+graphs``      the same with ``cudagraphs=True`` (CUDA only).
    Inductor's fused kernels round differently from eager (~1e-3 relative on
    some gradients), so ``erase`` is also compared with ``inductor``: its NE
    difference from eager is expected tiny but not zero. Training amplifies
    any rounding difference over the steps; ``eager/1ulp`` measures by how
    much, so the NE differences of the Inductor variants have a yardstick.

Throughput
    Per-step QPS = batch / step time (forward, backward, optimizer step;
    CUDA events), over the steps after ``--warmup`` (audited steps left out).
    ``p90`` is the 90th percentile of per-step QPS (10% of steps are faster:
    our reading of the paper's "p90 QPS"), ``p10`` the 10th percentile (90%
    of steps beat it), and the median. Mean and std across seeds.

Audit (the reviewers' point, made checkable)
    At steps 1, 10 and 100 (``--audit-steps``), in every variant of the first
    seed: the gradient norm of the front's and of each block's own
    parameters (its body and head), and the local loss the gradient came
    from, recomputed eagerly on the same batch before the optimizer step. A
    zero gradient is flagged ``FAIL``. A separate demonstration trains the
    ``--no-local-loss`` model (eager and ``erase/aot_eager``, ``--freeze-steps``
    steps) and asks ``erase_fx.explain`` what it finds in both models.

Results go to ``<--results-dir>/ctr.json`` (``ctr-no-local-loss.json`` with
``--no-local-loss``), rewritten after every run, in the contract of
``bench/paper/README.md``; ``python -m bench.paper.report`` renders them.
A run too long for one sitting can be split over seeds (``--seed 0 --seeds
3``, then ``--seed 3 --seeds 2``, each with its own ``--name``) and joined
with ``--merge``: the same results as one run of all the seeds, with the
command of each part in ``meta.merged_from``.

The results JSON (tables, figures, paper comparison) is built by
``bench/paper/ctr_report.py``; the names of the data, the model and the
report are importable from this module too.
"""
from __future__ import annotations

import os

# NB: cuBLAS is deterministic across streams only with a fixed workspace,
# which must be set before CUDA starts. It does not slow the kernels.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import erase_fx  # noqa: E402
from bench.paper import common  # noqa: E402
from bench.paper.common import fmt  # noqa: E402

# NB: re-exported: the tests, bench/ddp.py and bench/check_models.py import the
# data, the model and the report from here (`mlp`, once defined here too, is
# erase_fx._training's).
from bench.paper.common import mlp  # noqa: E402, F401
from bench.paper.ctr_data import (  # noqa: E402, F401
    CALIBRATION_ROWS,
    CHUNK_ROWS,
    CRITEO_KAGGLE_CARDINALITIES,
    DENSE_FEATURES,
    FIELDS,
    PLANTED_TERM_STD,
    Batch,
    DataSizes,
    Dataset,
    PlantedCriteo,
)
from bench.paper.ctr_model import (  # noqa: E402, F401
    BlockChainCTR,
    DenseBlock,
    DLRMFront,
    ModelSizes,
    group_of_param,
)
from bench.paper.ctr_report import (  # noqa: E402, F401
    ERASE_VARIANTS,
    EXACTNESS_PAIRS,
    PAPER_P90_GAIN,
    ROUNDING_CONTROL,
    STOCK_VARIANTS,
    VARIANTS,
    DataFacts,
    RunResult,
    by_variant,
    exactness,
    exactness_rows,
    gain,
    paired,
    run_from_data,
    summarize,
    verdict,
    zero_gradients,
)

#: Variants that need CUDA.
CUDA_ONLY = ("reduce-overhead", "erase+graphs")
#: Variants run by default on the CPU (no Inductor, no CUDA graphs).
CPU_DEFAULT_VARIANTS = ("baseline", "eager", "erase/aot_eager")

#: Presets; a flag given on the command line overrides its preset value.
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(steps=1000, seeds=5, batch=4096, eval_every=50, eval_rows=1 << 18,
                 warmup=20, freeze_steps=100, budget_s=0),
    "quick": dict(steps=200, seeds=2, batch=4096, eval_every=25, eval_rows=1 << 16,
                  warmup=10, freeze_steps=100, budget_s=210),
}


# -- variants --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a training run needs besides the variant and the seed."""

    device: torch.device
    steps: int
    warmup: int
    eval_every: int
    audit_steps: tuple[int, ...]
    optimizer: str
    lr: float
    inner: str
    streams: int


def compile_variant(name: str, model: nn.Module, settings: Settings) -> Callable[..., Any]:
    """What a training step of variant ``name`` calls: the module or a compiled wrapper."""
    if name in ("baseline", "eager", ROUNDING_CONTROL):
        return model
    if name == "inductor":
        return torch.compile(model)
    if name == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    inner = "aot_eager" if name == "erase/aot_eager" else settings.inner
    options = {"inner": inner, "streams": settings.streams,
               "cudagraphs": name == "erase+graphs"}
    return torch.compile(model, backend="erase", options=options)


def nudge_one_ulp(model: nn.Module) -> None:
    """Move every parameter one float step up (``torch.nextafter`` towards +inf), in place."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.nextafter(param, torch.full_like(param, math.inf)))


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """Adam (default), Adagrad (DLRM's usual choice) or SGD; dense updates of every parameter."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    return torch.optim.SGD(params, lr=lr)


# -- one training run --------------------------------------------------------------


def evaluate(model: BlockChainCTR, data: Dataset, chunk: int = 1 << 16) -> float:
    """Eval NE of the last block's head on the held-out set (eager, in chunks)."""
    dense, sparse, labels = data.eval
    with torch.no_grad():
        logits = torch.cat([model.predict(dense[i:i + chunk], sparse[i:i + chunk])
                            for i in range(0, labels.numel(), chunk)])
    return common.normalized_entropy(logits, labels)


def audit_gradients(model: BlockChainCTR, batch: Batch, step: int, variant: str) -> list[dict]:
    """Gradient norm of every group's own parameters, and the local loss it came from.

    Called after ``backward()`` and before the optimizer step, so the loss
    values (recomputed eagerly on the same batch, with the same weights) are
    those the gradients came from. A zero norm (or no gradient) is ``FAIL``.
    """
    with torch.no_grad():
        losses = model.block_losses(*batch)
    rows = []
    for group, params in model.param_groups().items():
        squares = [p.grad.double().pow(2).sum() for p in params if p.grad is not None]
        norm = torch.stack(squares).sum().sqrt().item() if squares else 0.0
        sources = model.loss_sources(group)
        rows.append({
            "variant": variant, "step": step, "group": group, "grad_norm": norm,
            "loss_from": "+".join(f"L{i + 1}" for i in sources) or "none",
            "local_loss": sum(losses[i].item() for i in sources) if sources else None,
            "status": "OK" if norm > 0 else "FAIL",
        })
    return rows


def train_run(variant: str, seed: int, base: BlockChainCTR, data: Dataset, settings: Settings,
              audit: bool, keep_params: bool) -> RunResult:
    """Train a deep copy of ``base`` as ``variant``; never raises (errors are recorded)."""
    result = RunResult(variant, seed)
    try:
        _train(result, base, data, settings, audit, keep_params)
    except Exception as error:  # noqa: BLE001 - one failing variant must not lose the others
        result.error = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        traceback.print_exc()
    finally:
        torch._dynamo.reset()
    return result


def _train(result: RunResult, base: BlockChainCTR, data: Dataset, settings: Settings,
           audit: bool, keep_params: bool) -> None:
    device = settings.device
    torch._dynamo.reset()
    model = copy.deepcopy(base).to(device)
    if result.variant == ROUNDING_CONTROL:
        nudge_one_ulp(model)
    step_fn = compile_variant(result.variant, model, settings)
    optimizer = make_optimizer(settings.optimizer, model.parameters(), settings.lr)
    timer = common.StepTimer(device)
    losses = torch.zeros(settings.steps, device=device, dtype=torch.float64)
    untimed: set[int] = set(range(min(settings.warmup, settings.steps)))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result.ne_curve.append((0, evaluate(model, data)))
    for step in range(settings.steps):
        batch = data.step_batch(step)
        first = step == 0
        wall = time.perf_counter()
        timer.start()
        optimizer.zero_grad(set_to_none=True)
        with erase_fx.collect_reports() if first else contextlib.nullcontext([]) as reports:
            loss = step_fn(*batch)
        loss.backward()
        if audit and step + 1 in settings.audit_steps:
            result.audit += audit_gradients(model, batch, step + 1, result.variant)
            untimed.add(step)
        optimizer.step()
        timer.stop()
        losses[step] = loss.detach()
        if first:
            common.synchronize(device)
            result.compile_seconds = time.perf_counter() - wall
            result.erase_reports = [r.to_dict() for r in reports]
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            result.ne_curve.append((step + 1, evaluate(model, data)))
    result.step_seconds = timer.seconds()
    result.losses = losses.tolist()
    result.timed_steps = [s for s in range(settings.steps) if s not in untimed]
    result.qps = common.throughput_stats([result.step_seconds[s] for s in result.timed_steps],
                                         data.batch)
    if device.type == "cuda":
        result.peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
    if keep_params:
        # NB: on the host, so that the next run's peak memory does not count them
        result.final_params = {n: p.detach().to("cpu", copy=True)
                               for n, p in model.named_parameters()}


def compare_final_params(runs: Sequence[RunResult]) -> None:
    """Fill each run's ``param_diffs`` against the same seed's eager and inductor runs, then
    drop the kept parameters (one seed's worth is held at a time)."""
    references = {run.variant: run for run in runs
                  if run.variant in ("eager", "inductor") and run.final_params is not None}
    for run in runs:
        if run.final_params is None or run.variant == "baseline":
            continue
        for name, reference in references.items():
            if reference is not run:
                run.param_diffs[name] = max(
                    (param - reference.final_params[key]).abs().max().item()
                    for key, param in run.final_params.items())
    for run in runs:
        run.final_params = None


# -- explain and the freezing demonstration ----------------------------------------


def explain_model(model: BlockChainCTR, batch: Batch, streams: int) -> dict[str, Any]:
    """What erase_fx finds in ``model``: early blocks and components left in the backward.

    Parameters are named by group (front, block1, ...): which block's
    backward erase_fx runs early.
    """
    reports = erase_fx.explain(model, *(t[:256] for t in batch),
                               erase_options={"streams": streams})
    early, rejected, summaries = [], [], []
    for report in reports:
        summaries.append(report.summary())
        for block in report.blocks:
            early.append({"id": block.id, "stream": block.stream,
                          "groups": sorted({group_of_param(p) for p in block.params}),
                          "flops": block.flops})
        for component in report.rejected:
            rejected.append({"reason": component.reason, "detail": component.detail,
                             "groups": sorted({group_of_param(p) for p in component.params})})
    return {"summaries": summaries, "early_blocks": early, "rejected": rejected}


def freeze_demo(base_sizes: ModelSizes, data: Dataset, settings: Settings, seed: int,
                local_weight: float, say: Callable[[str], None]) -> dict[str, Any]:
    """The reviewers' freezing artifact: blocks 1-5 without a local loss get zero gradient.

    Trains the no-local-loss model (eager and erase/aot_eager) for
    ``settings.steps`` steps, auditing the gradients, and asks
    `erase_fx.explain` what it finds in it and in the model with local losses.
    """
    build = lambda: BlockChainCTR(  # noqa: E731
        base_sizes, detach=True, local_losses=False, local_weight=local_weight)
    base = common.build_seeded(build, seed)
    runs = []
    for variant in ("eager", "erase/aot_eager"):
        run = train_run(variant, seed, base, data, settings, audit=True, keep_params=False)
        runs.append(run)
        say(f"  no-local-loss {variant:16s} final NE {fmt(run.final_ne)}"
            + (f" ERROR {run.error}" if run.error else ""))
        for step in settings.audit_steps:
            frozen = [row["group"] for row in run.audit
                      if row["step"] == step and row["status"] == "FAIL"]
            if frozen:
                say(f"    step {step}: zero gradient FAIL in {', '.join(frozen)} (expected: no "
                    f"local loss reaches them)")
    with_losses = common.build_seeded(lambda: BlockChainCTR(
        base_sizes, detach=True, local_losses=True, local_weight=local_weight), seed)
    batch = tuple(t.cpu() for t in data.step_batch(0))
    explained = {
        "with_local_losses": explain_model(with_losses, batch, settings.streams),
        "no_local_loss": explain_model(base, batch, settings.streams),
    }
    for key, found in explained.items():
        say(f"  explain ({key}): " + "; ".join(found["summaries"]))
    return {"runs": runs, "explain": explained}


# -- command line ------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.paper.ctr", description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"the quick preset {PRESETS['quick']} (else {PRESETS['full']})")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated, of {','.join(VARIANTS)} (default: all on CUDA, "
                             f"{','.join(CPU_DEFAULT_VARIANTS)} on CPU)")
    sizes = parser.add_argument_group("run sizes (default: the preset's)")
    for flag, kind in (("steps", int), ("seeds", int), ("batch", int), ("eval-every", int),
                       ("eval-rows", int), ("warmup", int), ("freeze-steps", int)):
        sizes.add_argument(f"--{flag}", type=kind, default=None)
    parser.add_argument("--seed", type=int, default=0, help="first model seed")
    parser.add_argument("--data-seed", type=int, default=1234)
    parser.add_argument("--cap", type=int, default=100_000, help="most rows of a field's table")
    parser.add_argument("--rank", type=int, default=8, help="rank of the planted interactions")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the categories")
    parser.add_argument("--ctr", type=float, default=0.25, help="target click rate")
    parser.add_argument("--embed-dim", type=int, default=64)
    parser.add_argument("--bottom", default="512,256", help="bottom MLP hidden widths")
    parser.add_argument("--width", type=int, default=512, help="block width d")
    parser.add_argument("--hidden", type=int, default=1024, help="block hidden width h")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--interaction", choices=("select", "mask"), default="mask",
                        help="pairwise dots times an upper-triangle mask, or DLRM's index_select")
    parser.add_argument("--local-weight", type=float, default=1.0,
                        help="weight of blocks 1..K-1's local BCE losses")
    parser.add_argument("--no-local-loss", action="store_true",
                        help="blocks 1..K-1 without a local loss (the freezing artifact)")
    parser.add_argument("--optimizer", choices=("adam", "adagrad", "sgd"), default="adam")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--inner", choices=("inductor", "aot_eager", "eager"), default=None,
                        help="erase's inner compiler (default: inductor on CUDA, aot_eager on CPU)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--audit-steps", default="1,10,100")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.use_deterministic_algorithms for every variant")
    parser.add_argument("--strict", action="store_true", help="exit 1 on any FAIL")
    sizes.add_argument("--budget-s", type=float, default=None,
                       help="start no new run after this many seconds (0: no limit)")
    parser.add_argument("--train-rows", type=int, default=None,
                        help="training rows drawn (default steps x batch); the stream repeats")
    parser.add_argument("--results-dir", default=str(common.DEFAULT_RESULTS_DIR))
    parser.add_argument("--name", default=None,
                        help="results file stem (default: ctr, or ctr-no-local-loss)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="run nothing: join results files of one run split over disjoint "
                             "seeds (e.g. --seed 0 --seeds 3, then --seed 3 --seeds 2) into "
                             "<results-dir>/<name>.json; every other flag of the parts must "
                             "agree, and here only --name, --results-dir and --strict count. "
                             "Given one file: summarize its runs again with this code")
    args = parser.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.inner is None:
        args.inner = "inductor" if args.device.type == "cuda" else "aot_eager"
    if args.variants is None:
        args.variants = VARIANTS if args.device.type == "cuda" else CPU_DEFAULT_VARIANTS
    else:
        args.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; allowed: {', '.join(VARIANTS)}")
    if args.device.type != "cuda" and any(v in CUDA_ONLY for v in args.variants):
        parser.error(f"{', '.join(CUDA_ONLY)} need CUDA (CUDA graphs)")
    args.variants = tuple(v for v in VARIANTS if v in args.variants)  # run order
    args.audit_steps = tuple(int(s) for s in args.audit_steps.split(",") if s.strip())
    args.bottom = tuple(int(w) for w in args.bottom.split(","))
    args.name = args.name or ("ctr-no-local-loss" if args.no_local_loss else "ctr")
    return args


class Budget:
    """``--budget-s``: once spent, no new run starts; what ran is kept and written."""

    def __init__(self, seconds: float | None, say: Callable[[str], None]):
        self.seconds, self.say = seconds, say
        self.start = time.perf_counter()
        self.exhausted: str | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self, where: str) -> bool:
        if not self.seconds or self.elapsed() < self.seconds:
            return False
        if self.exhausted is None:
            self.exhausted = where
            self.say(f"--budget-s {self.seconds:g} spent: no new run ({where})")
        return True


def run_seeds(args: argparse.Namespace, data: Dataset, model_sizes: ModelSizes,
              settings: Settings, budget: Budget, save: Callable[[list[RunResult]], None],
              say: Callable[[str], None]) -> list[RunResult]:
    """Every variant of every seed; the variants of a seed start from one module's weights.

    The first seed's runs are audited. After each seed the final parameters
    are compared across variants and the results file is rewritten.
    """
    runs: list[RunResult] = []
    total = args.seeds * len(args.variants)
    for seed in range(args.seed, args.seed + args.seeds):
        base = common.build_seeded(lambda: BlockChainCTR(
            model_sizes, detach=True, local_losses=not args.no_local_loss,
            local_weight=args.local_weight), seed)
        seed_runs = []
        for variant in args.variants:
            if budget.spent(f"after {len(runs)} of {total} runs"):
                break
            model = base if variant != "baseline" else _undetached(base)
            run = train_run(variant, seed, model, data, settings, audit=seed == args.seed,
                            keep_params=True)
            seed_runs.append(run)
            runs.append(run)
            say(_progress(len(runs), total, run, budget.elapsed()))
            for failure in zero_gradients(run):
                say(f"  FAIL: {failure}")
        compare_final_params(seed_runs)
        _report_exactness(seed_runs, say)
        save(runs)
        if budget.exhausted:
            break
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    say = lambda text: print(text, flush=True)  # noqa: E731
    if args.merge:
        payload = merge([Path(p) for p in args.merge], args.name,
                        common.command_line("bench.paper.ctr", argv))
        common.write_results(args.name, payload, args.results_dir)
        return _finish(payload, args, f"from {len(args.merge)} results file(s)", say)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    budget = Budget(args.budget_s, say)
    say(f"ctr: torch {torch.__version__} on {common.device_name(device)}; variants "
        f"{','.join(args.variants)}; {args.seeds} seeds x {args.steps} steps, batch {args.batch}")
    data_sizes = DataSizes(cap=args.cap, rank=args.rank, zipf=args.zipf, ctr=args.ctr)
    data = Dataset.make(data_sizes, args.steps, args.batch, args.eval_rows, args.data_seed, device,
                        args.train_rows)
    say(f"data: {data.train[2].numel()} training rows, {args.eval_rows} eval rows, click rate "
        f"{data.train_ctr:.3f}, oracle NE {data.oracle_ne:.4f} ({budget.elapsed():.1f} s)")
    model_sizes = ModelSizes(tuple(data_sizes.rows_per_field()), args.embed_dim, args.bottom,
                             args.width, args.hidden, args.blocks, args.interaction)
    settings = Settings(device, args.steps, args.warmup, args.eval_every, args.audit_steps,
                        args.optimizer, args.lr, args.inner, args.streams)
    meta = common.run_meta(
        device, common.command_line("bench.paper.ctr", argv), quick=args.quick,
        erase_fx=erase_fx.__version__, variants=list(args.variants), steps=args.steps,
        seeds=args.seeds, batch=args.batch, deterministic=args.deterministic, tf32=args.tf32,
        settings=settings_record(args), final_params_kept_on="cpu")
    demo: dict[str, Any] | None = None

    def save(runs: list[RunResult]) -> dict[str, Any]:
        if budget.exhausted:
            meta["budget_exhausted"] = budget.exhausted
        payload = summarize(runs, demo, data, args, meta)
        common.write_results(args.name, payload, args.results_dir)
        return payload

    # NB: the demonstration first: it is cheap, and --budget-s must not skip it.
    if args.freeze_steps > 0 and not args.no_local_loss:
        say(f"no-local-loss demonstration: {args.freeze_steps} steps, eager and erase/aot_eager")
        freeze_settings = dataclasses.replace(settings, steps=args.freeze_steps,
                                              warmup=min(args.warmup, args.freeze_steps))
        demo = freeze_demo(model_sizes, data, freeze_settings, args.seed, args.local_weight, say)
    runs = run_seeds(args, data, model_sizes, settings, budget, save, say)
    return _finish(save(runs), args, f"in {budget.elapsed():.0f} s", say)


def _finish(payload: dict[str, Any], args: argparse.Namespace, how: str,
            say: Callable[[str], None]) -> int:
    """Print the main tables and the failures; the exit status."""
    for table in payload["tables"][:3]:
        say(_format_table(table))
    failures = payload["data"]["failures"]
    say(f"wrote {args.results_dir}/{args.name}.json {how}; "
        + ("FAIL: " + "; ".join(failures) if failures else "no FAIL"))
    return 1 if failures and args.strict else 0


# -- merging runs split over several invocations ------------------------------------

#: Flags that may differ between the parts of a merged run.
MERGE_MAY_DIFFER = ("seed", "seeds", "budget_s", "results_dir", "name", "merge", "strict",
                    "freeze_steps")


def settings_record(args: argparse.Namespace) -> dict[str, Any]:
    """Every flag of a run, JSON-ready (``meta.settings``): what ``--merge`` checks."""
    record = {}
    for key, value in vars(args).items():
        if isinstance(value, torch.device):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        record[key] = value
    return record


def merge(paths: Sequence[Path], name: str, command: str) -> dict[str, Any]:
    """One results payload from the files of one run split over disjoint seeds.

    Given one file, it summarizes that run again with this version of the
    code (new tables from the same measurements).

    The gradient audit is the first seed's, as in a run of all the seeds
    (each part audited its own first seed); the no-local-loss demonstration
    is the first part's that has one.

    Raises ValueError when the files do not belong together: a flag other
    than `MERGE_MAY_DIFFER`, the device, the torch version or the data
    differ, a seed is in two files, or the seeds have a gap.
    """
    if not paths:
        raise ValueError("--merge needs a results file or more")
    parts = [json.loads(Path(path).read_text()) for path in paths]
    for path, part in zip(paths, parts):
        if "settings" not in part["meta"]:
            raise ValueError(f"{path} has no meta.settings: it was written before --merge "
                             f"existed; run it again")
    first = parts[0]
    for path, part in zip(paths[1:], parts[1:]):
        differ = sorted(key for key in first["meta"]["settings"].keys()
                        | part["meta"]["settings"].keys()
                        if key not in MERGE_MAY_DIFFER
                        and first["meta"]["settings"].get(key) != part["meta"]["settings"].get(key))
        differ += [f"meta.{key}" for key in ("torch", "device")
                   if part["meta"][key] != first["meta"][key]]
        differ += [f"data.{key}" for key in ("oracle_ne", "train_ctr")
                   if part["data"][key] != first["data"][key]]
        if differ:
            raise ValueError(f"{path} and {paths[0]} are not parts of one run: they differ in "
                             f"{', '.join(differ)}")
    seeds_by_file = [sorted({run["seed"] for run in part["data"]["runs"]}) for part in parts]
    seeds = sorted(seed for part_seeds in seeds_by_file for seed in part_seeds)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"a seed is in two files (seeds per file: {seeds_by_file})")
    if seeds != list(range(seeds[0], seeds[0] + len(seeds))):
        raise ValueError(f"the seeds have a gap (seeds per file: {seeds_by_file})")
    runs = sorted((run_from_data(run) for part in parts for run in part["data"]["runs"]),
                  key=lambda run: (run.seed, VARIANTS.index(run.variant)))
    for run in runs:
        # NB: each part audited its own first seed; the audit is the first seed's
        if run.seed != seeds[0]:
            run.audit = []
    demo = next(({"runs": [run_from_data(run) for run in part["data"]["freeze_demo"]["runs"]],
                  "explain": part["data"]["freeze_demo"]["explain"]}
                 for part in parts if part["data"]["freeze_demo"]), None)
    settings = {**first["meta"]["settings"], "seed": seeds[0], "seeds": len(seeds), "name": name}
    meta = {key: value for key, value in first["meta"].items() if key != "budget_exhausted"}
    kept_on: dict[str, list[int]] = {}
    for part, part_seeds in zip(parts, seeds_by_file):
        kept_on.setdefault(part["meta"].get("final_params_kept_on", "gpu"), []).extend(part_seeds)
    meta["final_params_kept_on"] = (next(iter(kept_on)) if len(kept_on) == 1 else ", ".join(
        f"{where} for seeds {','.join(map(str, sorted(where_seeds)))}"
        for where, where_seeds in kept_on.items()))
    meta.update(command=command, seeds=len(seeds), settings=settings, merged_from=[
        {"file": Path(path).name, "seeds": part_seeds, **{
            key: part["meta"].get(key)
            for key in ("date", "command", "git_commit", "budget_exhausted")}}
        for path, part, part_seeds in zip(paths, parts, seeds_by_file)])
    data = DataFacts(first["data"]["oracle_ne"], first["data"]["train_ctr"])
    return summarize(runs, demo, data, argparse.Namespace(**settings), meta)


def _undetached(base: BlockChainCTR) -> BlockChainCTR:
    """The baseline: the same weights, no stop-gradient."""
    baseline = copy.deepcopy(base)
    baseline.detach = False
    return baseline


def _report_exactness(runs: list[RunResult], say: Callable[[str], None]) -> None:
    grouped = by_variant(runs)
    for row in exactness_rows(grouped):
        numbers = row["numbers"]
        flag = "OK" if row["exact"] else ("FAIL" if row["required"] else "(rounding)")
        say(f"  {row['variant']} vs {row['reference']}: max |d loss| "
            f"{numbers['max_train_loss_diff']:.3g}, |d NE| {numbers['final_ne_diff']:.3g}, "
            f"max |d param| {fmt(numbers['max_param_diff'], 3)} {flag}")


def _progress(done: int, total: int, run: RunResult, elapsed: float) -> str:
    head = f"[{done}/{total}] {run.variant:16s} seed {run.seed}"
    if run.error:
        return f"{head}: ERROR {run.error}"
    return (f"{head}: p90 QPS {run.qps['p90']:.4g}, median {run.qps['median']:.4g}, "
            f"step {run.qps['mean_step_ms']:.2f} ms, first step {run.compile_seconds:.1f} s, "
            f"final NE {run.final_ne:.5f}, elapsed {elapsed:.0f} s")


def _format_table(table: dict[str, Any]) -> str:
    lines = [table["caption"], "| " + " | ".join(table["columns"]) + " |",
             "|" + "---|" * len(table["columns"])]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
