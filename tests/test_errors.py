"""Bad input gives a clear EraseError, or (on_error="fallback") a logged stock path; never a wrong grad."""
import copy
import logging
import re

import pytest
import torch

import erase_fx
from erase_fx import EraseOptionError, EraseRuntimeError, UnsupportedBlockError
from erase_fx.passes import RejectReason
from graphs import Chain, ClippedChain, assert_same_grads, chain_inputs, check_parity

RAISE = {"inner": "aot_eager", "on_error": "raise"}


def compile_chain(options, model=None):
    model = model or Chain(3)
    return model, torch.compile(model, backend="erase", options=options)


def cause(excinfo):
    """The error the backend raised, under Dynamo's BackendCompilerFailed wrapper."""
    error = excinfo.value
    while not isinstance(error, erase_fx.EraseError):
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if inner is None:
            break
        error = inner
    return error


def test_double_backward_raises():
    model, compiled = compile_chain(RAISE)
    loss = compiled(*chain_inputs())
    with pytest.raises(EraseRuntimeError, match="double backward") as excinfo:
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    assert "Fix:" in str(excinfo.value)


def test_retain_graph_raises_while_saved_tensors_are_donated():
    _, compiled = compile_chain(RAISE)
    loss = compiled(*chain_inputs())
    with pytest.raises(EraseRuntimeError, match="retain_graph=True") as excinfo:
        loss.backward(retain_graph=True)
    assert "donated_buffer" in excinfo.value.fix


def test_retain_graph_then_second_backward_matches_eager_without_donation():
    eager = Chain(3)
    erased, compiled = compile_chain(RAISE, copy.deepcopy(eager))
    inputs = chain_inputs()
    with torch._functorch.config.patch(donated_buffer=False):
        eager_loss, erased_loss = eager(*inputs), compiled(*inputs)
    for _ in range(2):
        eager_loss.backward(retain_graph=True)
        erased_loss.backward(retain_graph=True)
    assert_same_grads(eager, erased)


def test_retain_graph_through_donated_early_grads_raises():
    _, compiled = compile_chain({"inner": "inductor", "on_error": "raise"})
    loss = compiled(*chain_inputs())
    with pytest.raises(EraseRuntimeError, match="retain_graph=True") as excinfo:
        loss.backward(retain_graph=True)
    assert "donated_buffer" in str(excinfo.value)


def test_unsupported_op_in_an_early_block_raises_under_raise():
    _, compiled = compile_chain(RAISE, ClippedChain(3))
    with pytest.raises(Exception) as excinfo:
        compiled(*chain_inputs())
    error = cause(excinfo)
    assert isinstance(error, UnsupportedBlockError)
    assert error.where == "find_stop_gradient_blocks"
    assert error.node and "clamp" in str(error)
    assert "on_error" in error.fix


def test_unsupported_op_in_an_early_block_stays_in_the_backward_under_fallback(caplog):
    with erase_fx.collect_reports() as reports, caplog.at_level(logging.WARNING, "erase_fx"):
        check_parity(ClippedChain(3), chain_inputs, options={"on_error": "fallback"})
    (report,) = reports
    assert len(report.blocks) == 1
    assert [r.reason for r in report.rejected].count(RejectReason.NOT_LINEAR.value) == 1
    assert any("stays in the backward" in r.getMessage() and "clamp" in r.getMessage()
               for r in caplog.records)


def test_internal_failure_falls_back_to_the_stock_path(monkeypatch, caplog):
    from erase_fx.passes import pipeline

    def broken(*args, **kwargs):
        raise RuntimeError("simulated pass failure")

    monkeypatch.setattr(pipeline.SCHEDULE_EARLY_BACKWARD, "run", broken)
    with erase_fx.collect_reports() as reports, caplog.at_level(logging.WARNING, "erase_fx"):
        check_parity(Chain(3), chain_inputs, options={"on_error": "fallback"})
    assert reports[0].blocks == ()
    assert "simulated pass failure" in reports[0].fallback_reason
    assert any("stock path" in r.getMessage() for r in caplog.records)


def test_internal_failure_raises_under_raise(monkeypatch):
    from erase_fx.passes import pipeline

    def broken(*args, **kwargs):
        raise RuntimeError("simulated pass failure")

    monkeypatch.setattr(pipeline.SPLIT_SEGMENTS, "run", broken)
    _, compiled = compile_chain(RAISE)
    with pytest.raises(Exception, match="simulated pass failure"):
        compiled(*chain_inputs())


def test_segment_failure_falls_back_to_one_stream_with_early_grads_kept(monkeypatch):
    from erase_fx.passes import pipeline

    def broken(*args, **kwargs):
        raise RuntimeError("simulated split failure")

    monkeypatch.setattr(pipeline.SPLIT_SEGMENTS, "run", broken)
    with erase_fx.collect_reports() as reports:
        check_parity(Chain(3), chain_inputs, options={"on_error": "fallback"})
    assert len(reports[0].blocks) == 2
    assert "simulated split failure" in reports[0].fallback_reason


@pytest.mark.parametrize("options, match", [
    ({"streams": -1}, "streams=-1"),
    ({"streams": True}, "streams=True"),
    ({"inner": "tvm"}, "'inductor', 'aot_eager', 'eager'"),
    ({"on_error": "ignore"}, "'fallback', 'raise'"),
    ({"seed": 0.0}, "seed=0.0"),
    ({"tuning": {"partitioner": "greedy"}}, "'min_cut', 'default'"),
    ({"partitioner": "default"}, "partitioner is a tuning setting now"),
    ({"cudagraphs": "yes"}, "cudagraphs=.yes."),
    ({"stream": 2}, r"unknown option\(s\) 'stream'.*streams \(default 4\)"),
])
def test_bad_options_are_rejected_with_the_allowed_values(options, match):
    _, compiled = compile_chain(options)
    with pytest.raises(Exception) as excinfo:
        compiled(*chain_inputs())
    error = cause(excinfo)
    assert isinstance(error, EraseOptionError)
    assert error.where == "options"
    assert re.search(match, str(error)), str(error)


def test_mode_is_rejected():
    compiled = torch.compile(Chain(3), backend="erase", mode="max-autotune")
    with pytest.raises(Exception) as excinfo:
        compiled(*chain_inputs())
    assert isinstance(cause(excinfo), EraseOptionError)
