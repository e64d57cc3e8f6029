"""Blocks at the graph's end: the last block of a graph runs when its forward ends, the main
stream does not wait for it, and a forward whose backward never comes stops paying for it
(`erase_fx.emit.graph_end`)."""
import copy
import gc
import os
import re
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from erase_fx.config import EraseConfig, Tuning
from erase_fx.emit import graph_end as graph_end_module
from erase_fx.passes import RejectReason, run_pass
from erase_fx.passes.pipeline import FIND_STOP_GRADIENT_BLOCKS
from erase_fx.report import collect_reports
from graphs import (
    Chain,
    GraphBreakChain,
    LoggedChain,
    OneElementLossChain,
    Stages,
    assert_same_grads,
    chain_inputs,
    check_parity,
    real_values,
    trace_joint,
)
from test_program import build

CFG = EraseConfig(inner="aot_eager")


@pytest.fixture
def programs(monkeypatch):
    """Every `GraphEnd` made while the test runs, in order."""
    made = []
    original = graph_end_module.GraphEnd.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(graph_end_module.GraphEnd, "__init__", init)
    return made


def compiled(model, **options):
    return torch.compile(model, backend="erase",
                         options={"inner": "aot_eager", "on_error": "raise", **options})


def test_the_last_block_runs_at_the_graphs_end_when_the_caller_allows_it():
    joint = trace_joint(Chain(3), *chain_inputs())
    found = run_pass(FIND_STOP_GRADIENT_BLOCKS, joint.gm, CFG,
                     num_fwd_outputs=joint.num_fwd_outputs, graph_end=True)
    analysis = found.artifact
    assert [b.at_graph_end for b in analysis.blocks] == [False, False, True]
    assert analysis.rejected == ()
    before = run_pass(FIND_STOP_GRADIENT_BLOCKS, joint.gm, CFG,
                      num_fwd_outputs=joint.num_fwd_outputs).artifact
    assert [r.reason for r in before.rejected] == [RejectReason.LAST_BLOCK]


def test_a_graph_that_ends_at_a_break_runs_every_block_early_bitwise_as_eager():
    with collect_reports() as reports:
        check_parity(GraphBreakChain(), chain_inputs, steps=3, rtol=0, atol=0)
    first, second = reports
    assert [b.at_graph_end for b in first.blocks] == [False, True]
    assert first.rejected == () and first.early_share == 1.0
    # the last graph ends at the forward's return: only the backward follows it
    assert [b.at_graph_end for b in second.blocks] == [False]
    assert [r.reason for r in second.rejected] == ["last_block"]


@pytest.mark.parametrize("model", [Chain, OneElementLossChain, LoggedChain],
                         ids=["chain", "one-element-loss", "logged"])
def test_a_graph_that_ends_at_the_forwards_return_keeps_its_last_block_in_the_backward(model):
    with collect_reports() as reports:
        check_parity(model(3), chain_inputs, rtol=0, atol=0)
    (report,) = reports
    assert not any(b.at_graph_end for b in report.blocks)
    assert [r.reason for r in report.rejected] == ["last_block"]


def test_the_main_stream_leaves_the_wait_for_the_graph_end_block_to_the_backward():
    stages = Stages(Chain(3), chain_inputs(),
                    EraseConfig(inner="aot_eager", streams=3, tuning=Tuning(stages_on_side=False)),
                    graph_end=True)
    program, streams = build(stages)
    values = real_values(stages.fw)
    program([values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")])
    trace = streams.trace
    # the last stage's block runs on stream 3 once the main stream made its inputs; the loss
    # sum waits for blocks 0 and 1 (their losses), the join too, and stream 3 is left running
    assert trace[-6:] == [("wait", 3, (0,)), ("run", 3),
                          ("wait", 0, (1, 2)), ("run", 0),
                          ("join", (1, 2)), ("defer", (3,))]
    assert program.graph_end.pending == [3]


@pytest.mark.parametrize("width", [1, 2])
def test_on_fewer_cuda_streams_the_main_stream_still_leaves_the_graph_end_block(width):
    """With ``side_cuda_streams`` folding stream 3 (the graph-end block) onto CUDA stream 1,
    which runs block 0 (and block 1 with one stream), the join waits for no CUDA stream
    that runs the graph-end block: the main stream waits for the event after that stream's
    last other step, and the event after the block is left to the backward."""
    from erase_fx.emit.streams import fold

    stages = Stages(Chain(3), chain_inputs(),
                    EraseConfig(inner="aot_eager", streams=3, tuning=Tuning(stages_on_side=False)),
                    graph_end=True)
    program, streams = build(stages, side_cuda_streams=width)
    values = real_values(stages.fw)
    program([values[n.name] for n in stages.fw.graph.find_nodes(op="placeholder")])
    trace = streams.trace
    (joined,) = [entry[1] for entry in trace if entry[0] == "join"]
    (deferred,) = [entry[1] for entry in trace if entry[0] == "defer"]
    assert deferred == (1,) and not {fold(s, width) for s in joined} & set(deferred)
    # NB: the trace names the streams join is given; it folds them as it waits
    assert trace[-7:] == [("wait", 1, (0,)), ("run", 1),  # the graph-end block, on stream 1
                          ("wait", 0, (1, 1 if width == 1 else 2)), ("run", 0),
                          ("join", () if width == 1 else (2,)),
                          ("wait_events", 0, (1,)), ("defer", (1,))]
    assert program.graph_end.pending == [1]


def test_a_forward_whose_backward_never_comes_disarms_after_one_waste(programs):
    model = GraphBreakChain()
    run = compiled(model)
    x, y = chain_inputs()
    run(x, y).backward()
    (graph_end,) = programs
    assert graph_end.armed
    for _ in range(3):
        run(x, y)  # a metric with grad enabled: the outputs are dropped, no backward
        gc.collect()
    assert not graph_end.armed and "without a backward" in graph_end.disarmed_reason


def test_disarmed_the_backward_runs_the_blocks_and_equals_eager_bitwise(programs, monkeypatch):
    ran = []
    run_graph_end = graph_end_module.GraphEndBackward.__call__

    def call(self, args):
        ran.append(any(self.graph_end.stashed(args[i]) is not None for i, _ in self.gradients))
        return run_graph_end(self, args)

    monkeypatch.setattr(graph_end_module.GraphEndBackward, "__call__", call)
    eager = GraphBreakChain()
    erased = copy.deepcopy(eager)
    run = compiled(erased)
    for step in range(3):
        inputs = chain_inputs()
        for module in (eager, erased):
            module.zero_grad(set_to_none=True)
        eager(*inputs).backward()
        loss = run(*inputs)
        if step == 0:
            programs[0].disarm("the test")
        if step > 0:
            assert len(programs[0]._stashes) == 1
        loss.backward()
        del loss
        gc.collect()
        assert not programs[0]._stashes
        assert_same_grads(eager, erased, rtol=0, atol=0)
    assert ran == [False, True, True]


def test_two_forwards_then_one_backward_keep_the_program_armed(programs):
    eager = GraphBreakChain()
    erased = copy.deepcopy(eager)
    run = compiled(erased)
    a, b = chain_inputs(), chain_inputs()
    (eager(*a) + eager(*b)).backward()
    (run(*a) + run(*b)).backward()
    gc.collect()
    assert_same_grads(eager, erased, rtol=0, atol=0)
    assert programs[0].armed


class LoggedItem(nn.Module):
    """Detached blocks whose local losses are logged with ``.item()`` in the forward: a
    graph break in each block's step (Dynamo then compiles each call of ``local_step`` on
    its own: a break inside a loop cannot resume in the middle of ``forward``)."""

    def __init__(self, blocks: int = 3, d: int = 16, classes: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU())
                                    for _ in range(blocks))
        self.heads = nn.ModuleList(nn.Linear(d, classes) for _ in range(blocks))
        self.logged: list[float] = []

    def local_step(self, i, h, labels):
        h = self.blocks[i](h.detach())
        local = F.cross_entropy(self.heads[i](h), labels)
        self.logged.append(local.item())
        return h, local

    def forward(self, x, labels):
        loss, h = 0, x
        for i in range(len(self.blocks)):
            h, local = self.local_step(i, h, labels)
            loss = loss + local
        return loss


def test_blocks_separated_by_item_calls_all_run_early():
    with collect_reports() as reports:
        check_parity(LoggedItem(), chain_inputs, rtol=0, atol=0)
    # a graph per block (a call of local_step, recompiled per i), each ending at .item()
    blocks = [b for r in reports for b in r.blocks]
    assert len(blocks) >= 3 and all(b.at_graph_end for b in blocks)
    assert all(not r.rejected for r in reports)


def test_with_inductor_the_blocks_at_the_graphs_end_equal_stock_inductor():
    torch.manual_seed(0)
    model = GraphBreakChain()
    stock, erased = copy.deepcopy(model), copy.deepcopy(model)
    runs = [(stock, torch.compile(stock, backend="inductor")),
            (erased, torch.compile(erased, backend="erase", options={"on_error": "raise"}))]
    for _ in range(2):
        inputs = chain_inputs()
        for module, run in runs:
            module.zero_grad(set_to_none=True)
            run(*inputs).backward()
        assert_same_grads(stock, erased, rtol=1e-5, atol=1e-6)


def test_a_block_at_the_graphs_end_has_no_gradient_an_optimizer_may_update_early():
    """A disarmed program leaves the block to the backward: its gradients are not there
    during every forward (`erase_fx.early_grads`)."""
    from erase_fx.early_grads import plan_early_grads

    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager"), graph_end=True)
    at_end = {b.id for b in stages.analysis.blocks if b.at_graph_end}
    grads = plan_early_grads(stages.fw, stages.bw, stages.joint.num_fwd_outputs)
    assert at_end == {2} and grads
    assert {g.block for g in grads} == {0, 1}


class LocalBlock(nn.Module):
    """A stage and its local head and loss, in one module: ``(h, loss)``."""

    def __init__(self, d: int = 16, hidden: int = 32, classes: int = 5):
        super().__init__()
        self.stage = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))
        self.head = nn.Linear(d, classes)

    def forward(self, h, labels):
        h = self.stage(h)
        return h, F.cross_entropy(self.head(h), labels)


class CompiledPerBlock(nn.Module):
    """Detached blocks, each compiled on its own (``block.compile(...)``, as per-layer
    compilation of large models does), under an uncompiled forward that sums their losses."""

    def __init__(self, blocks: int = 3, **options):
        super().__init__()
        self.blocks = nn.ModuleList(LocalBlock() for _ in range(blocks))
        self.options = options

    def compile_blocks(self):
        for block in self.blocks:
            block.compile(backend="erase",
                          options={"inner": "aot_eager", "on_error": "raise", **self.options})

    def forward(self, x, labels):
        loss, h = 0, x
        for block in self.blocks:
            h, local = block(h.detach(), labels)
            loss = loss + local
        return loss


def test_blocks_compiled_one_by_one_under_an_uncompiled_forward_all_run_early(programs):
    torch.manual_seed(0)
    eager = CompiledPerBlock()
    erased = copy.deepcopy(eager)
    erased.compile_blocks()
    with collect_reports() as reports:
        for _ in range(3):
            inputs = chain_inputs()
            for module in (eager, erased):
                module.zero_grad(set_to_none=True)
                module(*inputs).backward()
            assert_same_grads(eager, erased, rtol=0, atol=0)
    # one graph for the three blocks (Dynamo's cache): the rest of the caller's forward
    # follows it, so its block, last in the graph, runs at the graph's end
    assert [[b.at_graph_end for b in r.blocks] for r in reports] == [[True]]
    assert all(not r.rejected for r in reports)
    assert programs and all(p.armed for p in programs)


def test_only_torchs_own_folder_is_looked_past_not_a_sibling_package():
    from erase_fx.backend import is_internal_source
    from erase_fx.graph_breaks import TORCH_ROOT

    assert is_internal_source(TORCH_ROOT + "nn/modules/module.py")
    sibling = TORCH_ROOT.rstrip(os.sep) + "vision" + os.sep + "models" + os.sep + "resnet.py"
    assert not is_internal_source(sibling)  # torchvision's forward is a user's forward


def test_the_caller_of_a_compiled_frame_is_found_past_torch_and_dynamos_frames():
    """Pins what `called_from_a_forward` reads (torch 2.11-2.14): the stack a backend runs
    on holds the compiled frame's caller, and a resume function's caller runs code Dynamo
    made."""
    from erase_fx.backend import called_from_a_forward

    seen = []

    def backend(gm, example_inputs):
        seen.append(called_from_a_forward(sys._getframe(1)))
        return gm.forward

    class Outer(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) + 1

    class Broken(nn.Module):
        def forward(self, x):
            x = x * 2
            torch._dynamo.graph_break()
            return x + 1

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(2))

        def forward(self, x):
            return x * self.weight

    x = torch.randn(2)
    torch._dynamo.reset()
    torch.compile(Broken(), backend=backend)(x)   # the frame, then the resume function
    inner = Scale()
    inner.compile(backend=backend)
    Outer(inner)(x)                                 # a module's forward calls it
    torch._dynamo.reset()
    torch.compile(Scale(), backend=backend)(x)      # called from this test
    assert seen == [False, False, True, False]


class HandBackwardInForward(nn.Module):
    """InfoPro's habit: a local decoder, compiled on its own, whose weighted loss the
    forward backwards by hand before it goes on with the detached features."""

    def __init__(self, weight: float):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.decoder = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
                                     nn.ReLU(), nn.Conv2d(8, 3, 1), nn.Sigmoid())
        self.local_loss = LocalDecoderLoss(self.decoder)
        self.head = nn.Linear(8, 5)
        self.weight = weight

    def forward(self, images, labels):
        x = self.stem(images)
        (self.weight * self.local_loss(x, images)).backward()
        x = x.detach().mean((2, 3))
        return F.cross_entropy(self.head(x), labels)


class LocalDecoderLoss(nn.Module):
    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, features, images):
        return F.binary_cross_entropy(self.decoder(features), images)


@pytest.mark.parametrize("weight", [1.0, 0.3])
def test_a_local_loss_backwarded_inside_the_forward_runs_at_its_graphs_end(weight):
    """Bitwise as the stock backend where the loss gradient is the seed (1); where it is not,
    the early gradients are made for 1 and multiplied by 0.3 in the backward: one rounding
    more, no more (`erase_fx.emit.scale_grads`)."""
    torch.manual_seed(0)
    stock = HandBackwardInForward(weight)
    erased = copy.deepcopy(stock)
    stock.local_loss.compile(backend="aot_eager")
    erased.local_loss.compile(backend="erase", options={"inner": "aot_eager", "on_error": "raise"})
    with collect_reports() as reports:
        images, labels = torch.rand(4, 3, 8, 8), torch.randint(0, 5, (4,))
        for module in (stock, erased):
            module(images, labels).backward()
    assert [[b.at_graph_end for b in r.blocks] for r in reports] == [[True]]
    if weight == 1.0:
        assert_same_grads(stock, erased, rtol=0, atol=0)
    else:
        assert_same_grads(stock, erased, rtol=1e-6, atol=1e-7)


class CheckpointedBlocks(CompiledPerBlock):
    """`CompiledPerBlock` with each block under activation checkpointing: the backward runs
    each compiled forward again, its early work included, for the tensors it saves."""

    def forward(self, x, labels):
        from torch.utils.checkpoint import checkpoint

        loss, h = 0, x
        for block in self.blocks:
            h, local = checkpoint(block, h.detach(), labels, use_reentrant=False)
            loss = loss + local
        return loss


def test_blocks_compiled_one_by_one_under_activation_checkpointing_equal_eager(programs):
    torch.manual_seed(0)
    eager = CheckpointedBlocks()
    erased = copy.deepcopy(eager)
    erased.compile_blocks()
    for _ in range(3):
        inputs = chain_inputs()
        for module in (eager, erased):
            module.zero_grad(set_to_none=True)
            module(*inputs).backward()
        assert_same_grads(eager, erased, rtol=0, atol=0)
    # NB: the recompute stops once the compiled forward has saved its tensors, before it
    # returns: no autograd node of it is ever watched, and the program stays armed
    assert programs and programs[0].armed


@pytest.mark.parametrize("model", [Chain, OneElementLossChain, LoggedChain],
                         ids=["chain", "one-element-loss", "logged"])
def test_graph_end_at_return_runs_a_single_graphs_last_block_at_its_end(model, tmp_path):
    """With ``tuning.graph_end_at_return`` the last block of a graph that ends at the
    forward's return runs at the forward's end too: every block early, bitwise as eager, and
    the backward computes nothing but the scaling (its compiled graph only passes the early
    gradients on; with logged outputs, their part when they get a gradient)."""
    options = {"tuning": {"graph_end_at_return": True}, "dump_dir": str(tmp_path)}
    with collect_reports() as reports:
        check_parity(model(3), chain_inputs, options=options, rtol=0, atol=0)
    (report,) = reports
    assert [b.at_graph_end for b in report.blocks] == [False, False, True]
    assert report.rejected == () and report.early_share == 1.0
    if model is LoggedChain:
        return  # NB: the logged outputs' part runs in the backward when they get a gradient
    backward = next(tmp_path.rglob("*_defer_grad_scaling.py")).read_text()
    code = backward.split("def forward", 1)[1].split("# erase_fx node decisions", 1)[0]
    # the early gradients returned as they are, with the tangent (viewed 0-d: the scale)
    assert set(re.findall(r"torch\.ops\.([\w.]+)", code)) <= {"aten.view.default"}


def test_graph_end_at_return_is_off_by_default_and_validated():
    assert Tuning().graph_end_at_return is False
    from erase_fx.errors import EraseOptionError

    with pytest.raises(EraseOptionError, match="graph_end_at_return"):
        Tuning(graph_end_at_return="yes")



def test_a_forward_under_capture_whose_graph_is_freed_keeps_the_program_armed(programs,
                                                                               monkeypatch):
    """A forward run under CUDA graph capture is not watched: a capture that fails partway
    (a host sync later in the step) frees its autograd graph without a backward, and
    compile_step then runs the step as written, which must keep the blocks at the graph's end
    and erase's own CUDA graph of the forward."""
    run = compiled(GraphBreakChain())
    x, y = chain_inputs()
    run(x, y).backward()
    (graph_end,) = programs
    monkeypatch.setattr(graph_end_module, "stream_capturing", lambda: True)
    for _ in range(2):
        run(x, y)  # as under a capture that fails after this forward
        gc.collect()
    assert graph_end.armed
    monkeypatch.setattr(graph_end_module, "stream_capturing", lambda: False)
    run(x, y)
    gc.collect()
    assert not graph_end.armed  # outside capture, the same pattern disarms


def test_a_captured_backward_neither_waits_nor_takes_the_pending_events(monkeypatch):
    """Under capture a backward belongs to a captured (or replayed) forward, which joined its
    blocks at its end: it waits for nothing (a wait under capture on an event recorded
    outside it is an error), and leaves the events of forwards run without a graph to their
    own backwards."""
    graph_end = graph_end_module.GraphEnd("test")
    graph_end.pending = ["event of an uncaptured forward"]
    waited = []
    backward = graph_end_module.GraphEndBackward(
        lambda args: ["grads"], graph_end, [], run_stashed=None, wait=waited.append)
    monkeypatch.setattr(graph_end_module, "stream_capturing", lambda: True)
    assert backward([]) == ["grads"]
    assert waited == [] and graph_end.pending == ["event of an uncaptured forward"]
    monkeypatch.setattr(graph_end_module, "stream_capturing", lambda: False)
    assert backward([]) == ["grads"]
    assert waited == [["event of an uncaptured forward"]] and graph_end.pending == []
