"""erase_fx.explain: one report per graph, K-1 blocks for a K-stage chain, the model untouched."""
import json

import pytest
import torch

import erase_fx
from erase_fx import GraphReport
from erase_fx.report import Whereabouts
from erase_fx.report_text import format_report
from graphs import BatchNormBlocks, Chain, TwoBlockOneLoss, chain_inputs, two_block_inputs


@pytest.mark.parametrize("stages", [2, 3, 6])
def test_chain_of_k_stages_reports_k_minus_1_early_blocks(stages):
    (report,) = erase_fx.explain(Chain(stages), *chain_inputs())
    assert len(report.blocks) == stages - 1
    assert [b.stream for b in report.blocks] == [1 + i % 4 for i in range(stages - 1)]
    for i, block in enumerate(report.blocks):
        assert set(block.params) == {
            f"stages.{i}.0.weight", f"stages.{i}.0.bias", f"stages.{i}.2.weight",
            f"stages.{i}.2.bias", f"stages.{i}.3.weight", f"stages.{i}.3.bias",
            f"heads.{i}.weight", f"heads.{i}.bias",
        }
        assert block.num_nodes > 0 and block.flops > 0 and block.ready_after
    (last,) = report.rejected
    assert last.reason == "last_block"
    assert last.params[0].startswith(f"stages.{stages - 1}.")
    assert 0 < report.early_share < 1


@pytest.mark.parametrize("stages, streams, on_side", [(3, 4, False), (6, 4, True), (4, 2, True),
                                                      (6, 1, False)])
def test_the_report_says_whether_stages_run_on_side_streams(stages, streams, on_side):
    """By default stages go to side streams when early blocks outnumber them (K - 1 > streams)."""
    (report,) = erase_fx.explain(Chain(stages), *chain_inputs(), erase_options={"streams": streams})
    assert report.stages_on_side is on_side
    text = format_report(report)
    assert ("each block's stage on its side stream" in text) is on_side


def test_a_graph_that_falls_back_runs_no_stage_on_a_side_stream():
    (report,) = erase_fx.explain(Chain(6), *chain_inputs())
    fallen = report.with_fallback("injected")
    assert report.stages_on_side and not fallen.stages_on_side
    assert "stage on its side stream" not in format_report(fallen)


def test_a_single_loss_reports_the_stock_path():
    (report,) = erase_fx.explain(TwoBlockOneLoss(), *two_block_inputs())
    assert report.blocks == () and report.fallback_reason == "no early block"


def test_explain_leaves_the_model_and_its_buffers_untouched():
    model = BatchNormBlocks()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    erase_fx.explain(model, torch.randn(8, 8), torch.randint(0, 3, (8,)))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])
    assert all(p.grad is None for p in model.parameters())


def test_report_round_trips_through_json():
    (report,) = erase_fx.explain(Chain(3), *chain_inputs())
    data = json.loads(report.to_json())
    assert GraphReport.from_dict(data) == report
    with pytest.raises(ValueError, match="unknown GraphReport fields"):
        GraphReport.from_dict({**data, "extra": 1})


def test_summary_line():
    (report,) = erase_fx.explain(Chain(3), *chain_inputs())
    assert "2 early block(s)" in report.summary()


def test_the_table_counts_each_blocks_parts_of_shared_gradients():
    from erase_fx.report_text import format_report
    from graphs import Towers

    (report,) = erase_fx.explain(Towers(3), *chain_inputs())
    rows = [line.split() for line in format_report(report).splitlines()]
    assert [row[:5] for row in rows if row[:1] in (["0"], ["1"])] == [
        ["0", "1", "4", "+1", "part"], ["1", "2", "4", "+1", "part"]]
    assert any(row[:2] == ["joins_blocks", "2"] for row in rows)
    (plain,) = erase_fx.explain(Chain(3), *chain_inputs())
    assert "part" not in format_report(plain).split("(#params")[0]


def test_explain_compiles_each_call_past_dynamos_recompile_limit():
    # each call compiles one more version of Chain.forward; Dynamo's default limit is 8
    for stages in range(2, 13):
        (report,) = erase_fx.explain(Chain(stages), *chain_inputs())
        assert len(report.blocks) == stages - 1


def test_explain_of_a_forward_dynamo_does_not_compile_raises(capsys):
    from erase_fx import cli
    from graphs import eager_only_factory

    with pytest.raises(erase_fx.EraseError, match="produced no graph"):
        erase_fx.explain(*eager_only_factory()[:1], *eager_only_factory()[1])
    # the command says so in one line, exit status 1
    assert cli.main(["explain", "graphs:eager_only_factory"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["erase-fx explain: [erase_fx: explain] torch.compile produced no graph for "
                   "this model: Dynamo ran its forward eagerly. Fix: see why with "
                   "TORCH_LOGS=graph_breaks,recompiles"]


# -- where in the model: the ready points as people read them ------------------


def test_the_report_of_an_analysis_with_its_joint_graph_says_where_each_ready_point_is():
    from erase_fx.config import EraseConfig
    from graphs import Stages

    cfg = EraseConfig(inner="aot_eager")
    stages = Stages(Chain(3), chain_inputs(), cfg)
    where = Whereabouts.of(stages.analysis, stages.joint.gm)
    report = GraphReport.from_analysis(0, stages.analysis, cfg, where)
    # F.cross_entropy runs in Chain.forward, outside modules: the nearest module upstream
    assert [b.ready_after_origin for b in report.blocks] == [
        "heads.0 (cross_entropy)", "heads.1 (cross_entropy)"]
    assert [b.ready_after for b in report.blocks] == [
        b.component.ready_after for b in stages.analysis.blocks]  # still the node's name
    (last,) = report.rejected
    assert last.node_origin == "heads.2 (cross_entropy)" and last.node
    without = GraphReport.from_analysis(0, stages.analysis, cfg)
    assert [b.ready_after_origin for b in without.blocks] == [None, None]
    assert GraphReport.from_dict(json.loads(report.to_json())) == report


def origin_graph():
    """x -> linear (in heads.0, a Linear) -> neg (outside modules) -> sum; y alone -> relu."""
    from erase_fx.report import node_origin

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    linear = graph.call_function(aten.mm.default, (x, x))
    linear.meta["nn_module_stack"] = {"k": ("L['self'].heads[0]", torch.nn.Linear)}
    linear.meta["source_fn_stack"] = [("linear", torch.nn.Linear)]
    neg = graph.call_function(aten.neg.default, (linear,))
    total = graph.call_function(aten.sum.default, (neg,))
    total.meta["source_fn_stack"] = [("sum_1", "sum")]
    backward = graph.call_function(aten.mul.Tensor, (y, y))
    backward.meta["fwd_nn_module_stack"] = {"k": ("L['self'].towers._modules['1']", object)}
    relu = graph.call_function(aten.relu.default, (y,))
    return node_origin, linear, neg, total, backward, relu


def test_node_origin_names_the_module_then_the_op():
    node_origin, linear, neg, total, backward, relu = origin_graph()
    assert node_origin(linear) == "heads.0 (Linear)"
    assert node_origin(neg) == "heads.0 (neg)"  # outside modules: the nearest one upstream
    assert node_origin(total) == "heads.0 (sum)"
    assert node_origin(backward) == "towers.1 (mul)"  # a backward node: its forward's module
    assert node_origin(relu) == "relu"  # no module anywhere upstream: the op alone


def test_the_table_shows_where_and_numbers_the_graph_as_asked():
    import dataclasses

    from erase_fx.report_text import TABLE_KEY, format_report

    (report,) = erase_fx.explain(Chain(2), *chain_inputs())
    block = dataclasses.replace(report.blocks[0], ready_after_origin="heads.0 (cross_entropy)")
    rejected = dataclasses.replace(report.rejected[0], node_origin="heads.1 (cross_entropy)")
    shown = dataclasses.replace(report, graph_id=7, blocks=(block,), rejected=(rejected,))
    text = format_report(shown)
    assert text.startswith("graph 7: ")
    (row,) = [line for line in text.splitlines() if line.startswith("  0  ")]
    assert "heads.0 (cross_entropy)" in row and block.ready_after not in row
    assert f"(at heads.1 (cross_entropy), node {rejected.node})" in " ".join(text.split())
    assert text.endswith(TABLE_KEY)
    other = format_report(shown, number=0, key=False)
    assert other.startswith("graph 0: ") and TABLE_KEY not in other
    plain = format_report(report)  # a report made without the joint graph: node names
    assert report.blocks[0].ready_after in plain
