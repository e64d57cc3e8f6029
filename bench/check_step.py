"""GPU checks of `erase_fx.compile_step` (one graph for the step): ``python -m bench.check_step``.

One process, a few minutes on an H200 (small models, few compiles). Each
check prints a PASS/FAIL line; a summary table comes last; the exit status
is 1 if any check failed. The checks and step times update the current
table, ``bench/results/check_step.md`` (``--out``; `bench.tables`): a check
run again replaces its row, the others stay with their date and command.
Every training run below is the same step: two models (a detached MLP chain
with BatchNorm, and `bench.models.DetachedChain`),
gradient accumulation over two micro-batches, one optimizer per model,
``zero_grad(set_to_none=True)`` at the top.

1. exactness: compile_step over ``backend="erase"`` (inner ``aot_eager``,
   ``on_error="raise"``) trains exactly like eager, for SGD (momentum) and
   Adam(capturable=True): parameters, optimizer state and BatchNorm buffers
   bitwise equal after the steps;
2. erase with Inductor inside compile_step stays within 2x (+1e-6) of the
   distance stock torch.compile (Inductor) has from eager over the same steps
   (parameters and buffers; optimizer state), Adam(capturable=True);
3. stock torch.compile inside compile_step against stock torch.compile
   outside, and erase with Inductor inside against the same outside (its own
   CUDA graphs on): what compile_step itself changes (within 1e-6);
4. a host sync (``.item()``) inside the step: the capture fails, the step
   falls back and trains exactly like eager; the CUDA context, streams and
   later captures still work; ``on_unsupported="raise"`` raises
   `StepCaptureError`; Adam without ``capturable`` falls back naming the fix;
5. dropout: every replay draws a fresh mask, dropping a fraction ~p;
6. a float lr changed between steps recaptures (and trains like eager); a
   tensor lr with capturable Adam, changed with ``fill_``, does not;
7. step times (CUDA events) of a few variants, and the CPU cost of the
   guards checked before each replay;
8. ``early_optimizer=True`` (one micro-batch, so that the early blocks'
   parameters qualify): compile_step over erase with ``aot_eager`` trains
   exactly like eager, and over erase with Inductor exactly like the same
   step without early updates, bit for bit over many steps (a race between
   an update on a side stream and a reader elsewhere would show as a
   difference), with parameters updated early;
9. ``early-optimizer-conv`` (torchvision, not in the default list): the same
   Inductor check on a conv net, DGL ResNet-18 (`bench.vision`, batch 32,
   32x32, deterministic cuDNN), where Inductor works channels-last: every
   planned parameter updated early (none refused because autograd copied a
   gradient of another layout), bitwise equal to the step without early
   updates; where it differs, the first step's gradients and each variant
   run twice say why;
10. ``determinism-conv`` (torchvision, not in the default list): stock
   Inductor, erase on one stream, erase, and erase with early updates, each
   trained twice on DGL ResNet-18 in deterministic mode: bitwise equal (a
   race between streams varies from run to run);
11. ``determinism-gpt`` (not in the default list: minutes with ``--steps 400``,
   2,000 steps): erase on gpt:16:384:256:8, whose side streams write each
   block's logits gradient over its logits (`Tuning.keep_inplace_writes`),
   trained twice, once with every segment on the main stream
   (``overlap=False``: the same kernels) and once with its side streams folded
   onto 2 CUDA streams (``side_cuda_streams=2``: blocks sharing a stream reuse
   each other's memory under capture), math attention, deterministic mode:
   all bitwise equal;
12. ``release-lag`` (torchvision, not in the default list): erase with
   ``release_lag="auto"`` and ``side_cuda_streams="auto"`` on a small DGL ViT
   (stages on the main stream, so the lag matters; three side streams, so
   folding onto two does): compile_step times each candidate and keeps one
   within the steps given, leaves one graph pool, and trains bitwise as the
   defaults do, in deterministic mode;
13. ``record-stream`` (not in the default list; needs
   ``PYTORCH_ALLOC_CONF=graph_capture_record_stream_reuse:True``): erase on
   gpt:16:384:256:8 with ``release_lag="record_stream"`` (issue 39's
   candidate: every value dropped after its last reader, marked with
   ``record_stream``, the allocator ordering its reuse during capture), with
   each block's stage on the main stream (its activations cross to the side
   stream) and with the side streams folded onto 2 CUDA streams: each trained
   bitwise as release_lag None trains, in deterministic mode.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

# NB: deterministic cuBLAS needs a fixed workspace, set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import erase_fx  # noqa: E402
from bench.harness import deterministic_algorithms  # noqa: E402
from bench.models import ChainConfig, DetachedChain  # noqa: E402
from bench.tables import RESULTS, by_check, this_run, update_table  # noqa: E402

WARMUP = 2
CHAIN = ChainConfig.parse("mlp:64:128:256:3")


class BNChain(nn.Module):
    """A front layer, then detached stages Linear-BatchNorm-ReLU(-Dropout)-Linear, local heads."""

    def __init__(self, d: int = 96, h: int = 192, stages: int = 3, p: float = 0.0):
        super().__init__()
        self.front = nn.Linear(784, d)
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(p),
                          nn.Linear(h, d))
            for _ in range(stages))
        self.heads = nn.ModuleList(nn.Linear(d, 10) for _ in range(stages))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.front(x)
        loss = None
        for stage, head in zip(self.stages, self.heads):
            h = stage(h)
            local = F.cross_entropy(head(h), y)
            loss = local if loss is None else loss + local
            h = h.detach()
        return loss


def base_models(device):
    torch.manual_seed(0)
    return [BNChain().to(device), DetachedChain(CHAIN).to(device)]


def make_batches(n, device, batch=64, seed=1):
    g = torch.Generator(device=device).manual_seed(seed)
    return [(torch.randn(batch, 784, device=device, generator=g),
             torch.randint(0, 10, (batch,), device=device, generator=g)) for _ in range(n)]


def make_optimizers(models, kind, device, lr=None):
    if kind == "sgd":
        return [torch.optim.SGD(m.parameters(), lr=lr or 0.05, momentum=0.9) for m in models]
    if kind == "adam":
        return [torch.optim.Adam(m.parameters(), lr=lr or 1e-3, capturable=True) for m in models]
    if kind == "adam-tensor-lr":
        return [torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-3, device=device),
                                 capturable=True) for m in models]
    if kind == "adam-not-capturable":
        return [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
    raise ValueError(kind)


def wrap(models, variant):
    if variant == "eager":
        return list(models)
    if variant == "stock":
        return [torch.compile(m) for m in models]
    inner = {"erase-aot": "aot_eager", "erase-inductor": "inductor",
             "erase-inductor-nographs": "inductor"}[variant]
    options = {"inner": inner, "on_error": "raise"}
    if variant.endswith("-nographs"):
        options["cudagraphs"] = False
    return [torch.compile(m, backend="erase", options=options) for m in models]


def make_step(optimizers, forwards, micro=2, sync=False):
    """One training step: zero, two micro-batches through every model, one optimizer step each."""
    def train_step(x, y):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=x.device)
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            for fn in forwards:
                loss = fn(xs, ys)
                loss.backward()
                total = total + loss.detach()
        for opt in optimizers:
            opt.step()
        return total.item() if sync else total  # NB: .item() is a host sync
    return train_step


def snapshot(models, optimizers):
    """Every parameter, buffer and optimizer state tensor, cloned, with a name."""
    out = []
    for i, (m, o) in enumerate(zip(models, optimizers)):
        out += [(f"model{i}.{k}", v.detach().clone()) for k, v in m.state_dict().items()]
        for j, p in enumerate(m.parameters()):
            for key, value in o.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out.append((f"model{i}.opt.param{j}.{key}", value.detach().clone()))
    return out


def exact(a, b):
    """Names of the tensors that differ (empty: bitwise equal)."""
    return [name for (name, x), (_, y) in zip(a, b) if not torch.equal(x, y)]


def distance(a, b, state=None):
    """Relative difference over all floating-point tensors: ||a - b|| / ||a||, all joined.

    NB: joined, not the largest per tensor: a near-zero tensor (the Adam moment of a
    bias whose gradients cancel) would make any rounding look like 100%. ``state``:
    True for optimizer state only, False for parameters and buffers only.
    """
    diff = norm = 0.0
    for (name, x), (_, y) in zip(a, b):
        if x.is_floating_point() and (state is None or (".opt." in name) == state):
            x, y = x.double(), y.double()
            diff += (x - y).square().sum().item()
            norm += x.square().sum().item()
    return (diff / max(norm, 1e-300)) ** 0.5


def largest(a, b, n=3):
    """The names of the ``n`` tensors differing most (||a - b|| / ||a||), for diagnosis."""
    rel = [(((x.double() - y.double()).norm() / x.double().norm().clamp_min(1e-30)).item(), name)
           for (name, x), (_, y) in zip(a, b) if x.is_floating_point()]
    return ", ".join(f"{name} {r:.1e}" for r, name in sorted(rel, reverse=True)[:n])


def train(variant, kind, batches, device, captured, lr_change=None, sync=False, micro=2,
          **step_options):
    """Fresh copies of the base models trained over ``batches``; (snapshot, step, models, opts)."""
    torch._dynamo.reset()
    models = [copy.deepcopy(m) for m in base_models(device)]
    opts = make_optimizers(models, kind, device)
    fn = make_step(opts, wrap(models, variant), micro=micro, sync=sync)
    step = erase_fx.compile_step(fn, warmup=WARMUP, **step_options) if captured else fn
    for i, (x, y) in enumerate(batches):
        if lr_change is not None and i == lr_change[0]:
            for opt in opts:
                for group in opt.param_groups:
                    if isinstance(group["lr"], torch.Tensor):
                        group["lr"].fill_(lr_change[1])
                    else:
                        group["lr"] = lr_change[1]
        step(x, y)
    torch.cuda.synchronize()
    return snapshot(models, opts), step, models, opts


class Report:
    def __init__(self):
        self.rows = []

    def check(self, name, ok, detail=""):
        self.rows.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return ok

    def crashed(self, name):
        detail = traceback.format_exc(limit=4).strip().splitlines()[-1]
        traceback.print_exc()
        self.check(name, False, f"raised {detail}")

    @property
    def failed(self):
        return [r for r in self.rows if not r[1]]


def counts(step):
    return (f"captures {step.captures}, replays {step.replays}, warm-ups {step.warmups}, "
            f"uncaptured_reason {step.uncaptured_reason!r}")


def captured_as_expected(step, steps, captures=1):
    return (step.captures == captures and step.uncaptured_reason is None
            and step.replays == steps - captures * WARMUP)


# -- the checks ------------------------------------------------------------------


def check_exactness(report, device, steps):
    batches = make_batches(steps, device)
    # NB: cuDNN's BatchNorm rounds differently from the native kernel that AOT graphs call;
    # off, eager runs the same kernel, so any difference is compile_step's.
    torch.backends.cudnn.enabled = False
    try:
        for kind in ("sgd", "adam"):
            want, *_ = train("eager", kind, batches, device, captured=False)
            got, step, *_ = train("erase-aot", kind, batches, device, captured=True)
            differ = exact(want, got)
            report.check(f"exact: compile_step(erase, aot_eager) vs eager, {kind}",
                         not differ and captured_as_expected(step, steps),
                         f"{len(want)} tensors, {len(differ)} differ "
                         f"{differ[:3]} (rel {distance(want, got):.1e}); {counts(step)}")
    finally:
        torch.backends.cudnn.enabled = True


def check_inductor(report, device, steps, timings):
    batches = make_batches(steps, device, seed=2)
    want, *_ = train("eager", "adam", batches, device, captured=False)
    stock_out, stock_step, *_ = train("stock", "adam", batches, device, captured=False)
    timings.append(("stock torch.compile", False, time_step(stock_step, batches, device)))
    stock_in, stock_cap, *_ = train("stock", "adam", batches, device, captured=True)
    stock_counts, stock_ok = counts(stock_cap), captured_as_expected(stock_cap, steps)
    timings.append(("stock torch.compile", True, time_step(stock_cap, batches, device)))
    erase_out, erase_step, *_ = train("erase-inductor", "adam", batches, device, captured=False)
    timings.append(("erase (inductor, its own graphs)", False,
                    time_step(erase_step, batches, device)))
    erase_in, erase_cap, models, opts = train("erase-inductor", "adam", batches, device,
                                              captured=True)
    erase_counts, erase_ok = counts(erase_cap), captured_as_expected(erase_cap, steps)
    timings.append(("erase (inductor)", True, time_step(erase_cap, batches, device)))
    details, ok = [], erase_ok
    for what, state in (("parameters and buffers", False), ("optimizer state", True)):
        d_stock, d_erase = distance(want, stock_out, state), distance(want, erase_in, state)
        limit = 2 * d_stock + 1e-6
        ok = ok and d_erase <= limit
        details.append(f"{what}: erase {d_erase:.2e}, stock {d_stock:.2e}, limit {limit:.2e}")
    if not ok:
        # NB: diagnosis: which tensors, and whether erase outside compile_step gives the
        # same numbers twice (a difference there is nondeterminism, not compile_step)
        again, *_ = train("erase-inductor", "adam", batches, device, captured=False)
        details.append(f"differing most: erase {largest(want, erase_in)}; "
                       f"stock {largest(want, stock_out)}; erase outside, run twice: rel "
                       f"{distance(erase_out, again):.2e}")
    report.check("inductor: compile_step(erase, inductor) vs eager within 2x stock's distance",
                 ok, f"{'; '.join(details)}; {erase_counts}")
    # NB: inside compile_step erase's own graphs step aside: the same program outside is
    # erase with cudagraphs off; with them on (the default) it is captured in pieces
    plain_out, *_ = train("erase-inductor-nographs", "adam", batches, device, captured=False)
    plain_again, *_ = train("erase-inductor-nographs", "adam", batches, device, captured=False)
    report.check("erase outside compile_step, graphs off, run twice: the same numbers",
                 not exact(plain_out, plain_again), f"rel {distance(plain_out, plain_again):.2e}")
    print(f"erase outside, graphs on vs off: {len(exact(erase_out, plain_out))} of "
          f"{len(erase_out)} tensors differ, rel {distance(erase_out, plain_out):.2e}", flush=True)
    for name, outside, inside, tail in (
            ("stock: compile_step(torch.compile) vs torch.compile outside", stock_out,
             stock_in, stock_counts),
            ("erase: compile_step(erase, inductor) vs the same erase outside (graphs off)",
             plain_out, erase_in, erase_counts)):
        differ, d_in = exact(outside, inside), distance(outside, inside)
        report.check(name, d_in <= 1e-6 and (stock_ok if "stock" in name else erase_ok),
                     f"{len(differ)} of {len(outside)} tensors differ, rel {d_in:.2e} "
                     f"(limit 1e-6); {tail}")
    entry = next(iter(erase_cap._entries.values()))
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        entry.guards.check()
    guard_us = (time.perf_counter() - start) / n * 1e6
    params = sum(1 for m in models for _ in m.parameters())
    timings.append((f"guards before a replay ({params} parameters, Adam): {guard_us:.1f} us",
                    None, None))


def check_failed_capture(report, device, steps):
    batches = make_batches(steps, device, seed=3)
    want, *_ = train("eager", "sgd", batches, device, captured=False, sync=True)
    got, step, *_ = train("eager", "sgd", batches, device, captured=True, sync=True)
    reason = step.uncaptured_reason or ""
    differ = exact(want, got)
    report.check("failed capture (.item() in the step) falls back, trains like eager",
                 not differ and step.captures == 0 and ".item()" in reason and "Fix:" in reason,
                 f"{len(differ)} tensors differ; {counts(step)}")
    current = torch.cuda.current_stream()
    ok = (current == torch.cuda.default_stream() and not torch.cuda.is_current_stream_capturing())
    torch.ones(1, device=device).add_(1)
    torch.cuda.synchronize()
    report.check("after a failed capture the stream and context are as before", ok,
                 f"current stream {current}")
    # "raise": the call raises and trains nothing; training can go on uncaptured
    torch._dynamo.reset()
    models = [copy.deepcopy(m) for m in base_models(device)]
    opts = make_optimizers(models, "sgd", device)
    fn = make_step(opts, models, sync=True)
    step = erase_fx.compile_step(fn, warmup=1, on_unsupported="raise")
    step(*batches[0])
    before = snapshot(models, opts)
    try:
        step(*batches[1])
        raised = None
    except erase_fx.StepCaptureError as error:
        raised = error
    after = snapshot(models, opts)
    report.check('on_unsupported="raise" raises StepCaptureError, state untouched',
                 raised is not None and not exact(before, after) and "Fix:" in str(raised),
                 f"{str(raised)[:160]!r}")
    got, step, *_ = train("eager", "adam-not-capturable", batches, device, captured=True)
    want, *_ = train("eager", "adam-not-capturable", batches, device, captured=False)
    reason = step.uncaptured_reason or ""
    report.check("Adam without capturable falls back, naming capturable=True",
                 step.captures == 0 and "capturable=True" in reason and not exact(want, got),
                 f"{counts(step)}")


def check_dropout(report, device, steps, p=0.3):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU()).to(device)
    head = nn.Linear(512, 10).to(device)
    opt = torch.optim.SGD(list(model.parameters()) + list(head.parameters()), lr=0.05)

    def train_step(x, y):
        opt.zero_grad(set_to_none=True)
        h = model(x)
        dropped = F.dropout(h, p, training=True)
        loss = F.cross_entropy(head(dropped), y)
        loss.backward()
        opt.step()
        return loss, (dropped == 0) & (h != 0), h != 0

    step = erase_fx.compile_step(train_step, warmup=WARMUP)
    masks, fractions = [], []
    for x, y in make_batches(steps, device, batch=256, seed=4):
        _, mask, alive = step(x, y)
        if step.replays:
            masks.append(mask)
            fractions.append((mask.sum() / alive.sum()).item())
    distinct = all(not torch.equal(a, b) for i, a in enumerate(masks) for b in masks[i + 1:])
    ok = (distinct and len(masks) >= 2 and all(abs(f - p) < 0.02 for f in fractions)
          and step.uncaptured_reason is None)
    report.check("dropout: a fresh mask at every replay, dropping ~p",
                 ok, f"{len(masks)} replays, masks all distinct: {distinct}, dropped "
                 f"{', '.join(f'{f:.3f}' for f in fractions)} (p={p}); {counts(step)}")


def check_lr(report, device, steps):
    batches = make_batches(steps + 3, device, seed=5)
    change = (WARMUP + 2, 0.01)  # after the capture and one replay
    want, *_ = train("eager", "sgd", batches, device, captured=False, lr_change=change)
    got, step, *_ = train("eager", "sgd", batches, device, captured=True, lr_change=change)
    differ = exact(want, got)
    report.check("float lr changed between steps recaptures, trains like eager",
                 step.captures == 2 and not differ and step.uncaptured_reason is None,
                 f"{len(differ)} tensors differ; {counts(step)}")
    change = (WARMUP + 2, 2e-4)
    want, *_ = train("eager", "adam-tensor-lr", batches, device, captured=False,
                     lr_change=change)
    got, step, *_ = train("eager", "adam-tensor-lr", batches, device, captured=True,
                          lr_change=change)
    differ = exact(want, got)
    report.check("tensor lr (capturable Adam, fill_) changed between steps: no recapture",
                 captured_as_expected(step, len(batches)) and not differ,
                 f"{len(differ)} tensors differ; {counts(step)}")


def time_step(step, batches, device, trials=5, per_trial=10):
    """Median ms per call (CUDA events) over the batches, cycled."""
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(per_trial):
            step(*batches[i % len(batches)])
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / per_trial)
    return statistics.median(times)


def check_early_optimizer(report, device, steps):
    batches = make_batches(steps, device, seed=7)
    torch.backends.cudnn.enabled = False  # NB: as in check_exactness: eager's BatchNorm kernel
    try:
        for kind in ("sgd", "adam"):
            want, *_ = train("eager", kind, batches, device, captured=False, micro=1)
            got, step, *_ = train("erase-aot", kind, batches, device, captured=True, micro=1,
                                  early_optimizer=True)
            differ = exact(want, got)
            report.check(f"early optimizer: compile_step(erase, aot_eager) vs eager, {kind}",
                         not differ and captured_as_expected(step, steps)
                         and step.early_updated > 0,
                         f"{len(differ)} of {len(want)} tensors differ {differ[:3]}; "
                         f"{step.early_updated} parameters updated early, not early: "
                         f"{step.early_refused}; {counts(step)}")
    finally:
        torch.backends.cudnn.enabled = True
    many = make_batches(steps * 10, device, seed=8)
    want, late, *_ = train("erase-inductor", "adam", many, device, captured=True, micro=1)
    got, step, *_ = train("erase-inductor", "adam", many, device, captured=True, micro=1,
                          early_optimizer=True)
    differ = exact(want, got)
    detail = (f"{len(differ)} of {len(want)} tensors differ {differ[:3]} (rel "
              f"{distance(want, got):.1e}); {step.early_updated} parameters updated early, "
              f"not early: {step.early_refused}; {counts(step)}")
    if differ:
        # NB: diagnosis: a race varies from run to run, a wrong order or value does not
        again, *_ = train("erase-inductor", "adam", many, device, captured=True, micro=1,
                          early_optimizer=True)
        detail += (f"; early updates run twice: {len(exact(got, again))} tensors differ "
                   f"between the runs (largest: {largest(got, again)})")
    report.check(f"early optimizer: compile_step(erase, inductor), {len(many)} steps, against "
                 "the same without early updates",
                 not differ and step.early_updated > 0 and late.early_updated == 0, detail)


def config_batches(config, device, steps):
    """``(base model, batches)`` of a torchvision or gpt config, ``steps * 5`` fresh batches;
    None where torchvision is absent."""
    from bench.models import GPTConfig, build_config, gpt_inputs, parse_config

    cfg = parse_config(config)
    try:
        base, (images, labels) = build_config(cfg, device, torch.Generator(device).manual_seed(0))
    except ImportError:
        return None
    generator = torch.Generator(device).manual_seed(9)
    if isinstance(cfg, GPTConfig):
        return base, [gpt_inputs(cfg, device, generator) for _ in range(steps * 5)]
    batches = [(torch.randn(images.shape, device=device, generator=generator),
                torch.randint(0, int(labels.max()) + 1, labels.shape, device=device,
                              generator=generator)) for _ in range(steps * 5)]
    return base, batches


def train_in_step(base, batches, backend="erase", options=None, **step_options):
    """A fresh copy of ``base`` trained over ``batches`` with Adam in `compile_step`,
    deterministic cuDNN and attention: (snapshot, step, the first step's gradients)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch._dynamo.reset()
    model = copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    if backend == "erase":
        compiled = torch.compile(model, backend="erase",
                                 options={"on_error": "raise", **(options or {})})
    else:
        compiled = torch.compile(model)
    train_step = make_step([opt], [compiled], micro=1)
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        step = erase_fx.compile_step(train_step, warmup=WARMUP, **step_options)
        first_grads = None
        # NB: the math attention (matmuls and a softmax): cuDNN's fused attention backward
        # may differ from run to run by itself
        with sdpa_kernel(SDPBackend.MATH):
            for x, y in batches:
                step(x, y)
                if first_grads is None:
                    # NB: the first step's gradients come from the initial parameters
                    # whether updates run early or not: they differ only if the kernels do
                    first_grads = [(name, p.grad.detach().clone())
                                   for name, p in model.named_parameters()
                                   if p.grad is not None]
        torch.cuda.synchronize()
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved
    return snapshot([model], [opt]), step, first_grads


def check_early_optimizer_conv(report, device, steps, config="tv-resnet18-dgl:32:32"):
    loaded = config_batches(config, device, steps)
    if loaded is None:
        report.check(f"early optimizer on {config}", False, "needs torchvision")
        return
    base, batches = loaded
    # NB: the first compile of the process autotunes Inductor's kernels; later compiles of
    # the same kernels reuse its choices. A run compiled first gave other bits than the same
    # step compiled after (its reductions ran in another order: on the H200, 277 of 377
    # tensors differed after 30 Adam steps, while each variant run twice after it was
    # bitwise equal, `determinism-conv`): one throwaway run first.
    train_in_step(base, batches[:2], early_optimizer=False)
    want, late, want_grads = train_in_step(base, batches, early_optimizer=False)
    got, step, got_grads = train_in_step(base, batches, early_optimizer=True)
    differ = exact(want, got)
    detail = (f"{len(differ)} of {len(want)} tensors differ {differ[:3]} (rel "
              f"{distance(want, got):.1e}); {step.early_updated} parameters updated early, "
              f"not early: {step.early_refused}; {counts(step)}")
    if differ:
        # NB: diagnosis. The first step's gradients precede any update; a baseline that
        # differs from itself makes the comparison say nothing; a race varies between
        # two early runs, a wrong order or value does not.
        again, *_ = train_in_step(base, batches, early_optimizer=False)
        early_again, *_ = train_in_step(base, batches, early_optimizer=True)
        detail += (f"; first step's gradients: {len(exact(want_grads, got_grads))} of "
                   f"{len(want_grads)} differ (largest: {largest(want_grads, got_grads)}); "
                   f"baseline run twice: {len(exact(want, again))} differ; early run "
                   f"twice: {len(exact(got, early_again))} differ")
    copied = {why: n for why, n in step.early_refused.items() if "copied" in why}
    report.check(f"early optimizer on {config}: compile_step(erase, inductor), {len(batches)} "
                 "steps, against the same without early updates",
                 not differ and step.early_updated > 0 and not copied
                 and late.early_updated == 0, detail)


#: ``determinism-conv``'s variants: (label, backend, erase options, compile_step options).
DETERMINISM_VARIANTS = (
    ("stock Inductor", "inductor", None, {}),
    ("erase, one stream", "erase", {"overlap": False}, {}),
    ("erase", "erase", None, {}),
    ("erase, early optimizer", "erase", None, {"early_optimizer": True}),
)


def check_determinism_conv(report, device, steps, config="tv-resnet18-dgl:32:32"):
    """Each variant trained twice in deterministic mode must give the same bits: a race
    (a stream reading memory another still writes) varies from run to run."""
    loaded = config_batches(config, device, steps)
    if loaded is None:
        report.check(f"determinism on {config}", False, "needs torchvision")
        return
    base, batches = loaded
    for label, backend, options, step_options in DETERMINISM_VARIANTS:
        first = train_in_step(base, batches, backend, options, **step_options)
        second = train_in_step(base, batches, backend, options, **step_options)
        check_bitwise(report, f"{label} on {config}, compile_step, {len(batches)} steps, run "
                      "twice", first, second)


def check_bitwise(report, title, first, other):
    """Report that two `train_in_step` results are bitwise equal: every parameter, buffer and
    optimizer state after training (the first step's gradients say where it began)."""
    (got, step, got_grads), (want, _, want_grads) = first, other
    differ = exact(got, want)
    report.check(f"{title}: bitwise equal", not differ,
                 f"{len(differ)} of {len(got)} tensors differ {differ[:3]} (largest: "
                 f"{largest(got, want)}); first step's gradients: "
                 f"{len(exact(got_grads, want_grads))} differ "
                 f"{exact(got_grads, want_grads)[:3]}; {counts(step)}")


def check_determinism_gpt(report, device, steps, config="gpt:16:384:256:8"):
    """erase on a transformer chain whose side streams write their logits' gradients in place
    (`Tuning.keep_inplace_writes`), in deterministic mode: trained twice, and against the
    same segments and kernels on the main stream alone (``overlap=False``) and on 2 CUDA
    streams (``side_cuda_streams=2``): all bitwise equal. A race (a stream reading memory
    another still writes) varies from run to run."""
    base, batches = config_batches(config, device, steps)
    # NB: deterministic algorithms: the embedding's backward is a scatter-add, whose atomic
    # adds (Inductor's, or aten's) sum in another order on every run (2026-12-02, H200:
    # 318 of 424 tensors differed between two runs without it)
    with deterministic_algorithms():
        # NB: one throwaway compile first: the process's first compile autotunes (see
        # check_early_optimizer_conv)
        train_in_step(base, batches[:2])
        first = train_in_step(base, batches)
        second = train_in_step(base, batches)
        alone = train_in_step(base, batches, options={"overlap": False})
        # NB: the defaults tune, and on gpt:16 keep a CUDA stream per side stream; folded
        # onto 2, two blocks share each stream and reuse each other's memory under capture
        folded = train_in_step(base, batches, options={"tuning": {"side_cuda_streams": 2}})
    for label, other in (("run twice", second), ("against one stream", alone),
                         ("against its side streams folded onto 2 CUDA streams", folded)):
        check_bitwise(report, f"erase on {config}, compile_step, {len(batches)} steps, {label}",
                      first, other)


def check_release_lag(report, device, steps, config="tv-vit-dgl:64:32"):
    """``release_lag="auto"`` and ``side_cuda_streams="auto"``: compile_step captures the step
    once per candidate, times replays of each (real training steps) and keeps one. The result
    must be bitwise what the defaults (held to the join, a CUDA stream per side stream) train,
    in deterministic mode: a lag frees memory sooner and folding shares streams' memory, a
    race would change bits."""
    from erase_fx.capture_tuning import LAGS, TIMED_REPLAYS, WIDTHS, graph_pools

    # NB: enough steps for the warm-ups, every candidate timed and the chosen one captured
    # (compile_step keeps its module hook to the tuning's end: no warm-up in between)
    needed = WARMUP + len(LAGS) * len(WIDTHS) * (TIMED_REPLAYS + 1) + 1 + steps
    loaded = config_batches(config, device, -(-needed // 5))
    if loaded is None:
        report.check(f"release_lag='auto' on {config}", False, "needs torchvision")
        return
    base, batches = loaded
    with deterministic_algorithms():
        train_in_step(base, batches[:2])  # NB: the process's first compile autotunes
        auto = train_in_step(base, batches, options={"tuning": {"release_lag": "auto",
                                                                "side_cuda_streams": "auto"}})
        step = auto[1]
        # NB: only the chosen graph's pool may remain: the candidates' graphs were dropped
        gc.collect()
        torch.cuda.empty_cache()
        pools = graph_pools()
        held = train_in_step(base, batches, options={"tuning": {"release_lag": None,
                                                                "side_cuda_streams": None}})
    tunings = step.capture_tunings
    measured = "; ".join(m.describe() for m in tunings[0].measured) if tunings else "none"
    chosen = [m for m in tunings[0].measured if m.choice == tunings[0].chosen] if tunings else []
    chosen_text = tunings[0].chosen.describe() if tunings else "-"
    report.check(f"release_lag and side_cuda_streams 'auto' on {config}: tuned within "
                 f"{len(batches)} steps, one graph pool left",
                 bool(tunings) and tunings[0].done and not step.tuning and len(pools) == 1,
                 f"chosen {chosen_text} of {measured}; graph pools "
                 f"after: {', '.join(f'{b / 2**20:.0f} MiB' for b in pools.values())} (the "
                 f"choice measured {chosen[0].pool_bytes / 2**20 if chosen else 0:.0f} MiB); "
                 f"{step.tuning_captures} tuning captures; {counts(step)}")
    check_bitwise(report, f"release_lag and side_cuda_streams 'auto' on {config}, "
                  f"compile_step, {len(batches)} steps, against the defaults", auto, held)


def check_record_stream(report, device, steps, config="gpt:16:384:256:8"):
    """``release_lag="record_stream"``: the allocator reuses marked memory during capture once
    the graph orders every marked use before the new allocation; a race would change bits.
    Each layout trained with it and with release_lag None, bitwise equal."""
    from erase_fx.emit.streams import record_stream_reuse_on

    if not record_stream_reuse_on():
        report.check(f"release_lag='record_stream' on {config}", False,
                     "needs PYTORCH_ALLOC_CONF=graph_capture_record_stream_reuse:True")
        return
    base, batches = config_batches(config, device, steps)
    layouts = (("stages on the main stream", {"stages_on_side": False}),
               ("side streams folded onto 2", {"side_cuda_streams": 2}))
    with deterministic_algorithms():
        train_in_step(base, batches[:2])  # NB: the process's first compile autotunes
        for label, tuning in layouts:
            held = train_in_step(base, batches,
                                 options={"tuning": {"release_lag": None, **tuning}})
            marked = train_in_step(base, batches,
                                   options={"tuning": {"release_lag": "record_stream", **tuning}})
            check_bitwise(report, f"release_lag='record_stream' on {config}, {label}, "
                          f"compile_step, {len(batches)} steps, against None", marked, held)


def check_eager_timing(report, device, timings):
    batches = make_batches(4, device, seed=6)
    _, step, *_ = train("eager", "adam", batches, device, captured=False)
    timings.append(("eager", False, time_step(step, batches, device)))
    _, step, *_ = train("eager", "adam", batches, device, captured=True)
    timings.append(("eager", True, time_step(step, batches, device)))


CHECKS = ("exactness", "failed-capture", "dropout", "lr", "inductor", "timing", "early-optimizer")
#: Checks run only when asked for (``--checks``): they need torchvision, or take minutes.
EXTRA_CHECKS = ("early-optimizer-conv", "determinism-conv", "determinism-gpt", "release-lag",
                "record-stream")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=str(RESULTS / "check_step.md"),
                        help="the table to update ('' for none)")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated subset of {','.join(CHECKS + EXTRA_CHECKS)} "
                             "(default: all but the last)")
    args = parser.parse_args(argv)
    chosen = args.checks.split(",")
    unknown = sorted(set(chosen) - set(CHECKS + EXTRA_CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; allowed: {', '.join(CHECKS + EXTRA_CHECKS)}")
    if not torch.cuda.is_available():
        print("FAIL: needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print("torch", torch.__version__, "on", torch.cuda.get_device_name(device), flush=True)
    report, timings = Report(), []
    start = time.perf_counter()
    runs = {
        "exactness": lambda: check_exactness(report, device, args.steps),
        "failed-capture": lambda: check_failed_capture(report, device, args.steps),
        "dropout": lambda: check_dropout(report, device, args.steps),
        "lr": lambda: check_lr(report, device, args.steps),
        "inductor": lambda: check_inductor(report, device, args.steps, timings),
        "timing": lambda: check_eager_timing(report, device, timings),
        "early-optimizer": lambda: check_early_optimizer(report, device, args.steps),
        "early-optimizer-conv": lambda: check_early_optimizer_conv(report, device, args.steps),
        "determinism-conv": lambda: check_determinism_conv(report, device, args.steps),
        "determinism-gpt": lambda: check_determinism_gpt(report, device, args.steps),
        "release-lag": lambda: check_release_lag(report, device, args.steps),
        "record-stream": lambda: check_record_stream(report, device, args.steps),
    }
    for name in chosen:
        check = runs[name]
        t0 = time.perf_counter()
        try:
            check()
        except Exception:  # noqa: BLE001 - report it and go on with the other checks
            report.crashed(name)
        print(f"  ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)

    print("\n| check | result | detail |\n|---|---|---|")
    for name, ok, detail in report.rows:
        print(f"| {name} | {'PASS' if ok else 'FAIL'} | {detail} |")
    print("\n| step (2 models, 2 micro-batches, Adam) | compile_step | ms per step |")
    print("|---|---|---|")
    for name, captured, ms in timings:
        if captured is None:
            print(f"| {name} | | |")
        else:
            print(f"| {name} | {'yes' if captured else 'no'} | {ms:.3f} |")
    failed = report.failed
    print(f"\n{len(report.rows) - len(failed)} passed, {len(failed)} failed "
          f"in {time.perf_counter() - start:.0f} s")
    if args.out:
        write_table(Path(args.out), report, timings, this_run("bench.check_step", argv))
    return 1 if failed else 0


TITLE = "bench.check_step: the latest result of each check"
INTRO = """\
Written by `python -m bench.check_step` (on the GPU, `bash bench/device_run.sh <part>`):
each run replaces the rows of the checks it ran and leaves the others; `git log -p
bench/results/check_step.md` shows what each run changed. A check's name holds what it
ran (model, steps, options); `step:` rows are step times (CUDA events, two models, two
micro-batches, Adam), measurements without a verdict."""


def write_table(out: Path, report: Report, timings, run) -> None:
    """Update ``out`` with the run's checks and step times."""
    rows = [{"check": name, "result": "PASS" if ok else "FAIL", "detail": detail}
            for name, ok, detail in report.rows]
    rows += [{"check": f"step: {name}, compile_step {'yes' if captured else 'no'}",
              "result": "-", "detail": f"{ms:.3f} ms per step"}
             for name, captured, ms in timings if captured is not None]
    if rows:
        update_table(out, title=TITLE, intro=INTRO, columns=("check", "result", "detail"),
                     key=("check",), rows=rows, run=run, order=by_check)


if __name__ == "__main__":
    sys.exit(main())
