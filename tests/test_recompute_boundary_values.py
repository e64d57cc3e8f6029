"""recompute_boundary_values: a block's segment recomputes the cheap elementwise values it reads
from its stage (a tanh GELU's pieces, casts) instead of reading them across its boundary."""
import copy
import dataclasses
import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from erase_fx.config import EraseConfig, Tuning
from erase_fx.errors import GraphInvariantError
from erase_fx.passes import get_meta, pipeline
from erase_fx.passes.graph import val_of
from erase_fx.passes.pass_result import PassContext
from erase_fx.passes.recompute_boundary_values import (
    _Planner,
    block_segments,
    check_boundary_values,
    plan_recomputes,
    recomputable,
)
from graphs import Stages, assert_same_grads

aten = torch.ops.aten


class GeluStage(nn.Module):
    """Pre-LN MLP with a tanh GELU and a residual, then a local head (a transformer's MLP)."""

    def __init__(self, d: int = 16, classes: int = 5):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, labels):
        h = x + self.down(F.gelu(self.up(self.norm(x)), approximate="tanh"))
        return h, F.cross_entropy(self.head(h), labels)


class GeluChain(nn.Module):
    def __init__(self, stages: int = 3, d: int = 16):
        super().__init__()
        self.stages = nn.ModuleList(GeluStage(d) for _ in range(stages))

    def forward(self, x, labels):
        loss = 0
        for stage in self.stages:
            x, local = stage(x, labels)
            loss = loss + local
            x = x.detach()
        return loss


def gelu_inputs(batch: int = 6, d: int = 16):
    return torch.randn(batch, d), torch.randint(0, 5, (batch,))


def gelu_stages(recompute: bool = True, stages_on_side: bool | None = None) -> Stages:
    torch.manual_seed(0)
    cfg = EraseConfig(inner="inductor",
                      tuning=Tuning(recompute_boundary_values=recompute,
                                    stages_on_side=stages_on_side))
    return Stages(GeluChain(), gelu_inputs(), cfg, inner="inductor")


def boundary_ops(gm) -> list[list[str]]:
    """Per block segment, the ops of the values it reads from outside (graph inputs left out)."""
    return [sorted(str(getattr(v.target, "overloadpacket", v.target)).split(".")[-1]
                   for v in segment.reads if v.op == "call_function")
            for segment in block_segments(gm.graph)]


@pytest.mark.parametrize("stages_on_side", [False, True])
def test_a_blocks_gelu_pieces_are_recomputed_from_the_matmul_output(stages_on_side):
    stages = gelu_stages(stages_on_side=stages_on_side)
    result = stages.recomputed
    assert result.modified
    recomputed = result.artifact.recomputed
    assert len(recomputed) == 2  # the two early blocks (the last block stays in the backward)
    for where, names in recomputed.items():
        assert result.artifact.bytes_after[where] < result.artifact.bytes_before[where]
    # the GELU's tanh is not read across a boundary any more; the matmul output it is made
    # from is, and nothing left pays to recompute
    for ops in boundary_ops(result.gm):
        assert "tanh" not in ops, ops
        assert "addmm" in ops, ops
    assert plan_recomputes(result.gm.graph) == []
    # each copy is its block's, on the block's stream, and no stage reads one
    for node in result.gm.graph.nodes:
        if "_recomputed_block_" in node.name:
            meta = get_meta(node)
            assert meta.block is not None and not meta.stage and meta.stream != 0
            assert all(not get_meta(u).stage for u in node.users if u.op != "output")


def test_without_the_pass_the_gelu_pieces_cross():
    """The property above fails with the option off: the tanh is read across the boundary."""
    stages = gelu_stages(recompute=False)
    assert not stages.recomputed.modified and stages.recomputed.gm is stages.assigned.gm
    assert all("tanh" in ops for ops in boundary_ops(stages.recomputed.gm))
    assert plan_recomputes(stages.recomputed.gm.graph)


def test_the_segments_compute_what_they_computed(monkeypatch):
    """Erase with Inductor inside trains like eager, with the pass on and off, and the pass
    did recompute values in the compiled graph."""
    ran = []
    real = pipeline.RECOMPUTE_BOUNDARY_VALUES.run

    def spy(gm, ctx):
        result = real(gm, ctx)
        ran.append(result.modified)
        return result

    monkeypatch.setattr(pipeline.RECOMPUTE_BOUNDARY_VALUES, "run", spy)
    torch.manual_seed(0)
    model = GeluChain()
    for recompute in (True, False):
        eager, erased = copy.deepcopy(model), copy.deepcopy(model)
        compiled = torch.compile(erased, backend="erase", options={
            "inner": "inductor", "on_error": "raise",
            "tuning": {"recompute_boundary_values": recompute}})
        for _ in range(2):
            inputs = gelu_inputs()
            for module in (eager, erased):
                module.zero_grad(set_to_none=True)
            eager(*inputs).backward()
            compiled(*inputs).backward()
            assert_same_grads(eager, erased, rtol=1e-4, atol=1e-5)
        torch._dynamo.reset()
    assert ran[0] is True and ran[-1] is False


def traced(fn, *args):
    return make_fx(fn, pre_dispatch=False)(*args)


def test_what_is_recomputable():
    def f(x, w):
        noise = torch.rand_like(x)
        y = (x.tanh() * (noise > 0.5)) @ w
        z = y.t().to(torch.bfloat16)
        top = torch.topk(z.float(), 2)
        return z, top.values, torch.full((2,), 3.0) + 1

    gm = traced(f, torch.randn(4, 4), torch.randn(4, 4))
    by_op = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            by_op.setdefault(node.target, node)
    assert recomputable(by_op[aten.tanh.default])
    assert recomputable(by_op[aten.t.default])  # a view
    assert recomputable(by_op[aten.full.default])  # a constant
    assert recomputable(by_op[torch.ops.aten._to_copy.default]) is False  # not elementwise-tagged
    assert not recomputable(by_op[aten.rand_like.default])  # draws random numbers
    assert not recomputable(by_op[aten.mm.default])  # matrix work
    assert not recomputable(by_op[aten.topk.default])  # several values out
    assert not any(recomputable(n) for n in gm.graph.nodes if n.op == "placeholder")


def test_a_chain_pays_only_when_its_new_inputs_are_smaller():
    def f(x, w):
        y = x @ w  # the segment's boundary: matrix work, read as it is
        wider = torch.ops.prims.convert_element_type.default(y, torch.float64)
        return y[:, :2].exp(), y.exp(), wider, y.exp().tanh()

    gm = traced(f, torch.randn(8, 8), torch.randn(8, 8))
    out = [n for n in gm.graph.nodes if n.op == "output"][0]
    narrow, same, wider, deeper = out.args[0]
    planner = _Planner(gm.graph)
    planner.returned = set()  # as if these were not the forward's outputs
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    assert planner.pays(narrow, reads=set()) is None  # needs all of y for a quarter of it
    assert planner.pays(same, reads=set()) is None  # as many bytes in as out: no gain
    assert planner.pays(wider, reads=set()) == [wider]  # twice the bytes out
    assert planner.pays(same, reads={mm}) == [same]  # y is read anyway: free
    assert planner.pays(deeper, reads={mm}) == [deeper.args[0], deeper]  # the whole chain
    assert val_of(wider).dtype == torch.float64


def test_an_operand_of_matrix_work_is_never_recomputed():
    """A cast read by a product would be written out again by a kernel of its own: it stays
    read across the boundary."""
    def f(x, w, g):
        y = x @ w
        cast = torch.ops.prims.convert_element_type.default(y, torch.float64)
        return cast @ g.double()

    gm = traced(f, torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8))
    planner = _Planner(gm.graph)
    planner.returned = set()
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    cast = next(n for n in gm.graph.nodes
                if n.target is torch.ops.prims.convert_element_type.default)
    products = {u for u in cast.users if u.target is aten.mm.default}
    assert planner.pays(cast, reads={mm}) == [cast]  # no product in the segment reads it
    assert planner.pays(cast, reads={mm}, members=products) is None


def test_a_view_holds_no_memory_of_its_own():
    """Recomputing a view frees nothing: it never pays, and the boundary's bytes count its
    base once."""
    def f(x, w):
        y = x @ w
        return y.t(), y.t().exp(), torch.ops.prims.convert_element_type.default(y.t(),
                                                                                 torch.float64)

    gm = traced(f, torch.randn(8, 8), torch.randn(8, 8))
    planner = _Planner(gm.graph)
    planner.returned = set()
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    views = [n for n in gm.graph.nodes if n.target is aten.t.default]
    wider = next(n for n in gm.graph.nodes
                 if n.target is torch.ops.prims.convert_element_type.default)
    assert planner.pays(views[0], reads={mm}) is None
    assert planner.pays(views[0], reads=set()) is None
    # a chain through a new view: the view holds y (256 bytes) for 512 bytes of float64
    assert planner.pays(wider, reads=set()) == [wider.args[0], wider]
    from erase_fx.passes.recompute_boundary_values import _Segment
    segment = _Segment((1, 0, None), set(), {mm, *views})
    assert planner.boundary_bytes(segment) == 8 * 8 * 4  # y once, through its views


def test_a_value_the_forward_returns_is_read_as_it_is():
    """A returned value (saved for the backward) exists past the join: never recomputed."""
    def f(x, w):
        return torch.ops.prims.convert_element_type.default(x @ w, torch.float64)

    gm = traced(f, torch.randn(8, 8), torch.randn(8, 8))
    planner = _Planner(gm.graph)
    value = next(n for n in gm.graph.nodes
                 if n.target is torch.ops.prims.convert_element_type.default)
    assert recomputable(value)
    assert planner.free(value) and planner.pays(value, reads=set()) is None
    planner.returned = set()
    assert planner.pays(value, reads=set()) == [value]  # the same value, not returned


def test_a_long_chain_is_not_copied(monkeypatch):
    module = importlib.import_module("erase_fx.passes.recompute_boundary_values")

    def f(x, w):
        y = x @ w
        for _ in range(5):
            y = y.exp()
        return torch.ops.prims.convert_element_type.default(y, torch.float64)

    gm = traced(f, torch.randn(8, 8), torch.randn(8, 8))
    planner = _Planner(gm.graph)
    planner.returned = set()
    value = next(n for n in gm.graph.nodes
                 if n.target is torch.ops.prims.convert_element_type.default)
    assert len(planner.pays(value, reads=set())) == 6
    monkeypatch.setattr(module, "MAX_CHAIN", 5)
    assert planner.pays(value, reads=set()) is None


def test_the_check_refuses_a_copy_outside_a_block_segment():
    """A copy moved into its block's stage (same stream, so the stream invariants hold)."""
    from erase_fx.passes.node_meta import set_meta
    from erase_fx.passes.pass_result import PassResult

    stages = gelu_stages()
    gm = copy.deepcopy(stages.recomputed.gm)
    moved = next(n for n in gm.graph.nodes if "_recomputed_block_" in n.name)
    set_meta(moved, dataclasses.replace(get_meta(moved), stage=True))
    with pytest.raises(GraphInvariantError, match="not in a block segment"):
        check_boundary_values(PassResult(gm, True, stages.recomputed.artifact),
                              PassContext.of(stages.cfg))


def test_the_check_refuses_a_value_left_that_pays():
    stages = gelu_stages(recompute=False)
    with pytest.raises(GraphInvariantError, match="pays to recompute"):
        check_boundary_values(stages.recomputed, PassContext.of(
            EraseConfig(tuning=Tuning(recompute_boundary_values=True))))


def test_the_report_and_explain_say_what_the_segments_recompute():
    import erase_fx
    from erase_fx.report_text import format_report

    torch.manual_seed(0)
    (report,) = erase_fx.explain(GeluChain(), *gelu_inputs(),
                                 erase_options={"inner": "inductor"})
    assert report.recomputed_values > 0
    assert 0 < report.boundary_bytes_after < report.boundary_bytes_before
    assert (f"the block segments recompute {report.recomputed_values} values instead of "
            "reading them across their boundaries") in format_report(report)
    assert report.with_fallback("injected").recomputed_values == 0
    (off,) = erase_fx.explain(GeluChain(), *gelu_inputs(), erase_options={
        "inner": "inductor", "tuning": {"recompute_boundary_values": False}})
    assert off.recomputed_values == 0 and "recompute" not in format_report(off)
