"""What a compilation decides, as frozen plans, and the report built from them once."""
import dataclasses

import pytest
import torch

import erase_fx
from erase_fx.config import EraseConfig
from erase_fx.instruments import read_dumped_report
from erase_fx.passes import pipeline
from erase_fx.plan import (
    CompileRequest,
    Fallback,
    ForwardPlan,
    FoundBlocks,
    JointPlan,
    UpdatePlan,
    report_of,
)
from graphs import Chain, Stages, chain_inputs


@pytest.fixture(scope="module")
def stages():
    return Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager"))


def plans(stages):
    request = CompileRequest(stages.cfg, graph_id=7)
    joint = JointPlan(num_fwd_outputs=1, found=FoundBlocks(stages.analysis), early_blocks=True)
    forward = ForwardPlan(input_copies=stages.copied.artifact,
                          updates=UpdatePlan(grads=(), planned=()))
    return request, joint, forward


def test_the_report_is_the_analysis_and_what_the_forward_decided(stages):
    request, joint, forward = plans(stages)
    report = report_of(request, joint, forward, ())
    assert report.graph_id == 7 and report.fallback_reason is None
    assert [b.params for b in report.blocks] == [b.params for b in stages.analysis.blocks]
    assert [r.reason for r in report.rejected] == ["last_block"]
    assert report.input_copies == len(stages.copied.artifact.sizes)
    assert (report.early_updatable, report.whole_early_grads) == (0, 0)
    assert report_of(request, None, None, ()) == erase_fx.GraphReport(
        graph_id=7, streams=request.cfg.streams, inner="aot_eager")


def test_the_last_fallback_gives_the_reason_and_one_that_dropped_the_blocks_clears_them(stages):
    request, joint, forward = plans(stages)
    kept = report_of(request, joint, forward, (Fallback("forward failed", keeps_schedule=True),
                                               Fallback("backward failed", keeps_schedule=True)))
    assert kept.fallback_reason == "backward failed" and len(kept.blocks) == 2
    dropped = report_of(request, joint, forward, (Fallback("forward failed", True),
                                                  Fallback("compile failed")))
    assert dropped == report_of(request, joint, forward, ()).with_fallback("compile failed")
    assert not dropped.blocks and dropped.rejected  # the components left in the backward stay


def test_the_plans_and_the_request_are_frozen(stages):
    request, joint, forward = plans(stages)
    for plan, field in ((request, "require_early_blocks"), (joint, "early_blocks"),
                        (forward, "program")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(plan, field, None)


def test_a_backward_that_falls_back_after_finish_revises_the_published_report_and_dump(
        tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(pipeline.DEFER_GRAD_SCALING, "run", fail)
    compiled = torch.compile(Chain(3), backend="erase", options={
        "inner": "aot_eager", "on_error": "fallback", "dump_dir": str(tmp_path)})
    with erase_fx.collect_reports() as reports:
        loss = compiled(*chain_inputs())
        (published,) = reports
        assert published.fallback_reason is None
        loss.backward()  # the backward compiles here, after the backend's call returned
    (report,) = reports
    assert report.fallback_reason == "compile_backward failed: RuntimeError: injected"
    assert len(report.blocks) == 2  # the blocks still run early, on one stream
    (folder,) = tmp_path.iterdir()
    assert read_dumped_report(folder) == report
