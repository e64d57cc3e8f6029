"""FSDP2 (``fully_shard``) on CPU (gloo, two processes): gradients equal eager FSDP2's.

What runs early under FSDP2: with the whole model one FSDP2 unit
(``fully_shard(model)``), Dynamo compiles the model's forward as one graph
between FSDP2's hooks (the all-gather before it, the reduce-scatter after the
backward); erase_fx finds the same early blocks as without FSDP2 and runs
their backward in the forward, on the unsharded parameters, and FSDP2
reduce-scatters every gradient at ``.backward()`` as it does in eager (there
is no early reduce-scatter). With each stage its own unit as well
(``fully_shard(stage)`` per stage, then the root), Dynamo in torch 2.13
compiles no graph of the model at all (FSDP2's modules run as they are, for
any backend), so nothing runs early, and the gradients are eager FSDP2's.
"""
from __future__ import annotations

import copy
import os
import sys
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

from spawn_helpers import each_rank, spawn_ranks

WORLD = 2


def _run(rank: int, per_stage: bool) -> dict[str, Any]:
    import erase_fx
    from graphs import Chain, chain_inputs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = Chain(3, hidden=64)
    expected = sum(len(r.blocks) for r in erase_fx.explain(copy.deepcopy(model), *chain_inputs()))
    eager, erased = copy.deepcopy(model), copy.deepcopy(model)
    for m in (eager, erased):
        if per_stage:
            for stage in m.stages:
                fully_shard(stage, mesh=mesh)
        fully_shard(m, mesh=mesh)
    compiled = torch.compile(erased, backend="erase",
                             options={"inner": "aot_eager", "on_error": "raise"})
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, erased)]
    worst_grad = worst_param = 0.0
    with erase_fx.collect_reports() as reports:
        for step in range(3):
            torch.manual_seed(100 + 10 * step + rank)
            inputs = chain_inputs()
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            eager(*inputs).backward()
            compiled(*inputs).backward()
            worst_grad = max(worst_grad, max(
                (a.grad.full_tensor() - b.grad.full_tensor()).abs().max().item()
                for a, b in zip(eager.parameters(), erased.parameters())))
            for opt in optimizers:
                opt.step()
            worst_param = max(worst_param, max(
                (a.full_tensor() - b.full_tensor()).abs().max().item()
                for a, b in zip(eager.parameters(), erased.parameters())))
    stock_graphs = []
    if per_stage:  # what a stock backend compiles of the same model
        torch._dynamo.reset()
        stock = copy.deepcopy(model)
        for stage in stock.stages:
            fully_shard(stage, mesh=mesh)
        fully_shard(stock, mesh=mesh)
        torch.compile(stock, backend=lambda gm, _: stock_graphs.append(gm) or gm.forward)(
            *chain_inputs()).backward()
    return {"grad": worst_grad, "param": worst_param, "graphs": len(reports),
            "blocks": sum(len(r.blocks) for r in reports), "expected": expected,
            "stock_graphs": len(stock_graphs)}


def _worker(rank: int, init_file: str, queue: Any) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    results: dict[str, Any] = {}
    try:
        for name, per_stage in (("root", False), ("per_stage", True)):
            try:
                results[name] = _run(rank, per_stage)
            except Exception as error:  # noqa: BLE001 - reported to the test in the parent
                results[name] = {"error": f"{type(error).__name__}: {error}\n"
                                          f"{traceback.format_exc()}"}
    finally:
        queue.put((rank, results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[int, Any]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("no FSDP2 (torch.distributed.fsdp.fully_shard) in this torch")
    init = tmp_path_factory.mktemp("fsdp2") / "init"
    return spawn_ranks(_worker, WORLD, (str(init),), timeout=300)


def _each_rank(records: dict[int, Any], name: str) -> list[dict[str, Any]]:
    return each_rank(records, name, WORLD)


def test_fsdp2_whole_model_unit_runs_every_block_early_and_equals_eager_fsdp2(records):
    for record in _each_rank(records, "root"):
        assert record["graphs"] == 1
        assert record["blocks"] == record["expected"] == 2
        assert record["grad"] == 0.0 and record["param"] == 0.0


def test_fsdp2_per_stage_units_compile_nothing_and_equal_eager_fsdp2(records):
    for record in _each_rank(records, "per_stage"):
        assert record["graphs"] == record["stock_graphs"] == 0
        assert record["grad"] == 0.0 and record["param"] == 0.0
