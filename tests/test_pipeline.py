"""The pass lists and their driver: what compilation runs, and the contract every pass keeps."""
import inspect
import json

import pytest
import torch

import erase_fx.compilation as compilation
from erase_fx.config import EraseConfig, Tuning
from erase_fx.errors import GraphInvariantError
from erase_fx.passes import (
    BACKWARD_PASSES,
    FORWARD_PASSES,
    JOINT_PASSES,
    DumpFile,
    Pass,
    PassResult,
    module_given_to,
    pipeline,
    run_passes,
)
from graphs import Chain, TwoBlockOneLoss, chain_inputs, trace_joint, two_block_inputs

CFG = EraseConfig(inner="aot_eager", tuning=Tuning(recompute_boundary_values=True))
LISTS = {"joint": JOINT_PASSES, "forward": FORWARD_PASSES, "backward": BACKWARD_PASSES}


def names(passes):
    return [entry.name for entry in passes]


@pytest.fixture
def driver_calls(monkeypatch):
    """Each `run_passes` call compilation makes: (the list it ran, the names of its results)."""
    calls = []
    real = compilation.run_passes

    def recording(passes, *args, **kwargs):
        results = real(passes, *args, **kwargs)
        calls.append((passes, list(results)))
        return results

    monkeypatch.setattr(compilation, "run_passes", recording)
    return calls


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_compilation_runs_the_declared_lists_whole_for_a_graph_with_early_blocks(
        driver_calls, tmp_path, inner):
    compiled = torch.compile(Chain(3), backend="erase",
                             options={"inner": inner, "on_error": "raise",
                                      "dump_dir": str(tmp_path)})
    compiled(*chain_inputs()).backward()
    assert [passes for passes, _ in driver_calls] == [JOINT_PASSES, FORWARD_PASSES,
                                                      BACKWARD_PASSES]
    assert all(passes is declared for (passes, _), declared in zip(driver_calls, LISTS.values()))
    assert [ran for _, ran in driver_calls] == [names(p) for p in LISTS.values()]
    # the instruments saw each pass the driver ran, in order
    (graph,) = list(tmp_path.iterdir())
    timed = [t["pass"] for t in json.loads((graph / "timings.json").read_text())["passes"]]
    assert timed == names(JOINT_PASSES + FORWARD_PASSES + BACKWARD_PASSES)


def test_without_an_early_block_the_joint_list_stops_after_the_analysis(driver_calls):
    compiled = torch.compile(TwoBlockOneLoss(), backend="erase",
                             options={"inner": "aot_eager", "on_error": "raise"})
    compiled(*two_block_inputs()).backward()
    assert driver_calls == [(JOINT_PASSES, ["merge_common_subexpressions",
                                            "find_stop_gradient_blocks"])]


def run_every_list(model, inputs, runner=None):
    """The three lists over one model's joint graph, forward and backward: results by list."""
    joint = trace_joint(model, *inputs)
    results = {"joint": run_passes(
        JOINT_PASSES, joint.gm, CFG, runner=runner, num_fwd_outputs=joint.num_fwd_outputs,
        joint_inputs=joint.joint_inputs, partition_kwargs=joint.kwargs)}
    partition = results["joint"]["partition_joint_graph"].artifact
    results["forward"] = run_passes(FORWARD_PASSES, partition.fw, CFG, runner=runner)
    results["backward"] = run_passes(BACKWARD_PASSES, partition.bw, CFG, runner=runner)
    return results


class RecordingRunner:
    def __init__(self):
        self.ran = []

    def run(self, name, fn, *args):
        result = fn(*args)
        self.ran.append((name, result))
        return result


def test_every_pass_in_the_lists_returns_a_pass_result_that_renders_its_dump():
    runner = RecordingRunner()
    results = run_every_list(Chain(3), chain_inputs(), runner)
    for list_name, passes in LISTS.items():
        assert list(results[list_name]) == names(passes)
    assert [name for name, _ in runner.ran] == names(
        JOINT_PASSES + FORWARD_PASSES + BACKWARD_PASSES)
    for name, result in runner.ran:
        assert isinstance(result, PassResult), name
        assert isinstance(result.gm, torch.fx.GraphModule), name
        files = result.render()
        assert files and all(isinstance(f, DumpFile) for f in files), name
        assert len({f.suffix for f in files}) == len(files), name
        assert all(f.suffix.startswith(".") and f.part and f.text.endswith("\n")
                   for f in files), name
    # every structural pass made something new; the analysis hands its input on, and so do
    # the passes with nothing to do on a small chain traced for aot_eager: it repeats no
    # node, copies no large value, and its segments read nothing worth recomputing
    ran = dict(runner.ran)
    handed_on = ("merge_common_subexpressions", "find_stop_gradient_blocks",
                 "copy_input_values_per_block", "recompute_boundary_values")
    assert not any(ran[n].modified for n in handed_on)
    assert all(ran[n].modified for n in ran if n not in handed_on)
    forward = results["forward"]
    assert forward["copy_input_values_per_block"].gm is results["joint"][
        "partition_joint_graph"].artifact.fw


def test_each_pass_of_a_list_reads_the_module_the_pass_before_returned():
    seen = []

    class Spy(RecordingRunner):
        def run(self, name, fn, entry, gm, context):
            seen.append((name, gm))
            return super().run(name, fn, entry, gm, context)

    results = run_every_list(Chain(3), chain_inputs(), Spy())
    joint = results["joint"]
    assert seen[1] == ("find_stop_gradient_blocks", joint["merge_common_subexpressions"].gm)
    assert seen[2] == ("schedule_early_backward", joint["find_stop_gradient_blocks"].gm)
    assert seen[3] == ("partition_joint_graph", joint["schedule_early_backward"].gm)
    forward = results["forward"]
    assert seen[4] == ("copy_input_values_per_block", joint["partition_joint_graph"].artifact.fw)
    assert seen[5] == ("assign_streams", forward["copy_input_values_per_block"].gm)
    assert seen[6] == ("recompute_boundary_values", forward["assign_streams"].gm)
    assert seen[7] == ("split_segments", forward["recompute_boundary_values"].gm)
    # what compilation reads back: the module a pass was given, by the pass's name
    assert module_given_to(forward, "split_segments") is forward["recompute_boundary_values"].gm
    assert module_given_to(joint, "partition_joint_graph") is joint["schedule_early_backward"].gm
    with pytest.raises(ValueError, match="ran first"):
        module_given_to(forward, "copy_input_values_per_block")


ENTRIES = [entry for passes in LISTS.values() for entry in passes]
EVERY_ENTRY = ENTRIES + [pipeline.SPECIALIZE_UNUSED_TANGENTS]


@pytest.mark.parametrize("entry", EVERY_ENTRY, ids=[e.name for e in EVERY_ENTRY])
def test_each_entry_names_its_pass_and_check_which_take_the_module_or_result_and_the_context(
        entry):
    """No adapter between an entry and its pass: every pass is ``name(gm, ctx)`` in the
    module of its name, and its check ``check_*(result, ctx)`` beside it."""
    module = f"erase_fx.passes.{entry.name}"
    assert (entry.run.__module__, entry.run.__name__) == (module, entry.name)
    assert entry.check.__module__ == module and entry.check.__name__.startswith("check_")
    assert list(inspect.signature(entry.run).parameters) in (["gm", "ctx"], ["bw", "ctx"])
    assert list(inspect.signature(entry.check).parameters) == ["result", "ctx"]


class BrokenInvariant(RuntimeError):
    pass


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_the_driver_runs_each_passs_check(monkeypatch, entry):
    def fail(result, ctx):
        raise BrokenInvariant(entry.name)

    monkeypatch.setattr(entry, "check", fail)
    with pytest.raises(BrokenInvariant, match=entry.name):
        run_every_list(Chain(3), chain_inputs())


def test_a_pass_that_returns_something_else_than_a_pass_result_is_refused():
    odd = Pass("odd", lambda gm, context: (gm, True), lambda result, context: None)
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(GraphInvariantError, match="odd.*not a PassResult"):
        run_passes((odd,), gm, CFG)


def test_after_callbacks_run_before_the_next_pass():
    order = []
    first = Pass("first", lambda gm, c: PassResult(gm, False), lambda r, c: None)
    second = Pass("second", lambda gm, c: order.append("second") or PassResult(gm, False),
                  lambda r, c: None)
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    results = run_passes((first, second), gm, CFG,
                         after={"first": lambda result: order.append(("after", result))})
    assert order == [("after", results["first"]), "second"]
