"""DDP on GPUs (NCCL): erase with early all-reduce against DDP with stock compilers.

Run on two GPUs::

    torchrun --nproc-per-node 2 -m bench.check_ddp --out bench/results/ddp.json

or in one process (world size 1 over NCCL on one GPU: the same code paths,
the all-reduce of one rank)::

    python -m bench.check_ddp

Every run wraps the same model (``--config``, a `bench.models` chain: detached
stages with local heads) in ``DistributedDataParallel`` with torch's defaults
(Dynamo's DDP optimizer on, ``--bucket-cap-mb`` buckets), each rank on its own
batches, and reports, on rank 0:

1. correctness (tf32 off): the parameters after ``--steps`` SGD steps against
   eager DDP's, the largest absolute difference: erase with ``aot_eager``
   inside (expected 0: the same kernels, and all-reduce is linear), and erase
   with Inductor inside next to stock Inductor's own distance from eager (the
   bar: Inductor's fused kernels round differently); the early blocks found
   and how many gradients were all-reduced early;
2. timing (tf32 on): milliseconds per training step (zero_grad, forward,
   backward, SGD step), median of ``--trials`` trials of ``--steps-per-trial``
   steps, for DDP + reduce-overhead, DDP + Inductor, DDP + erase (early
   all-reduce on) and DDP + erase with ``early_allreduce=False`` (DDP reduces
   everything at ``.backward()``; erase's own CUDA graphs stay on there, while
   a graph that all-reduces early runs without them);
3. overlap: from a ``torch.profiler`` trace of a few steps of each variant,
   the share of communication kernel time (NCCL kernels) during which a
   compute kernel was running, with both times per step. In one process NCCL
   reduces nothing and may launch no kernel: the share is then empty.

Writes everything as JSON to ``--out`` (rank 0).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import erase_fx
from bench.models import ChainConfig, DetachedChain, make_inputs
from erase_fx import ddp as erase_ddp
from erase_fx.profile import (intersection_length, kernels_from_profiler, merge_intervals,
                              total_length)

#: name -> how to compile a DDP module (None: eager DDP)
TIMED = ("eager", "reduce-overhead", "inductor", "erase", "erase/late-allreduce")
COMM_MARKERS = ("nccl",)


def init_distributed() -> tuple[int, int, torch.device]:
    """Rank, world size and device; under torchrun from its environment, else a world of one."""
    if "RANK" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        torch.cuda.set_device(0)
        init = os.path.join(tempfile.mkdtemp(), "init")
        dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", torch.cuda.current_device())


def compile_variant(name: str, ddp: nn.Module, options: dict[str, Any] | None = None) -> Any:
    if name == "eager":
        return ddp
    if name == "inductor":
        return torch.compile(ddp)
    if name == "reduce-overhead":
        return torch.compile(ddp, mode="reduce-overhead")
    if name == "erase":
        return compile_erase(ddp, {"on_error": "raise", **(options or {})})
    if name == "erase/late-allreduce":
        return compile_erase(ddp, {"on_error": "raise", "early_allreduce": False,
                                   **(options or {})})
    raise ValueError(name)


def compile_erase(ddp: nn.Module, options: dict[str, Any]) -> Any:
    """``torch.compile(ddp, backend="erase", options=...)``; with erase_fx not installed (no
    entry point), the same backend as a callable."""
    from torch._dynamo.backends.registry import lookup_backend

    try:
        lookup_backend("erase")
    except Exception:  # noqa: BLE001 - not installed: the callable is the same backend
        return torch.compile(ddp, backend=erase_fx.make_backend(**options))
    return torch.compile(ddp, backend="erase", options=options)


def batch(cfg: ChainConfig, device: torch.device, step: int, rank: int) -> tuple[torch.Tensor, ...]:
    """The batch of one rank at one step: the same for every variant."""
    generator = torch.Generator(device=device)
    generator.manual_seed(1_000_003 * step + rank)
    return make_inputs(cfg, device, generator)


def train(fn: Any, ddp: nn.Module, optimizer: torch.optim.Optimizer, cfg: ChainConfig,
          device: torch.device, rank: int, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        optimizer.zero_grad(set_to_none=True)
        fn(*batch(cfg, device, step, rank)).backward()
        optimizer.step()


def fresh_ddp(base: nn.Module, device: torch.device, bucket_cap_mb: float) -> nn.Module:
    return nn.parallel.DistributedDataParallel(copy.deepcopy(base).to(device),
                                               device_ids=[device.index],
                                               bucket_cap_mb=bucket_cap_mb)


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x.detach().float() - y.detach().float()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))


def check_correctness(cfg: ChainConfig, base: nn.Module, device: torch.device, rank: int,
                      args: argparse.Namespace) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runs: dict[str, nn.Module] = {}
    found: dict[str, Any] = {}
    for name, variant, options in (("eager", "eager", None),
                                   ("erase/aot_eager", "erase", {"inner": "aot_eager"}),
                                   ("inductor", "inductor", None),
                                   ("erase/inductor", "erase", {"inner": "inductor"})):
        torch._dynamo.reset()
        ddp = fresh_ddp(base, device, args.bucket_cap_mb)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
        with erase_fx.collect_reports() as reports:
            train(compile_variant(variant, ddp, options), ddp, optimizer, cfg, device, rank,
                  args.steps)
        torch.cuda.synchronize()
        runs[name] = ddp
        state = erase_ddp.state_of(ddp)
        found[name] = {"graphs": len(reports), "blocks": sum(len(r.blocks) for r in reports),
                       "stats": dict(state.stats) if state is not None else None}
    eager = runs["eager"]
    result = {name: {"max_param_diff": max_param_diff(eager, ddp), **found[name]}
              for name, ddp in runs.items() if name != "eager"}
    stock = result["inductor"]["max_param_diff"]
    result["verdict"] = {
        "aot_eager_exact": result["erase/aot_eager"]["max_param_diff"] == 0.0,
        "inductor_within_stock": result["erase/inductor"]["max_param_diff"]
        <= max(2.0 * stock, 1e-6),
    }
    return result


def time_variant(name: str, cfg: ChainConfig, base: nn.Module, device: torch.device, rank: int,
                 args: argparse.Namespace) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch._dynamo.reset()
    ddp = fresh_ddp(base, device, args.bucket_cap_mb)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    fn = compile_variant(name, ddp)
    started = time.perf_counter()
    with erase_fx.collect_reports() as reports:
        train(fn, ddp, optimizer, cfg, device, rank, args.warmup)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - started
    step_index = args.warmup
    times = []
    for _ in range(args.trials):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        train(fn, ddp, optimizer, cfg, device, rank, args.steps_per_trial, step_index)
        end.record()
        torch.cuda.synchronize()
        step_index += args.steps_per_trial
        times.append(start.elapsed_time(end) / args.steps_per_trial)
    overlap = profile_overlap(fn, ddp, optimizer, cfg, device, rank, args.profile_steps,
                              step_index)
    state = erase_ddp.state_of(ddp)
    return {
        "ms_median": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
        "warmup_s": compile_s, "graphs": len(reports),
        "blocks": sum(len(r.blocks) for r in reports),
        "stats": dict(state.stats) if state is not None else None,
        "overlap": overlap,
    }


def profile_overlap(fn: Any, ddp: nn.Module, optimizer: torch.optim.Optimizer,
                    cfg: ChainConfig, device: torch.device, rank: int, steps: int,
                    first: int) -> dict[str, Any]:
    """Communication kernel time overlapped with compute kernels, from a profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train(fn, ddp, optimizer, cfg, device, rank, steps, first)
        torch.cuda.synchronize()
    kernels = kernels_from_profiler(prof)
    comm = merge_intervals((k.start_us, k.end_us) for k in kernels
                           if any(m in k.name.lower() for m in COMM_MARKERS))
    compute = merge_intervals((k.start_us, k.end_us) for k in kernels
                              if not any(m in k.name.lower() for m in COMM_MARKERS))
    comm_us = total_length(comm)
    overlapped = intersection_length(comm, compute)
    return {
        "comm_us_per_step": comm_us / steps,
        "compute_us_per_step": total_length(compute) / steps,
        "overlapped_us_per_step": overlapped / steps,
        "fraction": overlapped / comm_us if comm_us > 0 else None,
        "comm_kernels": sum(1 for k in kernels if any(m in k.name.lower() for m in COMM_MARKERS)),
    }


def print_report(report: dict[str, Any]) -> None:
    print(f"\nDDP check: {report['config']}, world size {report['world_size']}, "
          f"torch {report['torch']}, {report['device']}")
    correctness = report.get("correctness")
    if correctness:
        print(f"\nparameters after {report['steps']} SGD steps, max |diff| from eager DDP "
              "(tf32 off)")
        for name in ("erase/aot_eager", "inductor", "erase/inductor"):
            row = correctness[name]
            stats = row["stats"] or {}
            print(f"  {name:<16} {row['max_param_diff']:.3e}   graphs {row['graphs']}, "
                  f"early blocks {row['blocks']}, early grads reduced "
                  f"{stats.get('early_grads', 0)}, skipped by DDP {stats.get('hook_skipped', 0)}")
        print(f"  verdict: {correctness['verdict']}")
    timing = report.get("timing")
    if timing:
        print("\nms per step (median, min-max), tf32 on; NCCL time per step and share overlapped "
              "with compute")
        for name, row in timing.items():
            overlap = row["overlap"]
            share = "-" if overlap["fraction"] is None else f"{overlap['fraction']:.0%}"
            print(f"  {name:<16} {row['ms_median']:7.3f} ({row['ms_min']:.3f}-{row['ms_max']:.3f})"
                  f"   comm {overlap['comm_us_per_step']:8.1f} us, overlapped {share:>4}, "
                  f"graphs {row['graphs']}, blocks {row['blocks']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="mlp:512:1024:2048:6")
    parser.add_argument("--steps", type=int, default=20, help="SGD steps of the correctness run")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps-per-trial", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--parts", default="correctness,timing")
    parser.add_argument("--variants", default=",".join(TIMED))
    parser.add_argument("--out", default=None, help="JSON file for the results (rank 0)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.check_ddp needs a GPU", file=sys.stderr)
        return 2
    # NB: deterministic cuBLAS for the correctness part
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    rank, world, device = init_distributed()
    try:
        cfg = ChainConfig.parse(args.config)
        torch.manual_seed(0)
        base = DetachedChain(cfg)
        parts = set(args.parts.split(","))
        report: dict[str, Any] = {"config": str(cfg), "world_size": world, "steps": args.steps,
                                  "torch": torch.__version__,
                                  "device": torch.cuda.get_device_name(device),
                                  "bucket_cap_mb": args.bucket_cap_mb}
        if "correctness" in parts:
            report["correctness"] = check_correctness(cfg, base, device, rank, args)
        if "timing" in parts:
            report["timing"] = {name: time_variant(name, cfg, base, device, rank, args)
                                for name in args.variants.split(",")}
        if rank == 0:
            print_report(report)
            if args.out:
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "w") as file:
                    json.dump(report, file, indent=2)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
