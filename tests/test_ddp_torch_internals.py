"""What `erase_fx.ddp` relies on in torch, pinned (torch 2.11 and 2.13; one CPU process, gloo).

Each test names one internal and checks it still exists and behaves as
relied on; if torch changes it, the test says which part of erase_fx.ddp to
revisit. A world of one process is enough: Dynamo's DDP optimizer splits by
bucket size, not by world size.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import erase_fx
from erase_fx import ddp as erase_ddp
from graphs import Chain, Stages, chain_inputs

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
#: about 1 MiB of weights per stage: 1 MB buckets split the chain
HIDDEN = 8192


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_optimizer_compile_fn_is_wrapped_and_keeps_its_signature():
    """erase_fx wraps ``DDPOptimizer.compile_fn(self, gm, example_inputs, **configs)`` and
    reads ``backend_compile_fn`` on the optimizer (torch/_dynamo/backends/distributed.py)."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    assert erase_ddp.keep_blocks_whole_under_ddp()
    original = DDPOptimizer.compile_fn._erase_fx_original
    assert list(inspect.signature(original).parameters)[:3] == ["self", "gm", "example_inputs"]
    optimizer = DDPOptimizer(bucket_bytes_cap=25 * 2**20, backend_compile_fn=print)
    assert optimizer.backend_compile_fn is print


def test_the_wrapper_is_installed_once_however_often_it_is_applied():
    from torch._dynamo.backends.distributed import DDPOptimizer

    wrapped = DDPOptimizer.compile_fn
    assert wrapped._erase_fx_original is not None  # erase's backend is defined: applied

    def another_backend(gm, example_inputs):
        return gm.forward

    assert erase_ddp.keeps_blocks_whole(another_backend) is another_backend
    assert erase_ddp.is_erase_backend(another_backend)
    assert erase_ddp.keep_blocks_whole_under_ddp()
    assert DDPOptimizer.compile_fn is wrapped


#: A fresh process: ``torch.compile(DDP(model), backend="erase")`` with no import of erase_fx
#: before it, then the same with the wrapper taken off. Prints each run's early collectives.
_FRESH_PROCESS = """
import json, sys, tempfile
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch._dynamo.backends.distributed import DDPOptimizer

class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(nn.Linear(16, 8192), nn.ReLU(),
                                                  nn.Linear(8192, 16)) for _ in range(3))
        self.heads = nn.ModuleList(nn.Linear(16, 5) for _ in range(3))

    def forward(self, x, labels):
        loss = x.new_zeros(())
        for stage, head in zip(self.stages, self.heads):
            x = stage(x)
            loss = loss + F.cross_entropy(head(x), labels)
            x = x.detach()
        return loss

def early_collectives():
    torch._dynamo.reset()
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Chain(), bucket_cap_mb=1.0)
    compiled = torch.compile(ddp, backend="erase",
                             options={"inner": "aot_eager", "on_error": "raise"})
    compiled(torch.randn(6, 16), torch.randint(0, 5, (6,))).backward()
    from erase_fx.ddp import state_of
    state = state_of(ddp)
    return 0 if state is None else state.stats["early_collectives"]

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0,
                        world_size=1)
record = {"wrapped_before": hasattr(DDPOptimizer.compile_fn, "_erase_fx_original"),
          "imported_before": "erase_fx" in sys.modules,
          "by_name": early_collectives()}
DDPOptimizer.compile_fn = DDPOptimizer.compile_fn._erase_fx_original
record["unwrapped"] = early_collectives()
dist.destroy_process_group()
print(json.dumps(record))
"""


def test_the_wrapper_is_in_place_before_dynamo_meets_ddp():
    """``backend="erase"`` in a fresh process: Dynamo's registry loads erase's backend, which
    installs the wrapper, before Dynamo meets the DDP module; the first graph stays whole
    (both blocks all-reduced early). Without the wrapper Dynamo's DDP optimizer splits that
    graph before any backend runs (no block left): why it cannot wait until DDP is met."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True,
                          text=True, timeout=600, check=True)
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record == {"wrapped_before": False, "imported_before": False, "by_name": 2,
                      "unwrapped": 0}


def test_dynamo_decides_the_split_from_the_global_flag_and_the_active_ddp_module():
    """convert_frame's CatchErrorsWrapper builds the DDP optimizer from
    ``get_optimize_ddp_mode()`` and ``DistributedDataParallel._get_active_ddp_module()``, with
    the backend as ``self._torchdynamo_orig_backend._torchdynamo_orig_backend``: no
    per-backend switch (why erase_fx wraps the optimizer rather than configuring it)."""
    from torch._dynamo import convert_frame

    source = inspect.getsource(convert_frame.CatchErrorsWrapper.__call__)
    assert "get_optimize_ddp_mode()" in source
    assert "_get_active_ddp_module()" in source
    assert "backend_compile_fn=self._torchdynamo_orig_backend._torchdynamo_orig_backend" in source
    assert torch._dynamo.config.optimize_ddp is True  # torch's default, left as it is


def test_erase_backend_is_recognised_through_torch_compiles_wrappers():
    """``torch.compile(backend="erase", options=...)`` reaches the DDP optimizer as
    ``WrapBackendDebug(_TorchCompileWrapper(erase_backend))``."""
    from torch._dynamo.eval_frame import get_compiler_fn

    for options in (None, {"inner": "aot_eager"}):
        wrapper = torch._TorchCompileWrapper("erase", None, options, None)
        assert erase_ddp.is_erase_backend(get_compiler_fn(wrapper))
    assert erase_ddp.is_erase_backend(get_compiler_fn(erase_fx.make_backend(inner="aot_eager")))
    assert not erase_ddp.is_erase_backend(get_compiler_fn(torch._TorchCompileWrapper(
        "aot_eager", None, None, None)))


def test_active_ddp_module_is_set_while_ddp_runs_the_wrapped_module(world_of_one):
    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            seen.append(erase_ddp.active_ddp_module())
            return super().forward(x)

    model = nn.parallel.DistributedDataParallel(Probe(2, 2))
    model(torch.randn(3, 2))
    assert seen == [model]
    assert erase_ddp.active_ddp_module() is None


def test_default_ddp_splits_stock_backends_and_keeps_erase_graphs_whole(world_of_one):
    """The behaviour the wrapper exists for, and that it leaves other backends alone."""
    torch.manual_seed(0)
    model = Chain(3, hidden=HIDDEN)
    inputs = chain_inputs()
    expected = sum(len(r.blocks) for r in erase_fx.explain(copy.deepcopy(model), *inputs))

    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    stock = nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=1.0)
    torch.compile(stock, backend=counting)(*inputs).backward()
    assert len(graphs) > 1  # DDPOptimizer split it at bucket boundaries

    torch._dynamo.reset()
    erased = nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=1.0)
    with erase_fx.collect_reports() as reports:
        compiled = torch.compile(erased, backend="erase",
                                 options={"inner": "aot_eager", "on_error": "raise"})
        compiled(*inputs).backward()
    assert len(reports) == 1
    assert len(reports[0].blocks) == expected == 2
    stats = erase_ddp.state_of(erased).stats
    assert stats["early_collectives"] == 2
    # AOTAutograd hands autograd the very gradient tensors its backward returned
    # (`DDPState.watch` relies on it), so DDP's buckets skip all 16 early ones
    assert stats["early_grads"] == stats["hook_skipped"] == 16


def test_comm_hook_bucket_holds_undivided_gradients_as_views_of_its_buffer(world_of_one):
    """With a communication hook, DDP copies gradients into the bucket undivided;
    ``bucket.gradients()`` are views of ``bucket.buffer()``, ``bucket.parameters()`` the
    module's own parameter objects, ``is_last()`` marks the last bucket."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    seen = []

    def hook(state, bucket):
        buffer = bucket.buffer()
        seen.append((bucket.is_last(), [
            (g.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(),
             g.storage_offset() - buffer.storage_offset(), g.clone())
            for g in bucket.gradients()], [any(p is q for q in model.parameters())
                                           for p in bucket.parameters()]))
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    ddp.register_comm_hook(None, hook)
    ddp(torch.randn(5, 4)).sum().backward()
    assert seen and seen[-1][0] is True
    for _, views, own in seen:
        assert all(own)
        assert all(shares for shares, _, _ in views)
        offsets = [offset for _, offset, _ in views]
        assert offsets == sorted(offsets)
    assert sum(len(v) for _, v, _ in seen) == len(list(model.parameters()))


def test_accumulate_grad_prehook_sees_the_very_tensor_a_backward_handed_out(world_of_one):
    """`DDPState.watch`: a pre-hook on a parameter's AccumulateGrad node
    (``torch.autograd.graph.get_gradient_edge``) receives the tensor a backward returned
    when it is the only term, and a new tensor when autograd summed two terms."""
    weight = nn.Parameter(torch.randn(3))
    handed = {}

    class Hand(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w.sum()

        @staticmethod
        def backward(ctx, grad):
            handed["grad"] = torch.ones(3) * grad
            return handed["grad"]

    seen = []
    node = torch.autograd.graph.get_gradient_edge(weight).node
    node.register_prehook(lambda grads: seen.append(grads[0] is handed["grad"]))
    Hand.apply(weight).backward()
    (Hand.apply(weight) + weight.sum()).backward()
    assert seen == [True, False]


def test_saved_tensors_are_named_after_the_forward_nodes_they_save():
    """`plan_early_grads` pairs backward inputs with forward outputs by name (the stock
    partitioners name each backward placeholder after the node it saves)."""
    stages = Stages(Chain(3), chain_inputs(), erase_fx.EraseConfig(inner="aot_eager"))
    fw_names = [getattr(v, "name", None) for v in stages.fw.graph.find_nodes(op="output")[0]
                .args[0]]
    saved = [n.name for n in stages.bw.graph.find_nodes(op="placeholder")
             if not n.name.startswith("tangents")]
    assert saved == fw_names[stages.joint.num_fwd_outputs:][:len(saved)]
