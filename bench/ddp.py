"""The paper's CTR model under DDP: ``torchrun --nproc-per-node N -m bench.ddp``.

Trains `bench.paper.ctr.BlockChainCTR` (a DLRM front, detached dense blocks,
each with a local BCE head) on the planted Criteo-like stream, data parallel:
each rank takes its slice of every global batch. Variants, one after another
in the same processes:

- ``eager``: ``DDP(model)``;
- ``inductor``: ``torch.compile(DDP(model))``;
- ``reduce-overhead``: the same with ``mode="reduce-overhead"`` (CUDA only);
- ``erase``: ``torch.compile(DDP(model), backend="erase")``, torch's default
  DDP settings: whole graphs, early gradients all-reduced during the forward;
- ``erase/late-allreduce``: the same with ``early_allreduce=False`` (DDP
  reduces every gradient at ``.backward()``);
- ``erase/aot_eager``: erase with ``inner="aot_eager"`` (the CPU default).

Rank 0 prints, per variant, the median and p90 QPS per rank (samples a
rank trains per second, after ``--warmup`` steps), the eval NE of the last
block at the end, and the largest parameter difference from the ``eager``
run (same seed, same data); ``--out`` writes the rows as JSON. Runs on CPU
over gloo (``torchrun --nproc-per-node 2 -m bench.ddp --quick``) and on
GPUs over NCCL, one process per GPU. Without torchrun it runs as one process
(world size 1).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import erase_fx
from bench.paper import common
from bench.paper.ctr import BlockChainCTR, DataSizes, Dataset, ModelSizes, evaluate

VARIANTS = ("eager", "inductor", "reduce-overhead", "erase", "erase/late-allreduce",
            "erase/aot_eager")
CPU_VARIANTS = ("eager", "erase/aot_eager")
CUDA_VARIANTS = ("eager", "reduce-overhead", "inductor", "erase", "erase/late-allreduce")


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device): torchrun's environment, else a one-process group."""
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                                rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def wrap(name: str, model: torch.nn.Module, device: torch.device):
    """``(ddp module, what a step calls)`` for variant ``name``."""
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if name == "eager":
        return ddp, ddp
    if name == "inductor":
        return ddp, torch.compile(ddp)
    if name == "reduce-overhead":
        return ddp, torch.compile(ddp, mode="reduce-overhead")
    options = {"inner": "aot_eager" if name == "erase/aot_eager" else "inductor",
               "early_allreduce": name != "erase/late-allreduce"}
    return ddp, torch.compile(ddp, backend="erase", options=options)


def train(name: str, base: BlockChainCTR, data: Dataset, args, rank: int, world: int,
          device: torch.device) -> dict:
    torch._dynamo.reset()
    model = copy.deepcopy(base).to(device)
    ddp, step_fn = wrap(name, model, device)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    timer = common.StepTimer(device)
    local = args.batch  # rows per rank
    blocks = 0
    for step in range(args.steps):
        rows = data.step_batch(step)
        batch = tuple(t[rank * local:(rank + 1) * local] for t in rows)
        timer.start()
        optimizer.zero_grad(set_to_none=True)
        with erase_fx.collect_reports() as reports:
            loss = step_fn(*batch)
        loss.backward()
        optimizer.step()
        timer.stop()
        blocks += sum(len(r.blocks) for r in reports)
    seconds = timer.seconds()[args.warmup:]
    stats = common.throughput_stats(seconds, local)
    ne = evaluate(model, data) if rank == 0 else float("nan")
    return {"variant": name, "qps_median": stats["median"], "qps_p90": stats["p90"],
            "ne": ne, "early_blocks": blocks, "world": world,
            "params": {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", help="comma-separated (default: the device's set)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4096, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a small model and stream (CPU smoke runs): 20 steps, batch 256")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.batch = 20, 5, 256
    rank, world, device = init_distributed()
    names = (args.variants.split(",") if args.variants else
             list(CUDA_VARIANTS if device.type == "cuda" else CPU_VARIANTS))
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    if device.type != "cuda" and "reduce-overhead" in names:
        parser.error("reduce-overhead needs CUDA")
    sizes = DataSizes(cap=1000) if args.quick else DataSizes()
    model_sizes = (ModelSizes(rows_per_field=tuple(sizes.rows_per_field()), embed_dim=16,
                              bottom=(64, 32), width=128, hidden=256, blocks=4)
                   if args.quick else ModelSizes(rows_per_field=tuple(sizes.rows_per_field())))
    data = Dataset.make(sizes, args.steps, args.batch * world, 1 << (12 if args.quick else 16),
                        args.seed, device)
    torch.manual_seed(args.seed)
    base = BlockChainCTR(model_sizes)
    rows = []
    for name in names:
        start = time.perf_counter()
        row = train(name, base, data, args, rank, world, device)
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        if rank == 0:
            print(f"{name}: {row['seconds']:.0f} s", flush=True)
    reference = next((r["params"] for r in rows if r["variant"] == "eager"), None)
    for row in rows:
        params = row.pop("params")
        row["param_diff_vs_eager"] = (max(float((params[k] - reference[k]).abs().max())
                                          for k in reference) if reference else float("nan"))
    if rank == 0:
        print(f"\nDDP, {world} rank(s) on {device.type}, {args.steps} steps, {args.batch} rows "
              f"per rank (QPS per rank after {args.warmup} warm-up steps)")
        print("| variant | early blocks | median QPS | p90 QPS | eval NE | max param diff vs eager |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r['early_blocks']} | {r['qps_median']:.0f} | "
                  f"{r['qps_p90']:.0f} | {r['ne']:.4f} | {r['param_diff_vs_eager']:.2e} |")
        if args.out:
            args.out.write_text(json.dumps({"rows": rows, "argv": sys.argv}, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
