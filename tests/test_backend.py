"""End to end: torch.compile(model, backend="erase") against eager, on every parameter's grad.

Every check draws fresh random inputs at each step and compares after each
backward (fp32: rtol 1e-5, atol 1e-6).
"""
import copy

import pytest
import torch
import torch.nn as nn

import erase_fx
from graphs import (
    BatchNormBlocks,
    Chain,
    GraphBreakChain,
    TwoBlock,
    Towers,
    TowersInterleaved,
    TowersWithTop,
    TwoBlockNoDetach,
    TwoBlockOneLoss,
    TwoBlockSharedLayer,
    TwoBlockTwoOutputs,
    assert_same_grads,
    attention_chain,
    attention_inputs,
    chain_inputs,
    check_parity,
    select_chain,
    select_inputs,
    two_block_inputs,
)


def reports_of(fn):
    with erase_fx.collect_reports() as reports:
        fn()
    return reports


def test_backend_is_found_by_name_after_install():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("erase") is erase_fx.erase_backend


@pytest.mark.parametrize("inner", ["aot_eager", "eager"])
@pytest.mark.parametrize("model, inputs", [
    (TwoBlock, two_block_inputs),
    (lambda: Chain(4), chain_inputs),
])
def test_gradients_equal_eager(inner, model, inputs):
    reports = reports_of(lambda: check_parity(model(), inputs, options={"inner": inner}, steps=3))
    assert len(reports) == 1 and reports[0].blocks and reports[0].fallback_reason is None


@pytest.mark.parametrize("model, inputs, blocks", [
    (TwoBlock, two_block_inputs, 1),
    (lambda: Chain(3), chain_inputs, 2),
])
def test_gradients_equal_eager_with_inductor(model, inputs, blocks):
    reports = reports_of(lambda: check_parity(model(), inputs, options={"inner": "inductor"},
                                              steps=2, rtol=1e-4, atol=1e-5))
    assert len(reports[0].blocks) == blocks


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "written-out"])
def test_attention_blocks_go_early_with_inductor(fused):
    # NB: SDPA is a multi-output op whose logsumexp only the backward reads;
    # written-out attention's softmax backward decomposes to prims.fma.
    reports = reports_of(lambda: check_parity(attention_chain(3, fused=fused), attention_inputs,
                                              options={"inner": "inductor"}, steps=2,
                                              rtol=1e-4, atol=1e-5))
    assert len(reports[0].blocks) == 2 and reports[0].fallback_reason is None


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_tensor_constants_read_by_several_segments(inner):
    # NB: torch.tensor([...]) in the forward is a get_attr constant of the split
    # module, and index_select's backward is index_add into new_zeros.
    reports = reports_of(lambda: check_parity(select_chain(3), select_inputs,
                                              options={"inner": inner}, steps=2,
                                              rtol=1e-4, atol=1e-5))
    assert len(reports[0].blocks) == 2 and reports[0].fallback_reason is None


def test_model_with_one_loss_takes_the_stock_path():
    (report,) = reports_of(lambda: check_parity(TwoBlockOneLoss(), two_block_inputs))
    assert report.blocks == ()
    assert report.fallback_reason == "no early block"


def weighted_towers(out):
    return 0.3 * out[0] + out[1] + 2.0 * out[2]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("model, inputs, loss_of, blocks", [
    # no detach (deep supervision): head 1's part runs early
    (TwoBlockNoDetach, two_block_inputs, None, 1),
    # a layer both blocks use: block 1's part of its gradient runs early
    (TwoBlockSharedLayer, two_block_inputs, None, 1),
    # towers over a shared front: every tower but the last; the front waits for the sum
    (lambda: Towers(3), chain_inputs, None, 2),
    (lambda: Towers(3), chain_inputs, lambda out: 3.0 * out, 2),
    # one tangent per tower loss, each with its own weight
    (lambda: Towers(3, as_tuple=True), chain_inputs, weighted_towers, 2),
])
def test_parts_of_gradients_summed_in_the_backward_equal_eager(
        inner, model, inputs, loss_of, blocks):
    # NB: with aot_eager and T = 1 the sums add the same values as eager: bitwise equal
    tolerance = ({"rtol": 1e-4, "atol": 1e-5} if inner == "inductor"
                 else {} if loss_of else {"rtol": 0, "atol": 0})
    kwargs = {"loss_of": loss_of} if loss_of else {}
    # NB: head 1's part of TwoBlockNoDetach is under the default min_part_share
    options = {"inner": inner, "tuning": {"min_part_share": 0.0}}
    (report,) = reports_of(lambda: check_parity(model(), inputs, options=options,
                                                steps=2, **kwargs, **tolerance))
    assert len(report.blocks) == blocks
    assert [r.reason for r in report.rejected] == ["last_block", "joins_blocks"]


def test_loss_and_logits_both_in_the_final_backward():
    check_parity(TwoBlockTwoOutputs(), two_block_inputs,
                 loss_of=lambda out: out[0] + out[1].square().sum())


def test_scaled_loss_backward():
    check_parity(Chain(3), chain_inputs, loss_of=lambda loss: 3.0 * loss)


def test_batchnorm_buffers_update_as_in_eager():
    eager, erased = check_parity(BatchNormBlocks(), lambda: (torch.randn(8, 8),
                                                             torch.randint(0, 3, (8,))), steps=3)
    for (name, expected), (_, actual) in zip(eager.named_buffers(), erased.named_buffers()):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_frozen_parameters_get_no_grad():
    model = Chain(3)
    model.stages[0][0].weight.requires_grad_(False)
    model.heads[1].requires_grad_(False)
    eager, erased = check_parity(model, chain_inputs)
    assert erased.stages[0][0].weight.grad is None and erased.heads[1].weight.grad is None


def test_dynamic_shapes():
    batches = iter([5, 9, 7, 12])
    check_parity(Chain(3), lambda: chain_inputs(batch=next(batches)), dynamic=True, steps=4)


def test_bf16_autocast_on_cpu():
    class Autocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Chain(3)

        def forward(self, x, labels):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.inner(x, labels)

    reports = reports_of(lambda: check_parity(Autocast(), chain_inputs, rtol=2e-2, atol=2e-3))
    assert len(reports[0].blocks) == 2


def test_two_forwards_then_one_backward_of_their_sum():
    eager = Chain(3)
    erased = copy.deepcopy(eager)
    compiled = torch.compile(erased, backend="erase", options={"inner": "aot_eager", "on_error": "raise"})
    first, second = chain_inputs(), chain_inputs()
    (eager(*first) + eager(*second)).backward()
    (compiled(*first) + compiled(*second)).backward()
    assert_same_grads(eager, erased)


def test_forward_without_backward_leaves_grads_untouched():
    eager = Chain(3)
    erased = copy.deepcopy(eager)
    compiled = torch.compile(erased, backend="erase", options={"inner": "aot_eager", "on_error": "raise"})
    compiled(*chain_inputs())  # computes early grads, which must not reach .grad
    assert all(p.grad is None for p in erased.parameters())
    inputs = chain_inputs()
    eager(*inputs).backward()
    compiled(*inputs).backward()
    assert_same_grads(eager, erased)


def test_gradient_accumulation_over_several_backwards():
    eager, erased = Chain(3), None
    erased = copy.deepcopy(eager)
    compiled = torch.compile(erased, backend="erase", options={"inner": "aot_eager", "on_error": "raise"})
    for _ in range(3):  # no zero_grad: grads accumulate
        inputs = chain_inputs()
        eager(*inputs).backward()
        compiled(*inputs).backward()
    assert_same_grads(eager, erased)


def test_no_grad_forward_matches_eager_and_reports_inference():
    model = Chain(3)
    compiled = torch.compile(copy.deepcopy(model), backend="erase", options={"inner": "aot_eager"})
    inputs = chain_inputs()
    with erase_fx.collect_reports() as reports, torch.no_grad():
        actual = compiled(*inputs)
    torch.testing.assert_close(actual, model(*inputs))
    assert reports[0].blocks == () and "inference" in reports[0].fallback_reason


def test_graph_break_compiles_each_graph_with_its_own_blocks():
    reports = reports_of(lambda: check_parity(GraphBreakChain(), chain_inputs))
    assert len(reports) == 2
    # stages 0-1 in graph 0, which ends at the break: stage 1 runs at its end
    # (erase_fx.emit.graph_end); stages 2-3 in graph 1, whose last block stays in the backward
    assert [len(r.blocks) for r in reports] == [2, 1]
    assert [r.reason for r in reports[1].rejected] == ["last_block"]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("model", [TowersWithTop, TowersInterleaved])
def test_a_block_in_pieces_equals_eager(inner, model):
    """Towers under a top model: one early block, launched in pieces (each tower's part,
    then the shared front's backward)."""
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if inner == "inductor" else {"rtol": 0, "atol": 0}
    (report,) = reports_of(lambda: check_parity(model(3), chain_inputs, steps=2,
                                                options={"inner": inner}, **tolerance))
    assert [b.pieces for b in report.blocks] == [4]
    assert [r.reason for r in report.rejected] == ["last_block"]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_no_side_stream_compiles_the_forward_as_one_graph(inner, monkeypatch):
    # streams=0: the early backward still runs in the forward (the same blocks),
    # but the forward is one compiled graph: no segments, no StreamProgram.
    from erase_fx import compilation
    from erase_fx.report_text import format_report

    def no_segments(*args, **kwargs):
        raise AssertionError("streams=0 compiled the forward in segments")

    monkeypatch.setattr(compilation.GraphCompilation, "_compile_segments", no_segments)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if inner == "inductor" else {}
    reports = reports_of(lambda: check_parity(Chain(3), chain_inputs, steps=2,
                                              options={"inner": inner, "streams": 0},
                                              **tolerance))
    (report,) = reports
    assert len(report.blocks) == 2 and report.fallback_reason is None
    assert "no side stream (the forward in one graph)" in format_report(report)
