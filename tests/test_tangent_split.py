"""Losses as users write them: one-element ``[1]`` losses, and outputs besides the loss whose
gradients a block's backward reads (tensors kept for logging, activations hooks capture,
local losses returned beside the total).

The backward is linear in all its tangents together, ``B(T, g) = B(T, 0) + B(0, g)``: the loss
term's part runs early, the other outputs' part stays in the backward, and costs nothing when
they get no gradient (`specialize_unused_tangents`, `erase_fx.emit.live_tangents`).
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import erase_fx
from erase_fx.config import EraseConfig
from erase_fx.emit import live_tangents
from erase_fx.passes import RejectReason, Role, get_meta, run_pass
from erase_fx.passes.graph import is_tangent, output_values, upstream_of_seed
from erase_fx.passes.pipeline import FIND_STOP_GRADIENT_BLOCKS, SPECIALIZE_UNUSED_TANGENTS
from graphs import (
    Chain,
    HookedChain,
    LoggedChain,
    LossAndLocalLosses,
    OneElementLossChain,
    SlotLossChain,
    Stages,
    assert_outputs_close,
    assert_same_grads,
    chain_inputs,
    check_parity,
    real_values,
    run_joint,
    trace_joint,
)

aten = torch.ops.aten
CFG = EraseConfig(inner="aot_eager")


def analyse(model, *inputs):
    joint = trace_joint(model, *inputs)
    found = run_pass(FIND_STOP_GRADIENT_BLOCKS, joint.gm, CFG,
                     num_fwd_outputs=joint.num_fwd_outputs)
    return joint, found.artifact


# -- one-element losses ---------------------------------------------------------------


def test_a_loss_of_shape_one_makes_blocks_as_a_0d_loss_does():
    _, zero_d = analyse(Chain(4), *chain_inputs())
    _, one = analyse(OneElementLossChain(4), *chain_inputs())
    assert len(one.blocks) == len(zero_d.blocks) == 3
    assert [r.reason for r in one.rejected] == [RejectReason.LAST_BLOCK]


def test_a_loss_of_shape_one_is_seeded_in_its_shape_and_scaled_as_0d():
    stages = Stages(OneElementLossChain(3), chain_inputs(), CFG)
    gm = stages.scheduled.gm
    seeds = [n for n in gm.graph.nodes
             if n.target is aten.full.default and (m := get_meta(n)) and m.block is not None]
    assert [s.args[0] for s in seeds] == [[1], [1]]
    grads = [g for g in output_values(gm.graph)[stages.joint.num_fwd_outputs:]
             if g is not None and get_meta(g) is not None and get_meta(g).role is Role.GRAD_SCALE]
    scales = {g.args[1] for g in grads}
    assert scales and all(s.target is aten.view.default and s.args[1] == [] for s in scales)


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_a_loss_of_shape_one_trains_as_eager(scale):
    # NB: bitwise at T == 1; at T == 3, T * grad(1) and grad(T) round differently
    check_parity(OneElementLossChain(3), chain_inputs, loss_of=lambda loss: scale * loss,
                 rtol=0 if scale == 1 else 1e-5, atol=0 if scale == 1 else 1e-6)


# -- losses written into the slots of one tensor -------------------------------------------


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_losses_written_into_slots_of_one_tensor_are_seeded_at_their_element(inner):
    """``losses[:, k] = local`` then ``losses.sum().backward()``: the tangent is ``[1, K]``;
    each block reads its element of it (select, copy and sum: what autograd makes of the
    slot writes), one element, through which the early copy is seeded."""
    joint = trace_joint(SlotLossChain(3), *chain_inputs(), inner=inner)
    analysis = run_pass(FIND_STOP_GRADIENT_BLOCKS, joint.gm, CFG,
                        num_fwd_outputs=joint.num_fwd_outputs).artifact
    assert len(analysis.blocks) == 2
    assert [r.reason for r in analysis.rejected] == [RejectReason.LAST_BLOCK]
    for block in analysis.blocks:
        assert block.loss_seed and block.loss_seed != block.tangent


def test_the_seeds_that_make_an_element_seed_are_what_the_backward_computes_before_it():
    """`upstream_of_seed` (find_stop_gradient_blocks' linearity check and
    schedule_early_backward's copy both read it): the block's seeds the element is made of
    from the tangent, it included, and none of those that read it; none for a tangent."""
    joint = trace_joint(SlotLossChain(3), *chain_inputs())
    analysis = run_pass(FIND_STOP_GRADIENT_BLOCKS, joint.gm, CFG,
                        num_fwd_outputs=joint.num_fwd_outputs).artifact
    by_name = {n.name: n for n in joint.gm.graph.nodes}
    for block in analysis.blocks:
        seeds = set(block.component.seeds)
        upstream = upstream_of_seed(by_name[block.loss_seed], seeds)
        assert block.loss_seed in upstream and upstream < seeds
        assert all(is_tangent(a) or a.name in upstream
                   for name in upstream for a in by_name[name].all_input_nodes)
        assert upstream_of_seed(by_name[block.tangent], seeds) == set()


class SlotMeanOfTerms(SlotLossChain):
    """Each slot holds the mean of several loss terms on the block's output (InfoNCE's
    prediction steps): the block's seed is the slot's element, not the element divided by
    the number of terms (scaling by that after would round the gradients once more)."""

    def forward(self, x, labels):
        losses = torch.zeros(1, len(self.stages))
        h = x
        for k, (stage, head) in enumerate(zip(self.stages, self.heads)):
            h = stage(h)
            terms = [F.cross_entropy(head(torch.roll(h, shift, 0)), labels) for shift in range(3)]
            losses[:, k] = sum(terms) / len(terms)
            h = h.detach()
        return losses


@pytest.mark.parametrize("model", [SlotLossChain, SlotMeanOfTerms], ids=["slot", "mean-of-terms"])
@pytest.mark.parametrize("weights", [None, (1.0, 3.0, 0.5)], ids=["sum", "weighted"])
def test_losses_written_into_slots_train_as_eager(model, weights):
    def loss_of(losses):
        return losses.sum() if weights is None else (losses * torch.tensor([weights])).sum()

    exact = weights is None
    with erase_fx.collect_reports() as reports:
        check_parity(model(3), chain_inputs, loss_of=loss_of,
                     rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)
    assert [len(r.blocks) for r in reports] == [2]


# -- other outputs' tangents --------------------------------------------------------------


@pytest.mark.parametrize("model", [LoggedChain, HookedChain, LossAndLocalLosses],
                         ids=["logged", "hooked", "local-losses"])
def test_blocks_that_read_other_outputs_gradients_run_early(model):
    _, analysis = analyse(model(3), *chain_inputs())
    assert len(analysis.blocks) == 2
    assert all(b.other_tangents for b in analysis.blocks)
    assert {r.reason for r in analysis.rejected} == {RejectReason.LAST_BLOCK}


def test_the_loss_tangent_is_the_accumulated_loss_not_a_local_one_beside_it():
    joint, analysis = analyse(LossAndLocalLosses(3), *chain_inputs())
    outputs = output_values(joint.gm.graph)
    total = outputs[0]
    by_name = {n.name: n for n in joint.gm.graph.nodes}
    for block in analysis.blocks:
        desc = by_name[block.tangent].meta["desc"]
        assert desc.output.idx == 0, f"block {block.id} seeded for {desc}, not the total loss"
        assert total is not None


@pytest.mark.parametrize("model", [LoggedChain, LossAndLocalLosses], ids=["logged", "local-losses"])
def test_the_rewritten_joint_graph_equals_the_original_for_any_tangents(model):
    """B(T, g) = T/s * B(s, 0) + B(0, g) on real values: every output, random tangents."""
    stages = Stages(model(3), chain_inputs(), CFG)
    values = real_values(stages.joint.gm, generator=torch.Generator().manual_seed(0))
    expected = run_joint(stages.joint.gm, values)
    assert_outputs_close(run_joint(stages.scheduled.gm, values), expected)


def test_the_early_copy_reads_no_tangent_and_the_late_part_is_added():
    stages = Stages(LoggedChain(3), chain_inputs(), CFG)
    gm = stages.scheduled.gm
    reads: set = set()
    for node in gm.graph.nodes:
        if is_tangent(node) or any(a in reads for a in node.all_input_nodes):
            reads.add(node)
        meta = get_meta(node)
        assert not (meta and meta.role is Role.EARLY_BACKWARD and node in reads), node.name
    grads = output_values(gm.graph)[stages.joint.num_fwd_outputs:]
    added = [g for g in grads if g is not None and g.target is aten.add.Tensor]
    assert added and all(get_meta(g.args[0]).role is Role.GRAD_SCALE for g in added)


def test_the_specialized_backward_reads_no_unused_tangent_and_equals_the_whole_at_zero():
    stages = Stages(LoggedChain(3), chain_inputs(), CFG)
    unused = sorted({t for b in stages.analysis.blocks for t in b.other_tangents})
    lean = run_pass(SPECIALIZE_UNUSED_TANGENTS, stages.bw, CFG, unused_tangents=unused)
    assert lean.modified and lean.gm is not stages.bw
    placeholders = {n.name: n for n in lean.gm.graph.find_nodes(op="placeholder")}
    assert all(not placeholders[name].users for name in unused)
    assert len(lean.gm.graph.nodes) < len(stages.bw.graph.nodes)
    values = real_values(stages.bw, generator=torch.Generator().manual_seed(1))
    for name in unused:
        values[name] = torch.zeros_like(values[name])
    args = [values[n.name] for n in stages.bw.graph.find_nodes(op="placeholder")]
    expected = stages.bw(*args)
    actual = lean.gm(*args)
    assert_outputs_close(list(actual), list(expected))


class _Chosen:
    """Counts which backward `SelectedBackward` runs."""

    def __init__(self, monkeypatch):
        self.lean = self.whole = 0
        original = live_tangents.SelectedBackward.__call__

        def call(selected, args):
            live = selected.live.take()
            selected.live._seen.live = live
            if live is False:
                self.lean += 1
            else:
                self.whole += 1
            return original(selected, args)

        monkeypatch.setattr(live_tangents.SelectedBackward, "__call__", call)


@pytest.mark.parametrize("model", [LoggedChain, HookedChain, LossAndLocalLosses],
                         ids=["logged", "hooked", "local-losses"])
def test_outputs_nobody_differentiates_cost_nothing_and_grads_are_bitwise_eager(model,
                                                                                 monkeypatch):
    chosen = _Chosen(monkeypatch)
    loss_of = (lambda out: out[0]) if model is LossAndLocalLosses else (lambda out: out)
    check_parity(model(3), chain_inputs, loss_of=loss_of, steps=3, rtol=0, atol=0)
    assert (chosen.lean, chosen.whole) == (3, 0)


def test_outputs_that_get_a_gradient_are_added_exactly(monkeypatch):
    chosen = _Chosen(monkeypatch)
    eager, erased = LoggedChain(3), None
    erased = copy.deepcopy(eager)
    compiled = torch.compile(erased, backend="erase",
                             options={"inner": "aot_eager", "on_error": "raise"})
    for _ in range(2):
        inputs = chain_inputs()
        for module in (eager, erased):
            module.zero_grad(set_to_none=True)
        for module, run in ((eager, eager), (erased, compiled)):
            loss = run(*inputs)
            (loss + 0.5 * module.logged[0].sum() - module.logged[1].square().sum()).backward()
        assert_same_grads(eager, erased)
    assert (chosen.lean, chosen.whole) == (0, 2)


def test_local_losses_differentiated_instead_of_the_total_equal_stock_aot_eager(monkeypatch):
    """NB: against stock aot_eager, not eager: a compiled graph hands zeros, where eager has
    None, to a parameter that only an output without a gradient reaches (stage 1's here)."""
    chosen = _Chosen(monkeypatch)
    model = LossAndLocalLosses(3)
    stock, erased = copy.deepcopy(model), copy.deepcopy(model)
    runs = [(stock, torch.compile(stock, backend="aot_eager")),
            (erased, torch.compile(erased, backend="erase",
                                   options={"inner": "aot_eager", "on_error": "raise"}))]
    for _ in range(2):
        inputs = chain_inputs()
        for module, run in runs:
            module.zero_grad(set_to_none=True)
            _, local_losses = run(*inputs)
            (local_losses[0] + local_losses[2]).backward()
        assert_same_grads(stock, erased)
        assert torch.count_nonzero(erased.stages[1][0].weight.grad) == 0
    assert (chosen.lean, chosen.whole) == (0, 2)


def test_with_inductor_the_split_blocks_equal_stock_inductor():
    torch.manual_seed(0)
    model = LoggedChain(3)
    stock, erased = copy.deepcopy(model), copy.deepcopy(model)
    runs = [(stock, torch.compile(stock, backend="inductor")),
            (erased, torch.compile(erased, backend="erase", options={"on_error": "raise"}))]
    for _ in range(2):
        inputs = chain_inputs()
        for module, run in runs:
            module.zero_grad(set_to_none=True)
            run(*inputs).backward()
        assert_same_grads(stock, erased, rtol=1e-5, atol=1e-6)


def test_explain_names_the_other_outputs_where_the_users_code_makes_them():
    from erase_fx.report_text import format_reports

    reports = erase_fx.explain(LoggedChain(3), *chain_inputs())
    (report,) = reports
    block = report.blocks[0]
    # NB: the forward sets self.logged: Dynamo reaches the parameters through __dict__
    assert block.params[0] == "stages.0.0.weight"
    (other,) = block.other_outputs
    assert other.startswith("mean, made at ") and "graphs.py:" in other
    assert other.endswith("self.logged.append(h.mean(0))")
    text = " ".join(format_reports(reports).split())
    assert "(+1 output)" in text
    assert "block 0 also reads the gradients of: mean, made at" in text


def test_a_block_that_reads_no_loss_names_the_outputs_it_reads():
    class LocalOutput(Chain):
        def forward(self, x, labels):
            h = self.stages[0](x)
            local = self.heads[0](h)  # a head without a loss
            return F.cross_entropy(self.heads[1](self.stages[1](h.detach())), labels), local

    (report,) = erase_fx.explain(LocalOutput(2), *chain_inputs())
    rejected = [r for r in report.rejected if r.reason == "not_scalar_tangent"]
    assert rejected  # the head's weights and stage 0's
    for row in rejected:
        assert "the outputs it reads the gradients of: local, made at" in row.detail
        assert "local = self.heads[0](h)" in row.detail


# -- losses that get no gradient --------------------------------------------------------


class NormKept(Chain):
    """Stage 0's only use besides the next stage is a one-element value kept with grad for
    logging (``self.norm = h.pow(2).mean()``): erase takes it for stage 0's loss."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.stages[0](x)
        self.norm = h.pow(2).mean()
        h = h.detach()
        loss = x.new_zeros(())
        for stage, head in zip(self.stages[1:], self.heads[1:]):
            h = stage(h)
            loss = loss + F.cross_entropy(head(h), labels)
            h = h.detach()
        return loss


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == live_tangents.log.name and r.levelname == "WARNING"]


def test_a_loss_that_gets_no_gradient_is_named_once_with_the_fix(caplog):
    (report,) = erase_fx.explain(NormKept(3), *chain_inputs())
    assert len(report.blocks) == 2  # stage 0 (seeded at the norm) and stage 1
    # NB: against stock aot_eager: stage 0 gets zeros from a compiled graph, None in eager
    stock = NormKept(3)
    erased = copy.deepcopy(stock)
    runs = [(stock, torch.compile(stock, backend="aot_eager")),
            (erased, torch.compile(erased, backend="erase",
                                   options={"inner": "aot_eager", "on_error": "raise"}))]
    with caplog.at_level("WARNING", logger="erase_fx.emit.live_tangents"):
        for _ in range(3):
            inputs = chain_inputs()
            for module, run in runs:
                module.zero_grad(set_to_none=True)
                run(*inputs).backward()
            assert_same_grads(stock, erased, rtol=0, atol=0)
    (warning,) = _warnings(caplog)
    assert "got no gradient at this backward" in warning and "block 0" in warning
    assert "self.norm = h.pow(2).mean()" in warning and "h.detach().norm()" in warning


def test_losses_that_get_their_gradient_warn_nothing(caplog):
    eager = NormKept(3)
    erased = copy.deepcopy(eager)
    compiled = torch.compile(erased, backend="erase",
                             options={"inner": "aot_eager", "on_error": "raise"})
    with caplog.at_level("WARNING", logger="erase_fx.emit.live_tangents"):
        for _ in range(2):
            inputs = chain_inputs()
            for module, run in ((eager, eager), (erased, compiled)):
                module.zero_grad(set_to_none=True)
                (run(*inputs) + 0.1 * module.norm).backward()
            assert_same_grads(eager, erased)
        check_parity(LoggedChain(3), chain_inputs, steps=2, rtol=0, atol=0)
    assert not _warnings(caplog)


def test_local_losses_beside_a_total_not_differentiated_are_named(caplog):
    model = LossAndLocalLosses(3)
    compiled = torch.compile(model, backend="erase",
                             options={"inner": "aot_eager", "on_error": "raise"})
    with caplog.at_level("WARNING", logger="erase_fx.emit.live_tangents"):
        _, local_losses = compiled(*chain_inputs())
        local_losses[0].backward()
    (warning,) = _warnings(caplog)
    assert "block 0, block 1" in warning and "sum(locals_)" in warning
