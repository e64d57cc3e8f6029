"""Auxiliary heads on a trunk without detach (GoogLeNet): each head's part runs early
although the trunk's own multi-branch blocks sum gradients between the head's
branch point and the main loss; where a part cannot, explain says why in the
model's words; gradients equal eager."""
import pytest

import erase_fx
from erase_fx.config import EraseConfig
from erase_fx.passes import RejectReason, run_pass
from erase_fx.passes.pipeline import FIND_STOP_GRADIENT_BLOCKS
from erase_fx.passes.split_at_sums import is_sum
from erase_fx.report_text import DETAIL_WIDTH, format_report
from graphs import (
    AuxTrunk,
    AuxTrunkClipped,
    AuxTrunkSplit,
    Chain,
    TinyGoogLeNet,
    chain_inputs,
    check_parity,
    googlenet_inputs,
    trace_joint,
)

AUX1 = tuple(f"aux1.{m}.{w}" for m in ("conv", "fc1", "fc2") for w in ("weight", "bias"))
AUX2 = tuple(p.replace("aux1", "aux2") for p in AUX1)
AUX = tuple(f"aux.{i}.{w}" for i in (0, 2) for w in ("weight", "bias"))
#: Every part early, however small: the tests of how parts are split and run. The cost
#: check that keeps small parts in the backward by default has its own section below.
ALL_PARTS = {"tuning": {"min_part_share": 0.0}}


def explained(model, inputs, **options):
    (report,) = erase_fx.explain(model, *inputs(), erase_options={**ALL_PARTS, **options})
    return report


def analysed(model, inputs, inner="aot_eager"):
    if inner == "inductor":
        # NB: Inductor's max_pool2d decomposition reads torch._inductor.lowering, which only
        # compile_fx imports; trace_joint uses the decompositions without compile_fx.
        import torch._inductor.lowering  # noqa: F401
    joint = trace_joint(model, *inputs(), inner=inner)
    found = run_pass(FIND_STOP_GRADIENT_BLOCKS, joint.gm, EraseConfig(inner=inner, **ALL_PARTS),
                     num_fwd_outputs=joint.num_fwd_outputs)
    return joint, found.artifact


# -- which parts run early ---------------------------------------------------


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_googlenet_aux_heads_run_early_through_any_number_of_inception_blocks(blocks):
    report = explained(TinyGoogLeNet(blocks), googlenet_inputs)
    assert [b.params for b in report.blocks] == [AUX1, AUX2]
    assert [b.partials for b in report.blocks] == [1, 1]  # each hands over its input's gradient
    assert [b.pieces for b in report.blocks] == [0, 0]
    main, rest = report.rejected
    assert (main.reason, rest.reason) == ("last_block", "joins_blocks")
    # the main loss's part: the head and the blocks after the last branch point
    assert {p.split(".")[0] for p in main.params} == {"inc5", "fc"}
    assert {p.split(".")[0] for p in rest.params} == {"stem", "inc3", "inc4"}


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_the_main_loss_part_runs_through_the_trunks_own_branch_sums(inner, blocks):
    joint, analysis = analysed(TinyGoogLeNet(blocks), googlenet_inputs, inner)
    assert len(analysis.blocks) == 2
    main, rest = analysis.rejected
    by_name = {n.name: n for n in joint.gm.graph.nodes}
    # each Inception block after aux2 sums its three branches' input gradients (2 adds);
    # one term's sums, so they stay in its part; the sum with aux2's gradient is the rest's
    assert sum(is_sum(by_name[n]) for n in main.component.nodes) == 2 * blocks
    assert [m.terms for m in rest.meetings] == [
        ("the loss through aux2", "the loss through fc"),
        ("the loss through aux1", "the loss through aux2", "the loss through fc")]
    assert [m.where for m in rest.meetings] == [
        f"the gradient of an output of inc4.{blocks - 1}, which aux2 and inc5.0 read",
        "the gradient of an output of inc3, which aux1 and inc4.0 read"]
    # each aux part hands its gradient of the branch point to the meeting's sums
    joins = {m.node for m in rest.meetings}
    for block in analysis.blocks:
        (partial,) = block.component.partials
        assert {u.name for u in by_name[partial].users} <= joins | set(rest.component.nodes)


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_an_aux_head_before_linear_branch_blocks_runs_early(blocks):
    report = explained(AuxTrunk(blocks), chain_inputs)
    assert [(b.params, b.partials) for b in report.blocks] == [(AUX, 1)]
    assert [(r.reason, r.params) for r in report.rejected][1] == (
        "joins_blocks", ("stem.0.weight", "stem.0.bias"))


# -- the cost check: a part too small to pay for its boundary ---------------------


def test_small_aux_heads_stay_in_the_backward_by_default_and_say_why():
    (report,) = erase_fx.explain(TinyGoogLeNet(2), *googlenet_inputs())
    assert report.blocks == () and report.fallback_reason == "no early block"
    assert [(r.reason, r.params) for r in report.rejected][:2] == [
        ("small_part", AUX1), ("small_part", AUX2)]
    assert [r.reason for r in report.rejected][2:] == ["last_block", "joins_blocks"]
    share = report.rejected[0].flops / report.backward_flops
    assert report.rejected[0].detail.startswith(
        f"its backward is {share:.1%} of the graph's estimated backward FLOPs, under "
        f"min_part_share (5.0%)")
    assert report.rejected[0].detail.endswith("(the loss through aux1, up to where it meets the "
                                              "other loss terms)")


def test_min_part_share_is_the_line_between_early_and_kept():
    (every,) = erase_fx.explain(AuxTrunk(2), *chain_inputs(), erase_options=ALL_PARTS)
    (part,) = every.blocks
    share = part.flops / every.backward_flops
    assert 0.05 < share < 1  # the default runs it early
    (below,) = erase_fx.explain(AuxTrunk(2), *chain_inputs(),
                                erase_options={"tuning": {"min_part_share": share * 0.99}})
    (above,) = erase_fx.explain(AuxTrunk(2), *chain_inputs(),
                                erase_options={"tuning": {"min_part_share": share * 1.01}})
    assert [b.params for b in below.blocks] == [AUX]
    assert above.blocks == () and above.rejected[0].reason == RejectReason.SMALL_PART


def test_whole_blocks_are_not_held_to_min_part_share():
    # each block of a detached chain is a whole component: early at any share
    (report,) = erase_fx.explain(Chain(4), *chain_inputs(),
                                 erase_options={"tuning": {"min_part_share": 1.0}})
    assert len(report.blocks) == 3


def test_small_parts_kept_back_train_as_stock():
    # with the parts in the backward nothing runs early: the stock path, equal to eager
    (report,) = reports_of(lambda: check_parity(TinyGoogLeNet(2), googlenet_inputs, steps=2,
                                                rtol=0, atol=0))
    assert report.blocks == () and report.fallback_reason == "no early block"


# -- why a part cannot run early, in words ----------------------------------------


def test_explain_names_the_modules_where_the_loss_terms_meet():
    main, rest = explained(TinyGoogLeNet(2), googlenet_inputs).rejected
    assert main.detail.endswith("(the loss through fc, up to where it meets the other loss "
                                "terms)")
    assert rest.detail.startswith("adds up the gradient parts of 3 loss terms")
    assert ("the losses through aux2 and fc meet in the gradient of an output of inc4.1, "
            "which aux2 and inc5.0 read") in rest.detail
    assert "node" not in rest.detail and rest.node is None


def test_a_part_that_cannot_run_early_says_why_in_the_models_words():
    # the aux head clips its gradient, the main loss is last: the component stays whole
    (rejected,) = explained(AuxTrunkClipped(2), chain_inputs).rejected
    assert rejected.reason == "last_block"
    assert ("2 loss terms meet in it only in sums of gradients (the losses through aux and "
            "head meet in the gradient of an output of stem.1") in rejected.detail
    assert ("no term's part can run early on its own (the loss through aux: "
            "aten.clamp.default is not known to be linear") in rejected.detail


def test_a_term_that_meets_the_others_outside_a_sum_stays_in_the_rest_and_says_so():
    report = explained(AuxTrunkSplit(2), chain_inputs)
    assert [b.params for b in report.blocks] == [AUX]
    (rest,) = report.rejected
    assert rest.reason == RejectReason.JOINS_BLOCKS
    assert ("the loss through head meets the others in cat (the backward of chunk), not in a "
            "sum of gradients") in rest.detail


def test_the_table_wraps_each_reason_under_its_row():
    report = explained(TinyGoogLeNet(2), googlenet_inputs)
    lines = format_report(report).splitlines()
    start = lines.index("  left in the backward:")
    rows = [line for line in lines[start + 2:] if line.startswith("    ") and
            line.split()[0] in ("last_block", "joins_blocks")]
    assert len(rows) == 2
    detail = lines[lines.index(rows[1]) + 1:]
    words = []
    for line in detail:
        if not line.startswith("      "):
            break
        assert len(line) <= DETAIL_WIDTH
        words.append(line.strip())
    assert " ".join(words) == report.rejected[1].detail


# -- gradients equal eager --------------------------------------------------------


def reports_of(fn):
    with erase_fx.collect_reports() as reports:
        fn()
    return reports


@pytest.mark.parametrize("model, inputs, blocks", [
    (lambda: TinyGoogLeNet(2), googlenet_inputs, 2),
    (lambda: AuxTrunk(3), chain_inputs, 1),
    (lambda: AuxTrunkSplit(2), chain_inputs, 1),
])
def test_aux_heads_equal_eager_bitwise_with_aot_eager(model, inputs, blocks):
    # NB: with T = 1 the early parts equal eager's values, and the sums add them in eager's order
    (report,) = reports_of(lambda: check_parity(model(), inputs, options=ALL_PARTS, steps=2,
                                                    rtol=0, atol=0))
    assert len(report.blocks) == blocks and report.fallback_reason is None


@pytest.mark.parametrize("model, inputs, loss_of", [
    (lambda: TinyGoogLeNet(2), googlenet_inputs, lambda loss: 3.0 * loss),
    (lambda: AuxTrunk(2, weight=2.5), chain_inputs, lambda loss: 0.5 * loss),
])
def test_aux_heads_with_scaled_or_weighted_losses_equal_eager(model, inputs, loss_of):
    (report,) = reports_of(lambda: check_parity(model(), inputs, options=ALL_PARTS, steps=2,
                                                loss_of=loss_of, rtol=1e-5, atol=1e-6))
    assert report.blocks


@pytest.mark.parametrize("model, inputs, loss_of, blocks", [
    (lambda: TinyGoogLeNet(2), googlenet_inputs, lambda loss: loss, 2),
    (lambda: AuxTrunk(2), chain_inputs, lambda loss: 3.0 * loss, 1),
])
def test_aux_heads_equal_eager_with_inductor(model, inputs, loss_of, blocks):
    (report,) = reports_of(lambda: check_parity(model(), inputs, steps=2, loss_of=loss_of,
                                                options={"inner": "inductor", **ALL_PARTS},
                                                rtol=1e-4, atol=1e-5))
    assert len(report.blocks) == blocks and report.fallback_reason is None
