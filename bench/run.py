"""The GPU benchmark: every variant of every config, side by side, in one run.

``python -m bench.run`` times one training step of each config under each
variant. Variant names follow one grammar (`bench.harness`):

- ``eager``: the model as written;
- ``paper``: the ERASE paper's eager scheme (`PaperSchedule`): each block's
  forward and ``loss.backward()`` on a side stream inside the forward
  (detached chains only);
- ``inductor``: ``torch.compile(model)``;
- ``reduce-overhead``: ``torch.compile(model, mode="reduce-overhead")``;
- ``inductor+graph``: ``torch.compile(model)`` with the whole step captured
  by hand in one ``torch.cuda.CUDAGraph`` (the strongest plain baseline);
- ``inductor+step``: ``torch.compile(model)`` inside ``erase_fx.compile_step``
  (the whole step captured by the product API instead of by hand);
- ``erase``: ``backend="erase"``, Inductor inside, no CUDA graphs;
- ``erase+graphs``: ``backend="erase"`` with its CUDA graphs (the default);
- ``erase+step-graph``: ``backend="erase"`` (its own CUDA graphs off) with
  the whole step captured by hand, exactly as ``inductor+graph``: the
  schedule's worth once the CPU is out of the way;
- ``erase+step``: the same inside ``erase_fx.compile_step``;
- ``+adam`` forms (``inductor+graph+adam``, ``inductor+step+adam``,
  ``erase+step+adam``, ...): Adam's update (``foreach=True, capturable=True``)
  inside the step;
- controls: ``erase+graphs/streams=N`` (``--streams``), and ``/one-stream``
  forms (``erase+graphs/one-stream``, ``erase+step-graph/one-stream``,
  ``erase+step/one-stream``): the backend's ``overlap=False``, every segment
  on the main stream (what the overlap alone is worth); the others are
  listed in `bench.harness` (options such as ``/streams=2``, compile_step's
  ``/early-optimizer``, and ``/layouts-unpinned``, ``/late-cse`` and
  ``/partitioner-order``, which patch erase_fx for their row).

Configs (`bench.models.parse_config`): detached chains ``kind:B:d:h:K``
(`CONFIGS`, the default; towers too), transformer chains ``gpt:B:d:T:K``
(`GPT_CONFIGS`; ``gpt-soft:B:d:T:K`` on label-smoothed targets made in the
forward), torchvision models ``tv-<name>:B:image`` (`VISION_CONFIGS`,
`bench.vision`; skipped, with a line saying so, where torchvision is not
importable), and user code's patterns ``pattern-<name>:B[:width[:depth]]``
(`PATTERN_CONFIGS`, `bench.user_patterns.PatternConfig`: a Forward-Forward
net, a local-loss VGG, forward hooks, a tensor kept on the module, a
data-dependent op between blocks, a ``transformers`` GPT-2 with probes,
skipped with a line where transformers is not importable). A pattern's
loss is its own ``loss_of`` applied to the model's output, outside the
compiled model, in every variant's step (`bench.harness.build_step`); every
other config's model returns its loss.

Each row: the median, min and max over trials of the mean step time of
``--steps-per-trial`` steps (CUDA events, after warm-up and capture), memory
(`bench.harness.StepMemory`: the absolute peak; the step's own peak above
what was allocated before the timed steps; what the compiled program keeps
between steps (graph pools, static buffers) beyond the model's parameters,
buffers, grads and optimizer state; their sum, the judged figure), compile
time (first calls: compile, warm-up and capture), the largest relative
gradient error of any parameter against eager on the first step (tf32 off
for that step; Inductor variants differ from eager by Inductor's own
rounding, about 1e-3 here, and ``bench.check_cuda`` holds erase to stock
Inductor instead; models with dropout or stochastic depth sample other masks,
marked random), achieved TFLOP/s (matrix FLOPs, where counted), and for
``+step`` rows ``compile_step``'s captures, replays and reason for not
capturing, and for erase rows the early blocks its compiled program
scheduled (`early_info`: the judged limits depend on it). A variant that
raises gives a row with its error; the run goes on. Timing runs with tf32
and cudnn.benchmark on. Updates the current table, ``bench/results/step.json``
(``--out``) and ``step.md`` beside it: a row measured again replaces the
row of the same config, variant, GPU and CUDA allocator, the others stay,
each with its date, machine and command (`bench.tables`; history in git).
Each row keeps its ratios to the variants it is compared with, measured in
its own run (``vs``: its stock variants, `Variant.stock`, and the targets'
baselines), and the targets (`TIME_TARGETS`, `memory_targets`) are judged
on those (erase against stock: at most 1.00x where it scheduled early
blocks, 1.02x where it has none). The table is rewritten after every row.
Prints a progress line per variant. Needs a GPU.

``--smoke``: the same loop on the CPU, to check a part of ``bench/device_run.sh``
end to end before a GPU runs it (``bash bench/device_run.sh <part> --smoke``):
every variant compiled without code generation (`bench.harness.compile_forward`'s
``aot_eager``), steps timed by the CPU clock, no memory figures, nothing
captured; it writes only a table ``--out`` names outside ``bench/results``, and
exits with status 1 if a row failed.
``--explain``: no run; for each config, built on the CPU at its size, what
`erase_fx.explain` finds: the graphs, the early blocks, the share of the
backward's FLOPs they run early, and why the rest stays in the backward.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import erase_fx
from erase_fx.early_update import describe_refusals
from bench.harness import (WARMUP_STEPS, StepMemory, Variant, allocator_backend, build_step,
                           canonical, grads_of, judged_erase, max_rel_err, set_tf32, time_steps)
from bench.models import build_with_loss, config_flops, is_random, parse_config, takes_paper_scheme
from bench.tables import RESULTS, Run, merge_rows, numbered, this_run
from bench.user_patterns import PATTERN_CONFIGS, PatternConfig, pattern_model
from bench.vision import VISION_CONFIGS

CONFIGS = ("ctr:1024:512:1024:6", "mlp:512:1024:2048:6", "mlp:128:2000:2000:4",
           "ctr:4096:1024:2048:6", "ctr:16384:1024:2048:6")
SMALL = CONFIGS[:3]
GPT_CONFIGS = ("gpt:8:768:1024:6", "gpt:16:384:256:8")
#: The configs of the memory targets: where activations, not weights, fill the device.
MEMORY_CONFIGS = (*GPT_CONFIGS, "ctr:16384:1024:2048:6")
VARIANTS = ("eager", "paper", "inductor", "reduce-overhead", "inductor+graph", "inductor+step",
            "erase", "erase+graphs", "erase+step-graph", "erase+step")
ADAM_VARIANTS = ("inductor+graph+adam", "inductor+step+adam", "erase+step+adam")
#: The erase forms that get a ``/one-stream`` row on the sweep configs (when asked for).
ONE_STREAM_FORMS = ("erase+graphs", "erase+step-graph", "erase+step")
#: The current table of bench.run's rows (``step.md`` beside it).
TABLE = RESULTS / "step.json"


def measure(cfg, name: str, new_model, inputs, reference, args, loss_of=None) -> dict:
    """One row: build the variant, check its first step, warm it up, time it, weigh it.

    ``new_model()``: a fresh copy of the config's model; ``loss_of``: the
    config's (`bench.models.build_with_loss`), applied in the step.
    """
    variant = Variant.parse(name)
    smoke = getattr(args, "smoke", False)
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    memory = NoMemory() if smoke else StepMemory()
    memory.start()
    model = new_model()
    errors = []

    def after_first():
        errors.append(max_rel_err(reference, grads_of(model)))
        set_tf32(True)

    start = time.perf_counter()
    set_tf32(False)
    with variant.patched():
        with erase_fx.collect_reports() as reports:
            built = build_step(variant, model, inputs, after_first=after_first,
                               loss_of=loss_of, inner="aot_eager" if smoke else None)
            built.warm_up(WARMUP_STEPS)
            if not smoke:
                torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        memory.before_timing()
        timer = cpu_time_steps if smoke else time_steps
        median, low, high = timer(built.step, args.trials, args.steps_per_trial)
        weighed = memory.finish(model, built.optimizer)
    flops = config_flops(cfg)
    row = {
        "config": str(cfg), "variant": name, "ms_median": median, "ms_min": low, "ms_max": high,
        **weighed, "compile_s": compile_s, "grad_max_rel_err": errors[0],
        "grad_random": is_random(cfg),
        "tflops": None if flops is None else flops / (median * 1e-3) / 1e12,
        **built.capture_info(), **early_info(variant, reports),
    }
    del built, model
    gc.collect()
    torch.cuda.empty_cache()
    row["workspace_bytes"] = memory.workspaces()
    print(f"  {cfg} {name:28s} {median:8.3f} ms (min {low:.3f}, max {high:.3f}) "
          f"{_tflops(row['tflops'])} TFLOP/s, peak {_mib(row['peak_mem_bytes'])} MiB, "
          f"step {_mib(row['mem_bytes'])} MiB (kept {_mib(row['kept_bytes'])}), "
          f"compile {compile_s:5.1f} s, grad err {errors[0]:.1e}{_notes(row)}", flush=True)
    return row


class NoMemory:
    """`StepMemory`'s calls for ``--smoke`` on the CPU: no memory figure (None each)."""

    def start(self) -> None:
        pass

    def before_timing(self) -> None:
        pass

    def finish(self, model, optimizer) -> dict:
        return dict.fromkeys(("peak_mem_bytes", "step_peak_bytes", "kept_bytes", "mem_bytes",
                              "state_bytes"))

    def workspaces(self) -> None:
        return None


def cpu_time_steps(step, trials: int, steps_per_trial: int):
    """`time_steps` by the CPU clock (``--smoke``): median, min and max of the mean (ms)."""
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(steps_per_trial):
            step()
        times.append((time.perf_counter() - start) * 1e3 / steps_per_trial)
    return statistics.median(times), min(times), max(times)


def early_info(variant: Variant, reports) -> dict:
    """What an erase row's compiled program runs early, from the backend's `GraphReport`s.

    ``early_blocks``: the distinct early blocks (by their parameters: a graph
    compiled again, e.g. on a recompile, counts once) in the graphs compiled
    while the step was built, warmed up and captured; a graph that fell back
    to the stock path has none. ``erase_graphs``: how many graphs the erase
    backend compiled. ``erase_fallback``: the first stock-path reason, if any.
    Stock variants get no fields (their program has no early blocks to count).
    """
    if variant.compiler != "erase":
        return {}
    blocks = {block.params for report in reports for block in report.blocks}
    fallbacks = [r.fallback_reason for r in reports if r.fallback_reason]
    return {"early_blocks": len(blocks), "erase_graphs": len(reports),
            "erase_fallback": fallbacks[0][:300] if fallbacks else None}


def run_config(cfg, variants, args, out_of_time=lambda: False,
               on_row=lambda rows: None) -> list[dict]:
    device = torch.device("cpu" if getattr(args, "smoke", False) else "cuda")
    torch.manual_seed(0)
    try:
        base, inputs, loss_of = build_with_loss(
            cfg, device, torch.Generator(device=device).manual_seed(0))
    except ImportError as error:
        print(f"  {cfg}: skipped, {error}", flush=True)
        return []

    def new_model():
        if isinstance(cfg, PatternConfig):
            # NB: a pattern's model is built again (the same parameters), not copied: a deep
            # copy shares what the model's forward hooks close over (hooked_activations'
            # dict), so every copy's forward would write the first model's dict, and the
            # next copy fail on the non-leaf tensors it then holds
            return pattern_model(cfg, device)
        return copy.deepcopy(base)

    set_tf32(False)
    reference_model = new_model()
    output = reference_model(*inputs)
    (output if loss_of is None else loss_of(output)).backward()
    reference = grads_of(reference_model)
    del reference_model
    rows = []
    for name in variants:
        if out_of_time():
            print(f"  {cfg} {name}: skipped, --budget-s spent", flush=True)
            continue
        if name == "paper" and not takes_paper_scheme(cfg):
            print(f"  {cfg} {name}: skipped, the paper's scheme needs a detached chain",
                  flush=True)
            continue
        try:
            rows.append(measure(cfg, name, new_model, inputs, reference, args, loss_of))
        except Exception as error:  # NB: one failing variant must not lose the others' rows
            message = f"{type(error).__name__}: {error}".splitlines()[0][:400]
            print(f"  {cfg} {name}: FAILED {message}", flush=True)
            rows.append({"config": str(cfg), "variant": name, "error": message})
            torch._dynamo.reset()
        on_row(rows)
        gc.collect()
        torch.cuda.empty_cache()
    return rows


# -- the targets, judged on ratios measured in this run -------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """``variant`` at most ``limit`` times ``baseline`` (step time, or step memory) ``where``.

    ``early``: None, judged whatever the variant's row ran early; ``"yes"``,
    only where its compiled program scheduled early blocks (or its row does
    not say: results written before rows recorded it get the stricter
    limit); ``"no"``, only where its row records none (`early_info`).
    ``why``: the reason for the limit, in words, for the table.
    """

    variant: str
    baseline: str
    limit: float
    where: str  # small | elsewhere | everywhere | memory | not-memory | a config prefix
    measure: str = "time"  # time: ms_median; memory: mem_bytes
    early: str | None = None  # None | yes | no
    why: str = ""

    def applies(self, config: str) -> bool:
        if self.where == "small":
            return config in SMALL
        if self.where == "elsewhere":
            return config not in SMALL
        if self.where == "everywhere":
            return True
        if self.where == "memory":
            return is_memory_config(config)
        if self.where == "not-memory":
            return not is_memory_config(config)
        return config.startswith(self.where)

    def applies_to_early(self, early_blocks: int | None) -> bool:
        """Whether the target judges a row with ``early_blocks`` (None: not recorded)."""
        if self.early == "yes":
            return early_blocks != 0
        if self.early == "no":
            return early_blocks == 0
        return True


#: Issue 13, "never slower than stock torch.compile": erase against its stock
#: variant at most 1.00x where erase scheduled early blocks, and within 1.02x
#: (noise, and the guard's cost) where it found none and is stock Inductor.
LIMIT_EARLY, LIMIT_NO_EARLY = 1.00, 1.02


def never_slower(variant: str, baseline: str, where: str) -> tuple[Target, Target]:
    """The two issue-13 targets of ``variant`` against ``baseline``: early blocks or none."""
    return (Target(variant, baseline, LIMIT_EARLY, where, early="yes", why="never slower"),
            Target(variant, baseline, LIMIT_NO_EARLY, where, early="no",
                   why="no early block: stock Inductor, within 1.02x"))


SMALL_WHY, API_WHY = "small chain", "compile_step vs the hand capture"
TIME_TARGETS = (
    # erase's own graphs, no change to the training loop
    Target("erase+graphs", "inductor+graph", 0.85, "small", why=SMALL_WHY),
    Target("erase+graphs", "reduce-overhead", 0.85, "small", why=SMALL_WHY),
    Target("erase+graphs", "inductor+graph", 0.97, "ctr:4096:", why="ctr:4096 chain"),
    Target("erase+graphs", "inductor+graph", 1.00, "ctr:16384:", why="ctr:16384 (GPU bound)"),
    *never_slower("erase+graphs", "reduce-overhead", "elsewhere"),
    # no CUDA graphs at all
    *never_slower("erase", "inductor", "everywhere"),
    # the whole step captured by hand
    Target("erase+step-graph", "inductor+graph", 0.85, "small", why=SMALL_WHY),
    Target("erase+step-graph", "inductor+graph", 0.97, "ctr:4096:", why="ctr:4096 chain"),
    Target("erase+step-graph", "inductor+graph", 1.00, "ctr:16384:",
           why="ctr:16384 (GPU bound)"),
    # the whole step through compile_step
    Target("erase+step", "inductor+step", 0.78, "small", why=SMALL_WHY),
    Target("erase+step", "inductor+step", 0.78, "tv-resnet18-dgl:",
           why="ResNet-18 with detached stages"),
    *never_slower("erase+step", "inductor+step", "elsewhere"),
    Target("erase+step+adam", "inductor+step+adam", 0.85, "small", why=SMALL_WHY),
    *never_slower("erase+step+adam", "inductor+step+adam", "elsewhere"),
    # compile_step against the hand capture of the same compiled model
    Target("inductor+step", "inductor+graph", 1.02, "everywhere", why=API_WHY),
    Target("erase+step", "erase+step-graph", 1.02, "everywhere", why=API_WHY),
    Target("inductor+step+adam", "inductor+graph+adam", 1.02, "everywhere", why=API_WHY),
    Target("erase+step+adam", "erase+step-graph+adam", 1.02, "everywhere", why=API_WHY),
)
#: The memory limits: erase's step memory against each of its stock variants'.
MEMORY_LIMIT, MEMORY_LIMIT_HEAVY = 1.0, 0.6


def is_memory_config(config: str) -> bool:
    """gpt configs and ctr:16384: activations dominate, so early frees must show."""
    return config.startswith(("gpt:", "gpt-soft:", "ctr:16384:"))


def memory_targets(rows) -> list[Target]:
    """Every judged erase variant of the rows against each of its stock variants (memory)."""
    targets = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        if not judged_erase(name):
            continue
        for stock in Variant.parse(name).stock():
            targets.append(Target(name, stock, MEMORY_LIMIT_HEAVY, "memory", "memory",
                                  why="activations dominate"))
            targets.append(Target(name, stock, MEMORY_LIMIT, "not-memory", "memory",
                                  why="no more memory"))
    return targets


#: What a row records of the run that measured it (`stamped`).
RUN_FIELDS = ("date", "command", "gpu", "torch", "allocator", "trials", "steps_per_trial")
#: A row measured again replaces the table's row with the same values of these.
KEY = ("config", "variant", "gpu", "allocator")
#: A row's key -> the name of its ratio in ``vs``.
MEASURES = {"ms_median": "time", "mem_bytes": "memory"}


def _run_of(row: dict) -> tuple:
    return tuple(row.get(field) for field in ("date", "command", "gpu", "allocator"))


def _measured(rows) -> dict:
    return {(r["config"], r["variant"]): r for r in rows if "error" not in r}


def baselines(variant: str) -> list[str]:
    """The variants a row of ``variant`` keeps its ratios to: its stock variants, the
    baselines of its targets, and the table's two columns (inductor+graph, reduce-overhead)."""
    try:
        stock = Variant.parse(variant).stock()
    except ValueError:
        stock = []
    targets = [t.baseline for t in TIME_TARGETS if t.variant == variant]
    return [b for b in dict.fromkeys([*stock, *targets, "inductor+graph", "reduce-overhead"])
            if b != variant]


def _over(mine: float | None, theirs: float | None) -> float | None:
    return None if mine is None or theirs is None or theirs <= 0 else mine / theirs


def with_ratios(rows: list[dict]) -> list[dict]:
    """The rows, each that has no ``vs`` given its ratios to its `baselines` measured in its
    own run (the rows of its date, command, GPU and allocator), e.g. ``{"inductor+step":
    {"time": 0.9, "memory": 1.2, "memory_without_workspaces": 1.1}}``.

    NB: kept in the row, so that a row compares with its own run's baseline after the
    table took a later run's row of that baseline (each run measures both side by side).
    """
    runs: dict[tuple, dict] = {}
    for r in rows:
        if "error" not in r:
            runs.setdefault(_run_of(r), {})[(r["config"], r["variant"])] = r
    out = []
    for r in rows:
        if "vs" in r or "error" in r:
            out.append(r)
            continue
        measured, vs = runs[_run_of(r)], {}
        for baseline in baselines(r["variant"]):
            other = measured.get((r["config"], baseline))
            if other is None:
                continue
            ratios = {name: _over(r.get(key), other.get(key)) for key, name in MEASURES.items()}
            ratios["memory_without_workspaces"] = _over(_memory_without_workspaces(r),
                                                        _memory_without_workspaces(other))
            ratios = {name: value for name, value in ratios.items() if value is not None}
            if ratios:
                vs[baseline] = ratios
        out.append(dict(r, vs=vs))
    return out


def _ratio_of(row: dict, baseline: str, measure: str) -> float | None:
    return row.get("vs", {}).get(baseline, {}).get(measure)


def ratio(rows, config, variant, baseline, key: str = "ms_median") -> float | None:
    """``variant``'s ``key`` over ``baseline``'s on ``config``, measured in one run; None
    where either is missing."""
    row = _measured(with_ratios(rows)).get((config, variant))
    return None if row is None else _ratio_of(row, baseline, MEASURES[key])


def early_blocks(rows, config: str, variant: str) -> int | None:
    """The early blocks ``variant``'s row on ``config`` records (`early_info`), None if it
    records none (a stock variant, a failed row, a results file from before the field)."""
    row = _measured(rows).get((config, variant))
    return None if row is None else row.get("early_blocks")


def judge_targets(rows) -> list[dict]:
    """The targets met or missed, in `TIME_TARGETS` then memory order, each judged on the
    ratio its row keeps (`with_ratios`: measured side by side in the row's own run).

    A target with an ``early`` condition judges a config by the early blocks
    the variant's own row records; each verdict carries them
    (``early_blocks``), the reason for its limit (``why``) and the row's date.
    """
    rows = with_ratios(rows)
    judged = []
    for target in (*TIME_TARGETS, *memory_targets(rows)):
        for r in rows:
            if ("error" in r or r["variant"] != target.variant
                    or not target.applies(r["config"])):
                continue
            blocks = r.get("early_blocks")
            if not target.applies_to_early(blocks):
                continue
            value = _ratio_of(r, target.baseline, target.measure)
            if value is not None:
                judged.append({"variant": target.variant, "config": r["config"],
                               "vs": target.baseline, "measure": target.measure,
                               "ratio": value, "limit": target.limit,
                               "met": value <= target.limit, "early_blocks": blocks,
                               "why": _why(target, blocks), "date": r.get("date")})
    return judged


def _why(target: Target, blocks: int | None) -> str:
    """The target's reason; for an early-blocks target, prefixed with what the row records."""
    if target.early == "yes":
        found = "early blocks not recorded" if blocks is None else f"{blocks} early block(s)"
        return f"{found}: {target.why}"
    return target.why


# -- the table ------------------------------------------------------------------------


COLUMNS = ("config", "variant", "date", "run", "ms median", "min", "max", "vs inductor+graph",
           "vs reduce-overhead", "vs stock", "TFLOP/s", "peak MiB", "step peak MiB", "kept MiB",
           "step memory MiB", "memory vs stock", "compile s", "grad max rel err vs eager",
           "notes")
INTRO = """\
Written by `python -m bench.run` (on the GPU, `bash bench/device_run.sh <part>`): a run
replaces the rows of the configs and variants it measured (on the same GPU and CUDA
allocator) and leaves the others; `git log -p bench/results/step.md` shows what each run
changed. One training step (forward, backward, and Adam's update in +adam rows), tf32 on;
median, min and max over the run's trials of the mean step time (CUDA events). Ratios
(the vs columns and the targets) are between rows measured side by side in one run, and a
row keeps them when a later run replaces its baseline's row.

Memory: peak = `max_memory_allocated` over the timed steps; step peak = that minus what was
allocated before them; kept = what the compiled program holds between steps (graph pools,
static buffers) beyond the model's parameters, buffers, grads and optimizer state (cuBLAS
workspaces of the streams it uses included, cleared before each row; notes give their
share); step memory = kept + step peak (judged). vs stock: ratio to each stock variant the
row is compared with."""


def _run(row: dict) -> Run:
    machine = (f"{row.get('gpu')}, torch {row.get('torch')}, {row.get('allocator') or 'native'}"
               f" allocator, {row.get('trials')} trials of {row.get('steps_per_trial')} steps")
    return Run(row.get("date") or "-", machine, row.get("command") or "-")


def markdown(rows: list[dict], targets: list[dict]) -> str:
    """The table's Markdown: a line per row, the targets judged, the runs they come from."""
    rows = with_ratios(rows)
    numbers = numbered(_run(r) for r in rows)
    lines = ["# bench.run: the current rows", "", INTRO, "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        # NB: a row under another CUDA allocator is a row of its own (`KEY`): say so
        allocator = r.get("allocator") or "native"
        variant = r["variant"] + ("" if allocator == "native" else f" ({allocator})")
        when = [r["config"], variant, r.get("date") or "-", str(numbers[_run(r)])]
        if "error" in r:
            cells = [*when, *["-"] * (len(COLUMNS) - 5), f"failed: {r['error'][:200]}"]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        err = r.get("grad_max_rel_err")
        err_text = "-" if err is None else f"{err:.1e}" + (" (random)" if r.get("grad_random")
                                                           else "")
        cells = [
            *when, f"{r['ms_median']:.3f}", f"{r['ms_min']:.3f}", f"{r['ms_max']:.3f}",
            _x(_ratio_of(r, "inductor+graph", "time")),
            _x(_ratio_of(r, "reduce-overhead", "time")),
            _vs_stock(r, "time"), _tflops(r.get("tflops")).strip(),
            _mib(r.get("peak_mem_bytes")), _mib(r.get("step_peak_bytes")),
            _mib(r.get("kept_bytes")), _mib(r.get("mem_bytes")), _vs_stock(r, "memory"),
            f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "-", err_text,
            (_notes(r) + _without_workspaces_note(r)).lstrip(", ") or "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Targets (ratios of medians, and of step memory, in each row's run). Erase "
              "against its stock variant: never slower (<= 1.00x) where its compiled program "
              "scheduled early blocks (or its row does not record them), within 1.02x where it "
              "has none and is stock Inductor; the `why` column says which limit applies and "
              "why:", "",
              "| variant | config | against | measure | ratio | target | | why | date |",
              "|---|---|---|---|---|---|---|---|---|"]
    for t in targets:
        lines.append(f"| {t['variant']} | {t['config']} | {t['vs']} | "
                     f"{t.get('measure', 'time')} | {t['ratio']:.2f} | <= {t['limit']:.2f} | "
                     f"{'met' if t['met'] else 'MISSED'} | {t.get('why') or '-'} | "
                     f"{t.get('date') or '-'} |")
    runs = sorted(numbers.items(), key=lambda item: item[1])
    lines += ["", "Runs (the `run` column):", "", *(run.line(n) for run, n in runs)]
    return "\n".join(lines) + "\n"


def _vs_stock(r: dict, measure: str) -> str:
    """``r``'s ratios (``time``, ``memory``, ``memory_without_workspaces``) to each stock
    variant it kept one for: "0.90x inductor+step", "-" where there is none."""
    try:
        stock = Variant.parse(r["variant"]).stock()
    except ValueError:
        return "-"
    parts = [f"{value:.2f}x {s}" for s in stock
             if (value := _ratio_of(r, s, measure)) is not None]
    return "; ".join(parts) or "-"


def _memory_without_workspaces(row: dict) -> float | None:
    """Step memory less the row's cuBLAS workspaces; None where the row does not give them.

    NB: a workspace (about 33 MiB on an H200) per stream that runs a matrix
    product is a constant that does not grow with the model: on small configs
    it can be most of what erase's side streams add. The targets judge the
    whole figure; the notes say how much of a ratio is that constant.
    """
    if row.get("workspace_bytes") and row.get("mem_bytes") is not None:
        return row["mem_bytes"] - row["workspace_bytes"]
    return None


def _without_workspaces_note(r: dict) -> str:
    ratios = _vs_stock(r, "memory_without_workspaces")
    return "" if ratios == "-" else f", memory without cuBLAS workspaces {ratios}"


def _notes(r: dict) -> str:
    text = ""
    if r.get("early_blocks") is not None:
        text += f", early blocks {r['early_blocks']} in {r.get('erase_graphs')} graph(s)"
    if r.get("erase_fallback"):
        text += f", stock path: {str(r['erase_fallback'])[:120].replace('|', '/')}"
    if r.get("workspace_bytes"):
        text += f", kept has {_mib(r['workspace_bytes'])} MiB of cuBLAS workspaces"
    if "captures" in r:
        text += f", captures {r.get('captures')}, replays {r.get('replays')}"
    if r.get("early_updated") is not None:
        refused = describe_refusals(r.get("early_refused") or {})
        text += (f", {r['early_updated']} parameters updated early"
                 + (f" (not early: {refused[:160]})" if refused else ""))
    if r.get("uncaptured_reason"):
        text += f", not captured: {str(r['uncaptured_reason'])[:160]}"
    if r.get("capture_trials"):
        text += f", {r['capture_chosen']} chosen of {r['capture_trials']}"
    return text.replace("|", "/")


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _tflops(value: float | None) -> str:
    return "     -" if value is None else f"{value:6.1f}"


def variants_for(config: str, variants: list[str], args) -> list[str]:
    """The rows of a config: the asked-for variants, plus the sweep's controls on sweep configs."""
    if config not in args.sweep_configs.split(","):
        return list(variants)
    sweep = []
    if "erase+graphs" in variants:
        sweep += [f"erase+graphs/streams={n}" for n in args.streams.split(",") if n]
    sweep += [f"{form}/one-stream" for form in ONE_STREAM_FORMS if form in variants]
    return [*variants, *(v for v in sweep if v not in variants)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated; kind:B:d:h:K with kind one of ctr, mlp (detached "
                             "chains), ctr-towers, mlp-towers (towers over a shared front), "
                             "ctr-towers-top, mlp-towers-top (and a top head over the detached "
                             "towers); gpt:B:d:T:K (detached transformer blocks, local LM "
                             "heads; gpt-soft: on label-smoothed targets made in the "
                             "forward); tv-<name>:B:image (torchvision models: "
                             f"{', '.join(VISION_CONFIGS)}); pattern-<name>:B[:width[:depth]] "
                             "(user code's patterns, bench.user_patterns: "
                             f"{', '.join(PATTERN_CONFIGS)}). Default: the five chains")
    parser.add_argument("--variants", default=",".join((*VARIANTS, *ADAM_VARIANTS)),
                        help="comma-separated variant names (bench.harness's grammar: "
                             "compiler[+capture][+adam][/control])")
    parser.add_argument("--streams", default="1,2,8",
                        help="extra erase+graphs rows with these side-stream counts ('' for "
                        "none); the sweep configs also get /one-stream rows of erase+graphs, "
                        "erase+step-graph and erase+step (those asked for)")
    parser.add_argument("--sweep-configs", default=",".join(CONFIGS[:4]),
                        help="configs that get the stream-count and one-stream rows ('' for "
                        "none)")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--steps-per-trial", type=int, default=20)
    parser.add_argument("--out", type=Path, default=TABLE,
                        help="the table to update (default bench/results/step.json; the "
                        "Markdown beside it)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new row after this many seconds (a device call has a "
                        "time limit); the table is rewritten after every row, so what ran is "
                        "kept either way")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="no run: take the rows of these results files (tables, or one "
                        "run's file), in order, into --out as if each had just run")
    parser.add_argument("--smoke", action="store_true",
                        help="on the CPU, every variant compiled with aot_eager inside, timed "
                        "by the CPU clock, no memory figures: a check that a run goes through "
                        "(use tiny configs; exit status 1 if a row failed); --out must name a "
                        "table outside bench/results")
    parser.add_argument("--explain", action="store_true",
                        help="no run: the early blocks erase_fx.explain finds in each config, "
                        "built on the CPU at its size, and why the rest stays in the backward")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    try:
        configs = [parse_config(text) for text in args.configs.split(",") if text]
        variants = [canonical(v) for v in args.variants.split(",") if v]
        for name in variants:
            Variant.parse(name)
    except ValueError as error:
        print(f"bench.run: {error}", file=sys.stderr)
        return 2
    if args.explain:
        return explain_configs(configs)
    if args.smoke and args.out.resolve().is_relative_to(RESULTS.resolve()):
        print(f"bench.run: --smoke writes no table in {RESULTS}: name another with --out",
              file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("bench.run needs a CUDA GPU (--smoke: a check on the CPU)", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    run = this_run("bench.run", argv, machine_text="")
    meta = {"date": run.date, "command": run.command,
            "gpu": "CPU (--smoke)" if args.smoke else torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "allocator": "native" if args.smoke else allocator_backend(),
            "trials": args.trials, "steps_per_trial": args.steps_per_trial}
    print(f"torch {meta['torch']} on {meta['gpu']}, CUDA allocator {meta['allocator']}",
          flush=True)
    table = load(args.out) if args.out.exists() else []
    start = time.perf_counter()

    def out_of_time() -> bool:
        return args.budget_s is not None and time.perf_counter() - start > args.budget_s

    rows = []
    for cfg in configs:
        names = variants_for(str(cfg), variants, args)
        print(f"{cfg}: {len(names)} variants", flush=True)
        # NB: written after every row, so a run killed mid-config keeps what it measured
        done = list(rows)
        rows += run_config(cfg, names, args, out_of_time,
                           on_row=lambda new: write(
                               args.out, merge_table(table, stamped(done + new, meta)),
                               quiet=True))
    write(args.out, merge_table(table, stamped(rows, meta)))
    failed = [f"{r['config']} {r['variant']}" for r in rows if "error" in r]
    if args.smoke and failed:
        print(f"bench.run --smoke: {len(failed)} row(s) failed: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


def explain_configs(configs) -> int:
    """``--explain``: for each config, built on the CPU at its size, what `erase_fx.explain`
    finds (aot_eager inside: the blocks found do not depend on the code generated): every
    graph's report, then a line per config."""
    from erase_fx.report_text import format_reports, format_table

    lines, details = [], []
    for cfg in configs:
        torch._dynamo.reset()
        torch.manual_seed(0)
        try:
            model, inputs, _ = build_with_loss(cfg, torch.device("cpu"),
                                               torch.Generator().manual_seed(0))
            reports = erase_fx.explain(model, *inputs)
        except Exception as error:  # noqa: BLE001 - one config's failure is its line
            message = f"{type(error).__name__}: {error}".splitlines()[0][:160]
            lines.append([str(cfg), "-", "-", "-", f"not explained: {message}"])
            print(f"{cfg}: {lines[-1][-1]}", file=sys.stderr, flush=True)
            continue
        summary = explained(reports)
        lines.append([str(cfg), summary["graphs"], summary["early_blocks"],
                      f"{summary['early_share']:.0%}", summary["left"] or "-"])
        details += [f"== {cfg}", format_reports(reports), ""]
        print(f"{cfg}: {summary['early_blocks']} early block(s) in {summary['graphs']} "
              "graph(s)", file=sys.stderr, flush=True)
    print("\n".join(details))
    print("\n".join(format_table(("config", "graphs", "early blocks", "early share",
                                  "left in the backward (reason x components)"), lines)))
    return 0


def explained(reports) -> dict:
    """What a config's reports say: graphs, early blocks, the early share of the backward's
    FLOPs, and the reasons (with counts) of what stays in the backward."""
    backward = sum(r.backward_flops for r in reports)
    reasons: dict[str, int] = {}
    for report in reports:
        for rejected in report.rejected:
            reasons[rejected.reason] = reasons.get(rejected.reason, 0) + 1
        if report.fallback_reason and report.fallback_reason != "no early block":
            key = f"stock path: {report.fallback_reason[:80]}"
            reasons[key] = reasons.get(key, 0) + 1
    return {"graphs": len(reports), "early_blocks": sum(len(r.blocks) for r in reports),
            "early_share": sum(r.early_flops for r in reports) / backward if backward else 0.0,
            "left": ", ".join(f"{reason} x{n}" for reason, n in sorted(reasons.items()))}


def stamped(rows: list[dict], meta: dict) -> list[dict]:
    """One run's rows as table rows: each with its run's fields (`RUN_FIELDS`, from the
    run's ``meta``; files before 2026-12-02 ran the native allocator and do not say so),
    its variant's current name, and its ratios (`with_ratios`)."""
    fields = {field: meta.get(field) for field in RUN_FIELDS}
    fields["allocator"] = fields["allocator"] or "native"
    return with_ratios([{**row, **fields, "variant": canonical(row["variant"])}
                        for row in rows])


def merge_table(table: list[dict], rows: list[dict]) -> list[dict]:
    """``table`` with each row that has the `KEY` of one of ``rows`` replaced by it, the
    others added, in the table's order (`order`)."""
    merged = merge_rows([(r, None) for r in table], [(r, None) for r in rows], KEY)
    return sorted((row for row, _ in merged), key=order)


#: Config families in the table's order; the configs of `CONFIGS` and `GPT_CONFIGS` first.
FAMILIES = ("ctr", "mlp", "ctr-towers", "mlp-towers", "ctr-towers-top", "mlp-towers-top",
            "gpt", "gpt-soft", "tv", "pattern")


def order(row: dict) -> tuple:
    """Where a row goes in the table: by config (the default configs first, then by family),
    then by variant (`VARIANTS` order of the form before any control, then the control)."""
    config, variant = row["config"], row["variant"]
    known = (*CONFIGS, *GPT_CONFIGS)
    family = config.split(":")[0]
    family = "tv" if family.startswith("tv-") else family
    family = "pattern" if family.startswith("pattern-") else family
    where = (known.index(config),) if config in known else (
        len(known), FAMILIES.index(family) if family in FAMILIES else len(FAMILIES), config)
    form, _, control = variant.partition("/")
    forms = (*VARIANTS, *ADAM_VARIANTS)
    return (*where, forms.index(form) if form in forms else len(forms), form, control,
            row.get("gpu") or "", row.get("allocator") or "")


def load(path: Path) -> list[dict]:
    """The rows of a table, or of one run's results file (``{"meta", "rows"}``, as bench.run
    wrote before the table), stamped with that run."""
    data = json.loads(path.read_text())
    if "meta" in data:
        return stamped(data["rows"], data["meta"])
    return with_ratios([dict(row, variant=canonical(row["variant"])) for row in data["rows"]])


def write(out: Path, rows: list[dict], quiet: bool = False) -> None:
    targets = judge_targets(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "targets": targets}, indent=1) + "\n")
    table = markdown(rows, targets)
    out.with_suffix(".md").write_text(table)
    if not quiet:
        print(f"wrote {out} and {out.with_suffix('.md')} ({len(rows)} rows)")


def merge(parts: list[Path], out: Path) -> int:
    """Take the rows of ``parts``, in order, into the table ``out`` (each part's rows
    replace those with their key, as a run's would)."""
    table = load(out) if out.exists() else []
    for part in parts:
        table = merge_table(table, load(part))
    write(out, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
