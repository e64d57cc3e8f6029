"""explain names each graph break: where in the user's code, Dynamo's reason, what follows.

The models (`break_models`) have two detached blocks with local losses and,
between them, a ``.item()`` for logging, a data-dependent op, or an
``autograd.Function`` applied through an instance. The last two tests pin
the torch API `erase_fx.graph_breaks` reads (torch 2.11-2.14).
"""
import copy
import json
import os
import re

import pytest
import torch

import erase_fx
from break_models import (
    FunctionInstance,
    ItemLogged,
    LossAfterBreak,
    MaskedRows,
    PassGradient,
    function_instance_factory,
    inputs,
    line_of,
)
from erase_fx import GraphReport
from erase_fx.graph_breaks import graph_break_of, parse_reason, user_frame
from erase_fx.report_text import format_reports

BREAK_MODELS = os.path.join(os.path.dirname(__file__), "break_models.py")


def test_an_item_call_between_blocks_is_named_with_its_line_and_dynamos_hint():
    model = ItemLogged()
    first, second = erase_fx.explain(model, *inputs())
    graph_break = first.graph_break
    assert graph_break is not None and second.graph_break is None
    assert "item()" in graph_break.reason
    assert (graph_break.file, graph_break.line) == (BREAK_MODELS, line_of(ItemLogged, "ITEM_LINE"))
    assert graph_break.code.startswith("self.logged.append(loss1.item())")
    assert graph_break.function == "forward" and graph_break.inside_torch == ""
    assert any("capture_scalar_outputs" in hint for hint in graph_break.hints)
    assert model.logged == []  # what the forward appended is taken back


def test_the_text_says_where_each_graph_ends_and_which_graph_follows():
    reports = erase_fx.explain(ItemLogged(), *inputs())
    text = format_reports(reports)
    line = line_of(ItemLogged, "ITEM_LINE")
    assert text.startswith("Dynamo split this forward into 2 graphs at 1 graph break")
    flat = " ".join(text.split())  # the text is wrapped
    first, second = (report.graph_id for report in reports)
    assert (f"graph {first} ends at a graph break at {os.path.relpath(BREAK_MODELS)}:{line} "
            f"({reports[0].graph_break.reason}): what follows is graph {second}") in flat
    assert "self.logged.append(loss1.item())" in text
    assert "hint: Set `torch._dynamo.config.capture_scalar_outputs = True`" in flat
    # the block ready only at the end of graph 0 runs there, while graph 1 runs
    # (erase_fx.emit.graph_end); it reads the gradient of loss1 too (kept for .item())
    assert reports[0].blocks[0].at_graph_end and not reports[0].rejected
    assert "the graph's end (+1 output)" in flat
    # where it cannot (no side stream), its row says what separates it from graph 1
    flat = " ".join(format_reports(erase_fx.explain(
        ItemLogged(), *inputs(), erase_options={"streams": 0})).split())
    assert (f"nothing later to overlap (at head1 (cross_entropy), node nll_loss_forward); the "
            f"graph break at {os.path.relpath(BREAK_MODELS)}:{line} (below) separates it from "
            "what follows") in flat
    assert f"graph {second} ends" not in flat


def test_a_block_whose_loss_is_computed_after_a_break_is_told_to_compute_it_before():
    first, second = erase_fx.explain(LossAfterBreak(), *inputs())
    # not "last_block": at its graph's end it would stay all the same, for want of a loss
    assert [r.reason for r in first.rejected] == ["not_scalar_tangent"] and not first.blocks
    assert first.graph_break.line == line_of(LossAfterBreak, "NORM_LINE")
    where = first.graph_break.where
    text = " ".join(format_reports([first, second]).split())
    assert (f"its gradient comes from after the graph break at {where} (below): a block runs "
            "early with its loss in its own graph, so compute the loss before the break") in text


def test_a_data_dependent_op_between_blocks_is_named_with_dynamos_hint():
    reports = erase_fx.explain(MaskedRows(), *inputs())
    graph_break = reports[0].graph_break
    assert graph_break is not None and reports[-1].graph_break is None
    assert graph_break.line == line_of(MaskedRows, "MASK_LINE")
    assert "nonzero" in graph_break.explanation
    assert any("capture_dynamic_output_shape_ops = True" in hint for hint in graph_break.hints)
    assert graph_break.documentation.startswith("https://")


def test_a_break_inside_torch_names_the_users_line_and_the_torch_function():
    reports = erase_fx.explain(*function_instance_factory()[:1], *inputs())
    graph_break = reports[0].graph_break
    assert graph_break.line == line_of(FunctionInstance, "APPLY_LINE")
    assert graph_break.inside_torch == "torch.autograd.function.apply"
    flat = " ".join(format_reports(reports).split())
    assert "inside torch.autograd.function.apply" in flat
    assert "call it on the class: MyFunction.apply(x)" in flat


def test_the_advice_for_a_function_instance_holds_the_class_compiles_in_one_graph():
    class OnTheClass(FunctionInstance):
        def forward(self, x, labels):
            h = PassGradient.apply(self.b1(x))
            loss1 = torch.nn.functional.cross_entropy(self.head1(h), labels)
            h = self.b2(h.detach())
            return loss1 + torch.nn.functional.cross_entropy(self.head2(h), labels)

    (report,) = erase_fx.explain(OnTheClass(), *inputs())
    assert report.graph_break is None and len(report.blocks) == 1


def test_a_graph_break_round_trips_through_json():
    reports = erase_fx.explain(ItemLogged(), *inputs())
    for report in reports:
        assert GraphReport.from_dict(json.loads(report.to_json())) == report
    assert "ends at a graph break at" in reports[0].summary()


def test_the_dumps_report_holds_the_graph_break(tmp_path):
    first, _ = erase_fx.explain(ItemLogged(), *inputs(), erase_options={"dump_dir": str(tmp_path)})
    dumped = json.loads((tmp_path / f"graph_{first.graph_id}" / "report.json").read_text())
    assert dumped["graph_break"]["line"] == line_of(ItemLogged, "ITEM_LINE")


def test_the_cli_prints_the_graph_break(capsys):
    from erase_fx import cli

    assert cli.main(["explain", "break_models:item_factory"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    line = line_of(ItemLogged, "ITEM_LINE")
    found = re.search(rf"graph (\d+) ends at a graph break at "
                      rf"{re.escape(os.path.relpath(BREAK_MODELS))}:{line} \(.*?\): what follows "
                      rf"is graph (\d+)", flat)
    assert found and int(found[2]) == int(found[1]) + 1  # graph ids count across the process


def test_a_graph_that_ends_at_its_return_has_no_graph_break():
    from graphs import Chain, chain_inputs

    (report,) = erase_fx.explain(Chain(3), *chain_inputs())
    assert report.graph_break is None
    assert "graph break" not in format_reports([report])


# -- the torch API erase_fx.graph_breaks reads, pinned -------------------------


def test_dynamo_hands_each_backend_the_reason_it_ended_the_graph():
    """``gm.compile_subgraph_reason`` (a GraphCompileReason: reason, user_stack, graph_break),
    which ``torch._dynamo.explain`` reads too."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm.compile_subgraph_reason, graph_break_of(gm)))
        return gm.forward

    torch.compile(ItemLogged(), backend=backend)(*inputs())
    (first, first_break), (last, last_break) = seen
    assert first.graph_break and not last.graph_break
    assert isinstance(first.reason, str) and first.user_stack
    assert first.user_stack[-1].filename == BREAK_MODELS
    assert first_break is not None and last_break is None


def test_dynamos_graph_break_message_layout_is_read_back():
    from torch._dynamo.exc import format_graph_break_message

    message = format_graph_break_message(
        gb_type="Some break", context="ctx of developers", explanation="Why it broke.",
        hints=["Do this.", "Or that,\nover two lines."])
    name, explanation, hints, _ = parse_reason(message)
    assert (name, explanation, hints) == (
        "Some break", "Why it broke.", ("Do this.", "Or that, over two lines."))
    assert parse_reason("return_value") == ("return_value", "", (), "")


def test_the_users_frame_is_the_innermost_outside_torch():
    import traceback

    torch_file = os.path.join(os.path.dirname(torch.__file__), "autograd", "function.py")
    stack = [traceback.FrameSummary("/home/u/model.py", 42, "forward", line="x = f(x)"),
             traceback.FrameSummary(torch_file, 618, "apply", line="...")]
    frame, inside = user_frame(stack)
    assert (frame.filename, frame.lineno, inside) == (
        "/home/u/model.py", 42, "torch.autograd.function.apply")
    assert user_frame(stack[:1]) == (stack[0], "")
    assert user_frame([]) == (None, "")


def test_a_function_instance_cannot_be_deep_copied():
    """Why explain no longer copies the model (it did, with copy.deepcopy)."""
    with pytest.raises(TypeError, match="pickle"):
        copy.deepcopy(FunctionInstance())


def test_an_outputs_line_names_its_file_as_a_graph_break_does(tmp_path, monkeypatch):
    """`erase_fx.names.user_line` and `GraphBreakReport.where` shorten a file one way
    (`erase_fx.report.short_path`): relative inside the working folder, else as it is."""
    from erase_fx.names import user_line
    from erase_fx.report import GraphBreakReport

    inside, outside = tmp_path / "work" / "model.py", tmp_path / "elsewhere" / "model.py"
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    for path in (inside, outside):
        trace = f'  File "{path}", line 7, in forward\n    h = self.head(x)\n'
        where = GraphBreakReport(reason="", file=str(path), line=7).where
        assert user_line(trace) == f"{where}: h = self.head(x)"
    assert user_line(f'  File "{inside}", line 7, in forward\n').startswith("model.py:7")
    assert user_line(f'  File "{outside}", line 7, in forward\n').startswith(f"{outside}:7")
