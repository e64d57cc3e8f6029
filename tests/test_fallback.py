"""A failure at any stage of erase_fx's pipeline: the stock path under "fallback", the error under "raise".

Each case injects a failure into one stage (the stock joint-graph passes
erase_fx's compile runs, the analysis, the scheduling, the partition, the
streams, the segments, each compile, the backward's passes) and checks both
policies: under ``on_error="fallback"`` the model trains with eager's
gradients and the report names the stage; under ``"raise"`` the injected
error is what the user gets (under Dynamo's ``BackendCompilerFailed``).
"""
import logging

import pytest
import torch

import erase_fx
import erase_fx.compilation as compilation
from erase_fx.emit.program import StreamProgram
from erase_fx.passes import pipeline
from graphs import Chain, chain_inputs, check_parity
from test_stock_inductor import DropoutChain


class InjectedFailure(RuntimeError):
    pass


def fail(*args, **kwargs):
    raise InjectedFailure("injected")


def fail_once(real):
    """``real``, except that its first call raises."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise InjectedFailure("injected")
        return real(*args, **kwargs)

    return wrapper


def _inductor_joint_passes():
    import torch._inductor.compile_fx as compile_fx

    return compile_fx, "joint_graph_passes"


#: stage name, (module, attribute) to break, the inner compiler, where the
#: report says it failed, whether the early blocks survive (a forward or
#: backward failure keeps the schedule, on one stream). The passes are broken
#: in their entries of the pass lists (`erase_fx.passes.pipeline`).
STAGES = [
    ("analysis", (pipeline.FIND_STOP_GRADIENT_BLOCKS, "run"), "aot_eager", "partition", False),
    ("scheduling", (pipeline.SCHEDULE_EARLY_BACKWARD, "run"), "aot_eager", "partition", False),
    ("partition", (pipeline.PARTITION_JOINT_GRAPH, "run"), "aot_eager", "partition", False),
    ("streams", (pipeline.ASSIGN_STREAMS, "run"), "aot_eager", "compile_forward", True),
    ("segments", (pipeline.SPLIT_SEGMENTS, "run"), "aot_eager", "compile_forward", True),
    ("segment compile", (compilation, "compile_segment"), "aot_eager", "compile_forward", True),
    ("program", (StreamProgram, "build"), "aot_eager", "compile_forward", True),
    ("backward passes", (pipeline.DEFER_GRAD_SCALING, "run"), "aot_eager", "compile_backward",
     True),
    ("backward compile", (compilation, "ScaledBackward"), "aot_eager", "compile_backward", True),
    ("inductor segments", (compilation, "compile_inductor_segments"), "inductor",
     "compile_forward", True),
    ("joint passes", None, "inductor", "compile", False),
]


def _break(monkeypatch, stage):
    name, target = stage[0], stage[1]
    if target is None:  # Inductor's joint-graph passes: once, so the stock retry succeeds
        module, attribute = _inductor_joint_passes()
        monkeypatch.setattr(module, attribute, fail_once(getattr(module, attribute)))
    elif name == "program":
        monkeypatch.setattr(StreamProgram, "build", classmethod(fail))
    else:
        monkeypatch.setattr(*target, fail)


def _model_and_inputs(inner):
    if inner == "inductor":
        return DropoutChain(p=0.0), lambda: (torch.randn(8, 16), torch.randint(0, 3, (8,)))
    return Chain(3), chain_inputs


@pytest.mark.parametrize("stage", STAGES, ids=[s[0] for s in STAGES])
def test_a_failing_stage_falls_back_with_eagers_gradients(monkeypatch, caplog, stage):
    _, _, inner, where, keeps_blocks = stage
    _break(monkeypatch, stage)
    model, make_inputs = _model_and_inputs(inner)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if inner == "inductor" else {}
    with erase_fx.collect_reports() as reports, caplog.at_level(logging.WARNING, "erase_fx"):
        check_parity(model, make_inputs, options={"inner": inner, "on_error": "fallback"},
                     **tolerance)
    report = reports[0]
    assert report.fallback_reason.startswith(f"{where} failed: InjectedFailure")
    assert bool(report.blocks) == keeps_blocks
    assert any("takes the stock path" in r.getMessage() and "InjectedFailure" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("stage", STAGES, ids=[s[0] for s in STAGES])
def test_a_failing_stage_raises_the_original_error_under_raise(monkeypatch, stage):
    _break(monkeypatch, stage)
    model, make_inputs = _model_and_inputs(stage[2])
    compiled = torch.compile(model, backend="erase",
                             options={"inner": stage[2], "on_error": "raise"})
    with pytest.raises(Exception) as excinfo:
        compiled(*make_inputs()).backward()
    assert _chain_has(excinfo.value, InjectedFailure)


def _chain_has(error, kind):
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return True
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return False
