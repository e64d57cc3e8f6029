"""DistributedDataParallel on CPU (gloo, two processes): gradients equal eager DDP's.

Early gradients are all-reduced in the forward (`erase_fx.ddp`); DDP's
reducer reduces the rest when `.backward()` accumulates them, and the
averaged gradients equal eager DDP's. Dynamo's DDP optimizer (on by default)
would split the graph at bucket boundaries, cutting blocks from their local
losses; it hands erase's backend whole graphs, so with torch's defaults as
with ``optimize_ddp=False`` the graph stays whole and every block but the
last goes early. tests/test_ddp_allreduce.py checks DDP's options and the
all-reduce itself.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

WORLD = 2


def _worker(rank: int, init_file: str, optimize_ddp: bool, bucket_cap_mb: float, queue,
            model_name: str = "chain", options: dict | None = None) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    import erase_fx
    from graphs import Chain, InFloat16, Towers, chain_inputs

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    from erase_fx.emit.loss_seed import UntilSeeded

    seed_known = []  # at each call of a float16 graph: whether its seed was learned
    call = UntilSeeded.__call__
    UntilSeeded.__call__ = lambda self, *args: (seed_known.append(self.seed.known),
                                                call(self, *args))[1]
    try:
        torch._dynamo.config.optimize_ddp = optimize_ddp
        torch.manual_seed(0)
        # NB: wide enough (about 1 MiB of weights per stage) for 1 MB buckets to split it
        model = {"chain": lambda: Chain(3, hidden=8192), "towers": lambda: Towers(3),
                 "float16": lambda: InFloat16(Chain(3, hidden=8192))}[model_name]()
        # NB: a GradScaler's first scale: float16 blocks run at the seed learned from it
        tangent = torch.tensor(2.0 ** 16 if model_name == "float16" else 1.0)
        eager = nn.parallel.DistributedDataParallel(copy.deepcopy(model),
                                                    bucket_cap_mb=bucket_cap_mb)
        module = copy.deepcopy(model)
        compiled = torch.compile(
            nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb),
            backend="erase", options={"inner": "aot_eager", "on_error": "raise",
                                      **(options or {})})
        worst = 0.0
        with erase_fx.collect_reports() as reports:
            for step in range(2):
                torch.manual_seed(100 + 10 * step + rank)  # each rank its own batch
                inputs = chain_inputs()
                for m in (eager, module):
                    m.zero_grad(set_to_none=True)
                eager(*inputs).backward(tangent)
                compiled(*inputs).backward(tangent)
                worst = max(worst, max((a.grad - b.grad).abs().max().item() for a, b in
                                       zip(eager.module.parameters(), module.parameters())))
        queue.put((rank, worst, (len(reports), sum(len(r.blocks) for r in reports),
                                 sum(r.early_updatable for r in reports)), seed_known, None))
    except Exception as error:  # noqa: BLE001 - reported to the test in the parent
        queue.put((rank, None, (0, 0, 0), seed_known, f"{type(error).__name__}: {error}"))
    finally:
        dist.destroy_process_group()


def run_ddp(tmp_path, optimize_ddp: bool, bucket_cap_mb: float,
            model_name: str = "chain", options: dict | None = None) -> list[tuple]:
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_worker, args=(rank, str(tmp_path / "init"),
                                                       optimize_ddp, bucket_cap_mb, queue,
                                                       model_name, options))
                 for rank in range(WORLD)]
    for process in processes:
        process.start()
    results = sorted(queue.get(timeout=300) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    return results


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize(
        "model_name, optimize_ddp, bucket_cap_mb, graphs, early_blocks, options", [
    ("chain", False, 25.0, 1, 2, None),  # one graph: every block but the last goes early
    ("chain", True, 1.0, 1, 2, None),    # torch's default: 1 MB buckets would split it; whole
    ("towers", False, 25.0, 1, 2, None),  # the towers' parts; the shared front after the sum
    # no side stream: no early all-reduce, DDP's buckets reduce every gradient
    ("chain", True, 1.0, 1, 2, {"streams": 0}),
    # float16 autocast at T = 2**16: the first step runs as aot_eager, the second
    # erase's at the seed the first taught it
    ("float16", True, 1.0, 1, 2, None),
])
def test_ddp_gradients_equal_eager_ddp(tmp_path, model_name, optimize_ddp, bucket_cap_mb,
                                       graphs, early_blocks, options):
    results = run_ddp(tmp_path, optimize_ddp, bucket_cap_mb, model_name, options)
    for rank, worst, (num_graphs, blocks, updatable), seed_known, error in results:
        assert error is None, f"rank {rank}: {error}"
        # NB: float16: the first step ran stock, the second erase's program
        assert seed_known == ([False, True] if model_name == "float16" else [])
        assert worst == 0.0, f"rank {rank}: grads differ from eager DDP by {worst}"
        assert num_graphs == graphs
        # NB: under DDP the gradients are all-reduced after their block: no early update
        assert updatable == 0, f"rank {rank}: {updatable} parameters may be updated early"
        if early_blocks is not None:
            assert blocks == early_blocks, f"rank {rank}: {blocks} early blocks"
