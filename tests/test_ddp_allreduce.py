"""DDP with torch's defaults and early all-reduce (gloo, two CPU processes).

One pair of processes runs every scenario (a spawn costs seconds); each test
checks one scenario's record. In each scenario a model is trained for a few
SGD steps twice from the same weights, under eager DDP and under
``torch.compile(DDP(model), backend="erase")``, each rank on its own batch,
with Dynamo's DDP optimizer on (the default) and buckets small enough that it
would split the graph. What is checked:

- every early block erase_fx finds in the bare model is found under DDP;
- gradients and parameters equal eager DDP's after every step, bitwise with
  ``aot_eager`` inside (within 1e-5 with a loss scale, where ``T != seed``);
- each gradient element is all-reduced exactly once per synced step (every
  collective goes through ``dist.all_reduce``, counted: erase's early ones
  and DDP's through erase's communication hook);
- ``no_sync()`` accumulation, ``find_unused_parameters``, ``static_graph``,
  ``gradient_as_bucket_view``, ``early_allreduce=False``, a parameter also
  used outside the compiled graph, gradients zeroed with
  ``set_to_none=False``, a user communication hook (fallback), a DDP model
  with no early block, and a non-erase DDP model in the same process, which
  Dynamo's DDP optimizer still splits.
"""
from __future__ import annotations

import copy
import os
import sys
import time
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from spawn_helpers import each_rank, spawn_ranks

WORLD = 2
#: wide enough (about 1 MiB of weights per stage) that 1 MB buckets split it
HIDDEN = 8192
BUCKET_MB = 1.0


class SharedHead(nn.Module):
    """Two detached stages with local heads; after a graph break, head 0 is used again, so
    its gradient has a term from outside the graph that holds its early gradient."""

    def __init__(self, d: int = 16, hidden: int = HIDDEN, classes: int = 5):
        super().__init__()
        self.s0 = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))
        self.s1 = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))
        self.h0 = nn.Linear(d, classes)
        self.h1 = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.s0(x)
        loss = F.cross_entropy(self.h0(h), labels)
        h = self.s1(h.detach())
        loss = loss + F.cross_entropy(self.h1(h), labels)
        torch._dynamo.graph_break()
        return loss + 0.1 * self.h0(h.detach()).pow(2).mean()


class WithUnused(nn.Module):
    """A chain with a parameter the forward never uses (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        from graphs import Chain

        self.chain = Chain(3, hidden=HIDDEN)
        self.unused = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.chain(x, labels)


class Plain(nn.Module):
    """No detach, no local loss: nothing runs early."""

    def __init__(self, d: int = 16, hidden: int = HIDDEN, classes: int = 5):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d), nn.ReLU(),
                                 nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), labels)


def _model(name: str) -> nn.Module:
    from graphs import Chain, Towers

    if name == "chain":
        return Chain(3, hidden=HIDDEN)
    if name == "towers":
        return Towers(3, d=16)
    if name == "shared_head":
        return SharedHead()
    if name == "with_unused":
        return WithUnused()
    if name == "plain":
        return Plain()
    raise ValueError(name)


#: name -> settings; every scenario compares erase with eager DDP on the same batches.
SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {},
    "inductor": {"options": {"inner": "inductor"}, "steps": 2},
    "early_off": {"options": {"early_allreduce": False}},
    "scaled_loss": {"loss_scale": 3.7},
    "no_sync": {"micro_steps": 3},
    "find_unused": {"model": "with_unused", "ddp": {"find_unused_parameters": True}},
    "static_graph": {"ddp": {"static_graph": True}},
    "bucket_view": {"ddp": {"gradient_as_bucket_view": True}},
    "towers": {"model": "towers"},
    "shared_head": {"model": "shared_head"},
    "user_hook": {"user_hook": True},
    "grads_kept": {"set_to_none": False},
    "plain": {"model": "plain"},
}


def _noop_average_hook(state, bucket):  # type: ignore[no-untyped-def]
    """A user's communication hook: DDP's default average, written as a hook (no annotations:
    DDP checks them against classes, and this module's are strings)."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


_BARE_BLOCKS: dict[str, int] = {}


def _run_scenario(rank: int, name: str, settings: dict[str, Any]) -> dict[str, Any]:
    import erase_fx
    from erase_fx import ddp as erase_ddp
    from graphs import chain_inputs

    torch._dynamo.reset()
    model_name = settings.get("model", "chain")
    options = {"inner": "aot_eager", "on_error": "raise", **settings.get("options", {})}
    if settings.get("user_hook"):
        options["on_error"] = "fallback"
    ddp_kwargs = {"bucket_cap_mb": BUCKET_MB, **settings.get("ddp", {})}
    steps = settings.get("steps", 3)
    micro = settings.get("micro_steps", 1)
    scale = settings.get("loss_scale", 1.0)

    torch.manual_seed(0)
    model = _model(model_name)
    if model_name not in _BARE_BLOCKS:  # the early blocks erase_fx finds without DDP
        bare = erase_fx.explain(copy.deepcopy(model), *chain_inputs())
        _BARE_BLOCKS[model_name] = sum(len(r.blocks) for r in bare)
    expected_blocks = _BARE_BLOCKS[model_name]
    eager = nn.parallel.DistributedDataParallel(copy.deepcopy(model), **ddp_kwargs)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), **ddp_kwargs)
    if settings.get("user_hook"):
        ddp.register_comm_hook(None, _noop_average_hook)
        eager.register_comm_hook(None, _noop_average_hook)
    compiled = torch.compile(ddp, backend="erase", options=options)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, ddp)]

    counted: list[int] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counted.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    record: dict[str, Any] = {"expected_blocks": expected_blocks, "grad_diff": 0.0,
                              "param_diff": 0.0, "reduced_per_step": [], "early_in_no_sync": 0,
                              "reduced_in_forward": []}
    numel = sum(p.numel() for p in ddp.parameters() if p.requires_grad)
    dist.all_reduce = counting_all_reduce
    try:
        with erase_fx.collect_reports() as reports:
            for step in range(steps):
                for opt in optimizers:
                    opt.zero_grad(set_to_none=settings.get("set_to_none", True))
                counted.clear()
                for k in range(micro):
                    torch.manual_seed(1000 + 100 * step + 10 * k + rank)  # each rank its batch
                    inputs = chain_inputs()
                    last = k == micro - 1
                    for m, run in ((eager, eager), (ddp, compiled)):
                        context = m.no_sync() if not last else _nothing()
                        with context:
                            loss = run(*inputs)
                            if m is ddp and last:  # reduced so far: during the forward
                                record["reduced_in_forward"].append(sum(counted))
                            (scale * loss).backward()
                    if not last:
                        state = erase_ddp.state_of(ddp)
                        record["early_in_no_sync"] += (state.stats["early_collectives"]
                                                       if state is not None else 0)
                record["reduced_per_step"].append(sum(counted))
                record["grad_diff"] = max(record["grad_diff"], _max_diff(
                    [p.grad for p in eager.parameters()], [p.grad for p in ddp.parameters()]))
                for opt in optimizers:
                    opt.step()
                record["param_diff"] = max(record["param_diff"], _max_diff(
                    list(eager.parameters()), list(ddp.parameters())))
    finally:
        dist.all_reduce = real_all_reduce
    state = erase_ddp.state_of(ddp)
    record.update(
        numel=numel,
        graphs=len(reports),
        blocks=sum(len(r.blocks) for r in reports),
        stats=dict(state.stats) if state is not None else None,
        unsupported=state.unsupported if state is not None else None,
    )
    return record


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _max_diff(a: list[Any], b: list[Any]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            if (x is None) != (y is None):
                return float("inf")
            continue
        worst = max(worst, (x.detach() - y.detach()).abs().max().item())
    return worst


def _other_backend_still_splits() -> dict[str, Any]:
    """A DDP model compiled with a stock backend in the same process: DDPOptimizer splits it."""
    from graphs import Chain, chain_inputs

    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Chain(3, hidden=HIDDEN), bucket_cap_mb=BUCKET_MB)
    torch.compile(model, backend=counting_backend)(*chain_inputs()).backward()
    return {"graphs": len(graphs), "optimize_ddp": torch._dynamo.config.optimize_ddp}


def _worker(rank: int, init_file: str, names: list[str], queue: Any) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    results: dict[str, Any] = {}
    try:
        for name in names:
            try:
                started = time.perf_counter()
                results[name] = _run_scenario(rank, name, SCENARIOS[name])
                results[name]["seconds"] = time.perf_counter() - started
            except Exception as error:  # noqa: BLE001 - reported to the test in the parent
                results[name] = {"error": f"{type(error).__name__}: {error}\n"
                                          f"{traceback.format_exc()}"}
        results["other_backend"] = _other_backend_still_splits()
    finally:
        queue.put((rank, results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, Any]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    init = tmp_path_factory.mktemp("ddp") / "init"
    return spawn_ranks(_worker, WORLD, (str(init), list(SCENARIOS)), timeout=600)


def _each_rank(records: dict[int, Any], name: str) -> list[dict[str, Any]]:
    return each_rank(records, name, WORLD)


@pytest.mark.parametrize("name", ["default", "no_sync", "find_unused", "static_graph",
                                  "bucket_view", "towers", "early_off"])
def test_gradients_and_parameters_equal_eager_ddp_bitwise(records, name):
    for record in _each_rank(records, name):
        assert record["grad_diff"] == 0.0
        assert record["param_diff"] == 0.0


@pytest.mark.parametrize("name", ["default", "find_unused", "static_graph", "bucket_view",
                                  "towers", "inductor", "early_off", "scaled_loss"])
def test_every_early_block_is_found_under_default_ddp(records, name):
    for record in _each_rank(records, name):
        assert record["expected_blocks"] > 0
        assert record["graphs"] == 1
        assert record["blocks"] == record["expected_blocks"]


@pytest.mark.parametrize("name", ["default", "find_unused", "static_graph", "bucket_view",
                                  "towers", "inductor", "scaled_loss"])
def test_each_gradient_is_all_reduced_once_per_step(records, name):
    for record in _each_rank(records, name):
        assert record["reduced_per_step"] == [record["numel"]] * len(record["reduced_per_step"])
        assert record["stats"]["early_grads"] > 0
        assert record["stats"]["early_collectives"] > 0


def test_early_gradients_are_all_reduced_before_the_forward_returns(records):
    for record in _each_rank(records, "default"):
        assert record["reduced_in_forward"] and all(n > 0 for n in record["reduced_in_forward"])
        assert all(n < total for n, total in zip(record["reduced_in_forward"],
                                                 record["reduced_per_step"]))


def test_ddp_skips_what_was_reduced_early(records):
    for record in _each_rank(records, "default"):
        stats = record["stats"]
        # 2 early blocks of 8 parameters each, skipped by DDP's buckets at each of 3 steps
        assert stats["early_grads"] == stats["hook_skipped"] == 3 * 16
        assert stats["early_collectives"] == 3 * 2


def test_scaled_loss_within_rounding(records):
    for record in _each_rank(records, "scaled_loss"):
        assert record["grad_diff"] < 1e-5
        assert record["param_diff"] < 1e-5


def test_inductor_inside_within_rounding(records):
    for record in _each_rank(records, "inductor"):
        assert record["grad_diff"] < 1e-5
        assert record["param_diff"] < 1e-5


def test_no_sync_accumulates_locally_and_ddp_reduces_at_the_synced_step(records):
    for record in _each_rank(records, "no_sync"):
        assert record["early_in_no_sync"] == 0
        # the synced step after accumulation: DDP reduces everything, nothing early, once
        assert record["reduced_per_step"] == [record["numel"]] * 3
        assert record["stats"].get("early_collectives", 0) == 0
        assert record["stats"].get("hook_skipped", 0) == 0


def test_early_allreduce_off_leaves_ddp_alone(records):
    for record in _each_rank(records, "early_off"):
        assert record["stats"] is None  # no state, no communication hook
        assert record["reduced_per_step"] == [0, 0, 0]  # DDP's C++ reducer, not dist.all_reduce


def test_a_gradient_with_a_term_outside_the_graph_is_reduced_by_ddp(records):
    for record in _each_rank(records, "shared_head"):
        assert record["grad_diff"] < 1e-6
        assert record["param_diff"] < 1e-6
        assert record["graphs"] == 2
        # step 1: head 0 reduced early, then again by DDP once its second term showed up;
        # after that, known to be read by two graphs, it is left to DDP: once per step
        first, *rest = record["reduced_per_step"]
        assert first > record["numel"]
        assert rest == [record["numel"]] * len(rest)


def test_a_gradient_added_to_a_kept_grad_is_reduced_by_ddp_again(records):
    """zero_grad(set_to_none=False): from the second step on .grad exists when the early
    gradient is added, so DDP reduces the sum (exact: the average of equal halves)."""
    for record in _each_rank(records, "grads_kept"):
        assert record["grad_diff"] == 0.0 and record["param_diff"] == 0.0
        assert record["stats"]["early_grads"] == 3 * 16
        assert record["stats"]["hook_skipped"] == 16  # the first step, when .grad was None
        first, *rest = record["reduced_per_step"]
        assert first == record["numel"] and all(n > record["numel"] for n in rest)


def test_a_user_communication_hook_turns_early_allreduce_off(records):
    for record in _each_rank(records, "user_hook"):
        assert "communication hook" in record["unsupported"]
        assert record["grad_diff"] == 0.0 and record["param_diff"] == 0.0
        assert record["blocks"] == record["expected_blocks"]


def test_a_ddp_model_without_early_blocks_is_split_as_usual(records):
    for record in _each_rank(records, "plain"):
        assert record["expected_blocks"] == 0
        assert record["graphs"] > 1  # Dynamo's DDP optimizer split it, as for stock backends
        assert record["grad_diff"] == 0.0 and record["param_diff"] == 0.0


def test_other_ddp_models_in_the_process_are_still_split(records):
    for rank in range(WORLD):
        other = records[rank]["other_backend"]
        assert other["graphs"] > 1
        assert other["optimize_ddp"] is True


