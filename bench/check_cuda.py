"""CUDA checks of the erase backend, with a small timing table: ``python -m bench.check_cuda``.

1. gradient parity with eager (tf32 off) for each inner compiler, fresh
   random inputs every step, every parameter;
2. a stress run: the multi-stream program against the same program on one
   stream, deterministic algorithms on, bit-identical gradients required
   at every step (a difference is a race);
   also: the in-place scaling kernel of early gradients (bit-identical to
   ``mul``, untouched at scale 1, under capture too), parity with a loss
   tangent other than 1, parity inside a whole-step CUDA graph taken by
   the user, and under float16 autocast with a GradScaler (the learned seed);
3. step time (CUDA events, median of trials), side by side, of eager,
   inductor, reduce-overhead, inductor with the whole step in one CUDA graph,
   and erase without and with CUDA graphs (4 side streams, and 1 stream).

Prints each result as it comes, a timing table last, and updates the current table of
checks, ``bench/results/check_cuda.md`` (``--out``; `bench.tables`): a check run again
replaces its row (its name holds its config, options and step count, and the CUDA
allocator where that is not the native one), the others stay with their date and command.
Needs a GPU.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
from pathlib import Path

import torch

import erase_fx
from bench.harness import (Variant, allocator_backend, build_step, compile_erase,
                           deterministic_algorithms, grads_of, max_rel_err, time_steps,
                           whole_step_graph)
from bench.models import ChainConfig, DetachedChain, make_inputs
from bench.tables import RESULTS, by_check, this_run, update_table
from erase_fx.emit.cudagraphs import GraphedForward

# NB: deterministic cuBLAS needs a fixed workspace, set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def check_parity(cfg, options, steps, device, control=False, tangent=1.0):
    """Max relative grad error against eager over ``steps`` fresh batches (tf32 off).

    ``control=True`` measures stock ``torch.compile`` instead: the error any
    Inductor compile has against eager, for comparison. ``tangent``: the
    gradient ``.backward()`` is called with (a loss scaler's scale).
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch._dynamo.reset()
    eager = DetachedChain(cfg).to(device)
    other = copy.deepcopy(eager)
    if options.get("inner") == "inductor":
        # NB: Inductor's fused kernels differ from eager by rounding, and a
        # ReLU that flips amplifies it; erase with Inductor is held to stock
        # Inductor's gradients instead.
        eager_fn = torch.compile(eager)
    else:
        eager_fn = eager
    compiled = torch.compile(other) if control else compile_erase(other, **options)
    worst = 0.0
    with erase_fx.collect_reports() as reports:
        for _ in range(steps):
            inputs = make_inputs(cfg, device)
            eager.zero_grad(set_to_none=True)
            other.zero_grad(set_to_none=True)
            seed = torch.tensor(tangent, device=device)
            eager_fn(*inputs).backward(seed)
            compiled(*inputs).backward(seed)
            worst = max(worst, max_rel_err(grads_of(eager), grads_of(other)))
    return worst, early_work(reports)


def early_work(reports) -> tuple[int, int, int]:
    """(early blocks, gradient parts, pieces) the compiled graphs run early."""
    blocks = [b for r in reports for b in r.blocks]
    return len(blocks), sum(b.partials for b in blocks), sum(b.pieces for b in blocks)


def expected_early_work(cfg) -> tuple[int, int, int]:
    """What erase_fx's analysis finds for ``cfg``'s model on the CPU (it does not depend on
    the device): the early work a GPU compile must run, whatever the model's shape (a chain's
    K-1 blocks, towers' parts, a block in pieces)."""
    model = DetachedChain(cfg)
    reports = erase_fx.explain(model, *make_inputs(cfg, torch.device("cpu")))
    return early_work(reports)


def check_whole_step_capture(cfg, device, options, steps=3):
    """erase inside a whole-step CUDA graph taken by the user vs stock Inductor, fresh inputs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    reference = DetachedChain(cfg).to(device)
    model = copy.deepcopy(reference)
    stock = torch.compile(reference)
    inputs = make_inputs(cfg, device)
    step = whole_step_graph(model, compile_erase(model, inner="inductor", **options), inputs)
    worst = 0.0
    for _ in range(steps):
        fresh = make_inputs(cfg, device)
        for buffer, value in zip(inputs, fresh):
            buffer.copy_(value)
        step()
        reference.zero_grad(set_to_none=True)
        stock(*fresh).backward()
        worst = max(worst, max_rel_err(grads_of(reference), grads_of(model)))
    return worst


def check_scale_kernel(device):
    """scale_unless_one_ against torch's mul, bit for bit; untouched at 1; under capture too."""
    from erase_fx.emit.scale_grads import scale_unless_one_

    problems = []
    shapes = [(2000, 2000), (1, 1), (17,), (1000, 3), (3, 1000), (64, 50000), (5, 7, 9)] * 2
    # NB: the backward hands 16-bit gradients a float32 scale (65536 is no float16)
    cases = [(dtype, scale_dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)
             for scale_dtype in dict.fromkeys((dtype, torch.float32))]
    for dtype, scale_dtype in cases:
        for scale_value in (1.0, 3.0, 0.5, 65536.0, float("nan")):
            tensors = [torch.randn(s, device=device).to(dtype) for s in shapes]
            tensors[1::3] = [t.t() if t.dim() == 2 else t for t in tensors[1::3]]
            kept = [t.clone() for t in tensors]
            scale = torch.tensor(scale_value, device=device, dtype=scale_dtype)
            scale_unless_one_(tensors, scale)
            for got, before in zip(tensors, kept):
                want = before if scale_value == 1.0 else before * scale
                same = torch.equal(got.isnan(), want.isnan()) and torch.equal(
                    got.nan_to_num(), want.nan_to_num())
                if not same:
                    problems.append(f"{dtype} scale {scale_value} ({scale_dtype}) "
                                    f"shape {tuple(got.shape)}")
    # under capture: replay with a scale of 1, then of 2
    tensors = [torch.randn(s, device=device) for s in shapes]
    scale = torch.ones((), device=device)
    scale_unless_one_(tensors, scale)  # compiles the kernel outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        scale_unless_one_(tensors, scale)
    torch.cuda.current_stream().wait_stream(side)
    kept = [t.clone() for t in tensors]
    graph.replay()
    if not all(torch.equal(a, b) for a, b in zip(tensors, kept)):
        problems.append("captured, scale 1: memory changed")
    scale.fill_(2.0)
    graph.replay()
    if not all(torch.equal(a, 2 * b) for a, b in zip(tensors, kept)):
        problems.append("captured, scale 2: not doubled")
    torch.cuda.synchronize()
    return problems


def check_two_forwards(cfg, device):
    """Two forwards, then one backward of their sum, with CUDA graphs on, vs stock Inductor."""
    torch._dynamo.reset()
    eager = DetachedChain(cfg).to(device)
    other = copy.deepcopy(eager)
    compiled = compile_erase(other, inner="inductor", cudagraphs=True)
    stock = torch.compile(eager)
    worst = 0.0
    for step in range(4):
        first, second = make_inputs(cfg, device), make_inputs(cfg, device)
        eager.zero_grad(set_to_none=True)
        other.zero_grad(set_to_none=True)
        if step % 2:
            (stock(*first) + stock(*second)).backward()
            (compiled(*first) + compiled(*second)).backward()
        else:
            stock(*first).backward()
            compiled(*first).backward()
        worst = max(worst, max_rel_err(grads_of(eager), grads_of(other)))
    return worst


class Float16Autocast(torch.nn.Module):
    """A model run under float16 autocast, its loss scaled down (float16 gradients computed
    at seed 1 underflow where a GradScaler's scale keeps them)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *inputs):
        with torch.autocast(inputs[0].device.type, dtype=torch.float16):
            return self.inner(*inputs) * 1e-4


def check_float16_scaler(cfg, device, options, steps=4):
    """Float16 autocast and a GradScaler, no seed given: erase (the seed learned from the
    last backward, `erase_fx.emit.loss_seed`) against eager (aot_eager) or stock Inductor
    after each step but the first (which runs as aot_eager). Returns (max rel
    grad err, early blocks, steps that ran erase's program)."""
    from erase_fx.emit.loss_seed import UntilSeeded

    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    reference = Float16Autocast(DetachedChain(cfg)).to(device)
    model = copy.deepcopy(reference)
    run_reference = torch.compile(reference) if options["inner"] == "inductor" else reference
    compiled = compile_erase(model, **options)
    scalers = [torch.amp.GradScaler(device.type) for _ in range(2)]
    ran = []
    call = UntilSeeded.__call__

    def counting(switch, *args):
        ran.append(switch.seed.known)
        return call(switch, *args)

    UntilSeeded.__call__ = counting
    worst = 0.0
    try:
        with erase_fx.collect_reports() as reports:
            for step in range(steps):
                inputs = make_inputs(cfg, device)
                for module, fn, scaler in ((reference, run_reference, scalers[0]),
                                           (model, compiled, scalers[1])):
                    module.zero_grad(set_to_none=True)
                    scaler.scale(fn(*inputs)).backward()
                if step:
                    worst = max(worst, max_rel_err(grads_of(reference), grads_of(model)))
    finally:
        UntilSeeded.__call__ = call
    return worst, len([b for r in reports for b in r.blocks]), sum(ran)


def train_pattern(model, fn, pattern, batches):
    """A few SGD steps in one of the usual loop shapes; returns the final parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for micro_batches in batches:
        if pattern == "zero-before-forward":
            optimizer.zero_grad(set_to_none=True)
            fn(*micro_batches[0]).backward()
        elif pattern == "zero-after-forward":
            loss = fn(*micro_batches[0])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        elif pattern == "accumulate":
            optimizer.zero_grad(set_to_none=True)
            for inputs in micro_batches:
                fn(*inputs).backward()
        elif pattern == "zero-in-place":
            optimizer.zero_grad(set_to_none=False)
            fn(*micro_batches[0]).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


PATTERNS = ("zero-before-forward", "zero-after-forward", "accumulate", "zero-in-place")


def check_patterns(cfg, device, steps=4):
    """Training loops of each shape: erase with CUDA graphs vs eager, and replay counts.

    Replaying a graph while its previous outputs (saved tensors, gradients
    handed out as aliases of graph memory) are still used would be wrong;
    erase then runs that call without the graph. With ``inner="aot_eager"``
    the kernels are eager's, so parameters after a few optimizer steps must
    equal eager's exactly in every loop shape (Inductor's rounding, amplified
    by ReLU flips over optimizer steps, would hide a small error).
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    for pattern in PATTERNS:
        torch._dynamo.reset()
        reference_model = DetachedChain(cfg).to(device)
        model = copy.deepcopy(reference_model)
        generator = torch.Generator(device=device).manual_seed(1)
        batches = [[make_inputs(cfg, device, generator) for _ in range(2)] for _ in range(steps)]
        reference = train_pattern(reference_model, reference_model, pattern, batches)
        before = set(map(id, erase_graphs()))
        compiled = compile_erase(model, inner="aot_eager", cudagraphs=True)
        result = train_pattern(model, compiled, pattern, batches)
        new = [g for g in erase_graphs() if id(g) not in before]
        replays = (sum(g.replays for g in new),
                   sum(g.backward.replays for g in new if g.backward is not None))
        results.append((pattern, max_rel_err(reference, result), replays))
    return results


def erase_graphs():
    """Every erase forward CUDA graph alive."""
    # NB: type(), not isinstance(): gc also lists dead weak proxies
    return [o for o in gc.get_objects() if type(o) is GraphedForward]


def stress(cfg, steps, device, graphs, release_lag=None):
    """Multi-stream vs one-stream program, deterministic: any difference is a race.

    ``release_lag`` (under capture, ``cudagraphs=True``) lets the captured
    program release memory before the join, so later segments reuse it: the
    run then also proves that reuse is ordered by events.
    """
    with deterministic_algorithms():
        torch._dynamo.reset()
        base = DetachedChain(cfg).to(device)
        multi_model, single_model = copy.deepcopy(base), copy.deepcopy(base)
        multi = compile_erase(multi_model, inner="inductor", cudagraphs=graphs,
                              tuning={"release_lag": release_lag})
        single = compile_erase(single_model, inner="inductor", cudagraphs=graphs, overlap=False)
        differing = 0
        generator = torch.Generator(device=device).manual_seed(0)
        for _ in range(steps):
            inputs = make_inputs(cfg, device, generator)
            for model, fn in ((multi_model, multi), (single_model, single)):
                model.zero_grad(set_to_none=True)
                fn(*inputs).backward()
            for a, b in zip(multi_model.parameters(), single_model.parameters()):
                if a.grad is not None and not torch.equal(a.grad, b.grad):
                    differing += 1
                    break
        return differing


#: The timing table's variants (`bench.harness`'s names).
VARIANTS = ("eager", "inductor", "reduce-overhead", "inductor+graph", "erase", "erase+graphs",
            "erase+graphs/one-stream", "erase+step-graph", "erase+step-graph/one-stream")


def timing(cfg, device, trials, steps_per_trial, variants):
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    base = DetachedChain(cfg).to(device)
    inputs = make_inputs(cfg, device)
    rows = []
    for name in variants:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        start = time.perf_counter()
        step = build_step(Variant.parse(name), model, inputs).step
        step()  # the CUDA graph variants capture here
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        torch.cuda.reset_peak_memory_stats()
        median, low, high = time_steps(step, trials, steps_per_trial, warmup=5)
        peak = torch.cuda.max_memory_allocated()
        rows.append((str(cfg), name, median, low, high, compile_s, peak))
        print(f"  {cfg} {name:28s} {median:7.3f} ms (min {low:.3f}, max {high:.3f}), "
              f"compile {compile_s:.1f} s, peak {peak / 2**20:.0f} MiB", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="ctr:1024:512:1024:6,mlp:512:1024:2048:6,"
                        "mlp:128:2000:2000:4,ctr:4096:1024:2048:6")
    parser.add_argument("--parity-config", default="mlp:256:512:1024:4")
    parser.add_argument("--parity-steps", type=int, default=3)
    parser.add_argument("--stress-steps", type=int, default=200)
    parser.add_argument("--release-lags", default="uncaptured,none",
                        help="comma-separated stress runs: uncaptured (erase's graphs off), "
                        "none (captured, nothing released before the join), N (captured, "
                        "release_lag=N)")
    parser.add_argument("--parts", default="parity,stress,timing",
                        help="comma-separated subset of parity,stress,timing")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--steps-per-trial", type=int, default=20)
    parser.add_argument("--out", default=str(RESULTS / "check_cuda.md"),
                        help="the table to update ('' for none)")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    unknown = parts - {"parity", "stress", "timing"}
    if unknown:
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}")
    try:
        runs = stress_runs(args.release_lags)
    except ValueError as error:
        parser.error(f"--release-lags: {error}")
    device = torch.device("cuda")
    print("torch", torch.__version__, "on", torch.cuda.get_device_name(device), flush=True)
    run, results, failures = this_run("bench.check_cuda", argv), Results(), 0
    out = Path(args.out) if args.out else None
    parity_cfg = ChainConfig.parse(args.parity_config)
    # NB: the table is written after each part, so a run cut short keeps what it checked
    if "parity" in parts:
        failures += parity_checks(parity_cfg, args.parity_steps, device, results)
        write_table(out, results, run)
    if "stress" in parts:
        failures += stress_checks(parity_cfg, args.stress_steps, device, runs, results)
        write_table(out, results, run)
    if "timing" in parts:
        timing_table(args, device, results)
        write_table(out, results, run)
    return 1 if failures else 0


def stress_runs(text: str) -> list[tuple[bool, int | None]]:
    """``--release-lags`` read: a (cudagraphs, release_lag) pair per comma-separated item."""
    runs = []
    for item in text.split(","):
        if item == "uncaptured":
            runs.append((False, None))
        elif item == "none":
            runs.append((True, None))
        elif item.isdigit() and int(item) >= 1:
            runs.append((True, int(item)))
        else:
            raise ValueError(f"{item!r} is not uncaptured, none or an integer >= 1")
    return runs


class Results:
    """The checks of one run: each printed as it comes (``<check>: <detail> <result>``) and
    kept as a row of the table (check, result, detail)."""

    def __init__(self):
        allocator = allocator_backend()
        # NB: the same check under another allocator is another row
        self.suffix = "" if allocator == "native" else f" ({allocator})"
        self.rows: list[dict] = []

    def add(self, check: str, result: str, detail: str) -> bool:
        """Record one check; ``result`` OK, FAIL, RACE or ``-`` (a measurement, no verdict).
        True when it did not fail."""
        print(f"{check}: {detail}" + ("" if result == "-" else f" {result}"), flush=True)
        self.rows.append({"check": check + self.suffix, "result": result, "detail": detail})
        return result in ("OK", "-")


def _ok(passed: bool) -> str:
    return "OK" if passed else "FAIL"


def parity_checks(parity_cfg, parity_steps, device, results: Results) -> int:
    """Parity, scaling kernel, tangents, captures, training-loop shapes: the count that failed."""
    failures = 0
    expected = expected_early_work(parity_cfg)
    control, _ = check_parity(parity_cfg, {}, parity_steps, device, control=True)
    results.add(f"parity {parity_cfg} stock torch.compile (control)", "-",
                f"max rel grad err {control:.2e}")
    for options in ({"inner": "aot_eager", "cudagraphs": False},
                    {"inner": "aot_eager", "cudagraphs": True},
                    {"inner": "inductor", "cudagraphs": False},
                    {"inner": "inductor", "cudagraphs": True},
                    # the forward compiled whole, replayed from erase's graphs
                    {"inner": "inductor", "cudagraphs": True, "streams": 0}):
        err, work = check_parity(parity_cfg, options, parity_steps, device)
        limit = 1e-5 if options["inner"] == "aot_eager" else 1e-4
        reference = "stock inductor" if options["inner"] == "inductor" else "eager"
        failures += not results.add(
            f"parity {parity_cfg} {options}", _ok(err <= limit and work == expected),
            f"(early blocks, parts, pieces) {work}, expected {expected}; max rel grad err vs "
            f"{reference} {err:.2e} (limit {limit:.1e})")
    problems = check_scale_kernel(device)
    failures += not results.add(
        "in-place scaling kernel (fp32, bf16, fp16; scales 1, 3, 0.5, 65536, nan; captured)",
        _ok(not problems), "; ".join(problems) or "bit-identical to mul")
    for options in ({"inner": "aot_eager", "cudagraphs": False},
                    {"inner": "aot_eager", "cudagraphs": True},
                    {"inner": "inductor", "cudagraphs": True}):
        err, _ = check_parity(parity_cfg, options, parity_steps, device, tangent=1024.0)
        limit = 1e-5 if options["inner"] == "aot_eager" else 1e-4
        failures += not results.add(f"parity {parity_cfg} {options}, backward(1024.0)",
                                    _ok(err <= limit),
                                    f"max rel grad err {err:.2e} (limit {limit:.1e})")
    for options in ({"cudagraphs": False}, {}):
        err = check_whole_step_capture(parity_cfg, device, options)
        failures += not results.add(
            f"inside a user's whole-step CUDA graph, erase {options or 'defaults'}",
            _ok(err <= 1e-4), f"max rel grad err vs stock inductor {err:.2e}")
    for options in ({"inner": "aot_eager", "cudagraphs": True},
                    {"inner": "inductor", "cudagraphs": True}):
        err, blocks, erase_steps = check_float16_scaler(parity_cfg, device, options)
        limit = 1e-5 if options["inner"] == "aot_eager" else 1e-3
        failures += not results.add(
            f"float16 autocast + GradScaler, no seed, {options}",
            _ok(err <= limit and blocks > 0 and erase_steps == 3),
            f"{blocks} early blocks, erase's program in {erase_steps} of steps 2-4; max rel "
            f"grad err vs {'stock inductor' if options['inner'] == 'inductor' else 'eager'} "
            f"{err:.2e} (limit {limit:.1e})")
    err = check_two_forwards(parity_cfg, device)
    failures += not results.add("two forwards then one backward, CUDA graphs on", _ok(err <= 1e-4),
                                f"max rel grad err {err:.2e}")

    for pattern, err, (fw_replays, bw_replays) in check_patterns(parity_cfg, device):
        failures += not results.add(
            f"training loop {pattern}, CUDA graphs on, aot_eager", _ok(err <= 1e-6),
            f"params vs eager after 4 SGD steps: max rel err {err:.2e}, replays fw "
            f"{fw_replays} bw {bw_replays}")
    return failures


def stress_checks(parity_cfg, steps, device, runs, results: Results) -> int:
    """The race stress, once per (cudagraphs, release_lag) of ``runs`` (none with ``steps``
    0): the count that raced."""
    failures = 0
    for graphs, lag in runs if steps else ():
        differing = stress(parity_cfg, steps, device, graphs, lag)
        failures += not results.add(
            f"stress {parity_cfg} cudagraphs={graphs} release_lag={lag}, {steps} steps",
            "OK" if not differing else "RACE",
            f"{differing} with any grad bit differing between 4 streams and 1 stream")
    return failures


def timing_table(args, device, results: Results) -> None:
    rows = []
    for text in args.configs.split(","):
        rows += timing(ChainConfig.parse(text), device, args.trials, args.steps_per_trial,
                       args.variants.split(","))
    print("\n| config | variant | ms median | min | max | vs inductor+graph | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    base = {r[0]: r[2] for r in rows if r[1] == "inductor+graph"}
    for config, name, median, low, high, compile_s, peak in rows:
        ratio = f"{median / base[config]:.2f}x" if config in base else "-"
        print(f"| {config} | {name} | {median:.3f} | {low:.3f} | {high:.3f} | {ratio} | "
              f"{peak / 2**20:.0f} |")
        results.rows.append({
            "check": f"timing {config} {name}{results.suffix}", "result": "-",
            "detail": f"{median:.3f} ms (min {low:.3f}, max {high:.3f}; {args.trials} trials "
                      f"of {args.steps_per_trial} steps), {ratio} of inductor+graph, peak "
                      f"{peak / 2**20:.0f} MiB, compile {compile_s:.1f} s"})


TITLE = "bench.check_cuda: the latest result of each check"
INTRO = """\
Written by `python -m bench.check_cuda` (on the GPU, `bash bench/device_run.sh checks` and
the stress parts): each run replaces the rows of the checks it ran and leaves the others;
`git log -p bench/results/check_cuda.md` shows what each run changed. A check's name holds
what it ran (config, options, steps; the CUDA allocator where it is not the native one).
Results: OK, FAIL, RACE (a stress step whose gradients differ bitwise between 4 streams and
1), ABORT (the process died), `-` (a measurement, no verdict)."""


def write_table(out: Path | None, results: Results, run) -> None:
    if out is not None and results.rows:
        update_table(out, title=TITLE, intro=INTRO, columns=("check", "result", "detail"),
                     key=("check",), rows=results.rows, run=run,
                     order=by_check)


if __name__ == "__main__":
    sys.exit(main())
