"""bench.harness on CPU: the variant vocabulary, building a variant's step, memory arithmetic."""
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from bench import harness
from bench.harness import LEGACY_NAMES, Variant
from erase_fx.config import EraseConfig
from graphs import Chain, chain_inputs, trace_joint

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name, parsed", [
    ("eager", Variant("eager")),
    ("inductor+graph", Variant("inductor", "graph")),
    ("inductor+step+adam", Variant("inductor", "step", adam=True)),
    ("inductor+graph+adam", Variant("inductor", "graph", adam=True)),
    ("reduce-overhead", Variant("reduce-overhead")),
    ("erase+graphs/streams=8", Variant("erase", "graphs", control="streams=8")),
    ("erase+step-graph/one-stream", Variant("erase", "step-graph", control="one-stream")),
    ("erase+step+adam", Variant("erase", "step", adam=True)),
    ("erase+step/one-stream", Variant("erase", "step", control="one-stream")),
    ("erase/aot_eager", Variant("erase", control="aot_eager")),
    ("erase+step/release-lag=2", Variant("erase", "step", control="release-lag=2")),
    ("erase+step/stages-on-main", Variant("erase", "step", control="stages-on-main")),
])
def test_variant_names_read_and_write_back(name, parsed):
    assert Variant.parse(name) == parsed
    assert str(parsed) == name


@pytest.mark.parametrize("name, message", [
    ("inductor+graphs", "does not apply to inductor"),
    ("erase+graph", "does not apply to erase"),
    ("erase+graphs+step", "one capture at most"),
    ("erase+adam+step", "one capture at most"),
    ("paper+adam", "no optimizer form"),
    ("inductor/one-stream", "erase variants only"),
    ("erase/streams=01", "is not one of"),
    ("erase/release-lag=0", "is not one of"),
    ("erase/release-lag=Auto", "is not one of"),
    ("erase/side-cuda-streams=0", "is not one of"),
    ("erase/release_lag=1", "is not one of"),
    ("torchsched", "is not one of eager, paper"),
    ("Erase", "is not compiler"),
])
def test_names_outside_the_grammar_are_refused_with_the_reason(name, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Variant.parse(name)


def test_legacy_names_map_to_todays():
    assert Variant.parse("erase-graphs") == Variant.parse("erase+graphs")
    assert str(Variant.parse("erase+wholestep-1stream")) == "erase+step-graph/one-stream"
    assert harness.canonical("erase-1stream") == "erase/one-stream"
    assert harness.canonical("inductor") == "inductor"
    for old, new in LEGACY_NAMES.items():
        assert new in harness.EXPERIMENT_NAMES or str(Variant.parse(new)) == new


def test_each_erase_variant_names_its_stock_variants():
    assert Variant.parse("erase").stock() == ("inductor",)
    assert Variant.parse("erase+graphs").stock() == ("reduce-overhead", "inductor+graph")
    assert Variant.parse("erase+step-graph").stock() == ("inductor+graph",)
    assert Variant.parse("erase+step").stock() == ("inductor+step",)
    assert Variant.parse("erase+step+adam").stock() == ("inductor+step+adam",)
    assert Variant.parse("erase+step/one-stream").stock() == ("inductor+step",)
    assert Variant.parse("inductor+step").stock() == ()
    assert harness.judged_erase("erase+step+adam")
    assert not harness.judged_erase("erase+step/one-stream")
    assert not harness.judged_erase("inductor+step") and not harness.judged_erase("bogus")


def test_erase_options_of_the_controls():
    assert Variant.parse("erase+graphs").erase_options == {"inner": "inductor", "cudagraphs": True}
    assert Variant.parse("erase+step/one-stream").erase_options == {
        "inner": "inductor", "cudagraphs": False, "overlap": False}
    assert Variant.parse("erase+graphs/streams=2").erase_options["streams"] == 2
    assert Variant.parse("erase/aot_eager").erase_options["inner"] == "aot_eager"
    assert Variant.parse("erase+step/stages-on-main").erase_options["tuning"]["stages_on_side"] is False
    assert Variant.parse("erase+step/stages-on-side").erase_options["tuning"]["stages_on_side"] is True
    assert Variant.parse("erase+step/shared-input-values").erase_options["tuning"][
        "copy_input_values"] is False
    assert Variant.parse("erase+step/all-parts").erase_options["tuning"]["min_part_share"] == 0.0
    assert Variant.parse("erase+step/stock-candidate").erase_options == {
        "inner": "inductor", "cudagraphs": False, "tuning": {"stock_candidate": True}}
    assert Variant.parse("erase+step/recompute").erase_options["tuning"][
        "recompute_boundary_values"] is True
    assert Variant.parse("erase+step/no-recompute").erase_options["tuning"][
        "recompute_boundary_values"] is False
    assert Variant.parse("erase+step/release-lag=3").erase_options == {
        "inner": "inductor", "cudagraphs": False, "tuning": {"release_lag": 3}}
    assert Variant.parse("erase+step/release-lag=auto").erase_options["tuning"][
        "release_lag"] == "auto"
    assert Variant.parse("erase+step/release-lag=record-stream").erase_options["tuning"][
        "release_lag"] == "record_stream"
    assert Variant.parse("erase+step/release-lag=auto/side-cuda-streams=auto").erase_options[
        "tuning"] == {"release_lag": "auto", "side_cuda_streams": "auto"}
    assert Variant.parse("erase+step/side-cuda-streams=2").erase_options[
        "tuning"]["side_cuda_streams"] == 2
    both_none = Variant.parse("erase+step/release-lag=none/side-cuda-streams=none")
    assert both_none.erase_options == {
        "inner": "inductor", "cudagraphs": False,
        "tuning": {"release_lag": None, "side_cuda_streams": None}}


def test_controls_chain_and_may_not_set_one_option_twice():
    variant = Variant.parse("erase+step/streams=2/stages-on-main")
    assert variant.erase_options == {"inner": "inductor", "cudagraphs": False, "streams": 2,
                                     "tuning": {"stages_on_side": False}}
    assert str(variant) == "erase+step/streams=2/stages-on-main"
    assert not harness.judged_erase(str(variant))
    assert variant.stock() == ("inductor+step",)
    with pytest.raises(ValueError, match="both set stages_on_side"):
        Variant.parse("erase+step/stages-on-main/stages-on-side")
    with pytest.raises(ValueError, match="both set streams"):
        Variant.parse("erase+step/streams=2/streams=3")
    with pytest.raises(ValueError, match="control 'bogus'"):
        Variant.parse("erase+step/streams=2/bogus")
    with pytest.raises(ValueError, match="control ''"):
        Variant.parse("erase+step/streams=2/")


def test_early_optimizer_is_a_control_of_step_variants_that_sets_a_compile_step_option():
    variant = Variant.parse("erase+step+adam/early-optimizer")
    assert variant.step_options == {"early_optimizer": True}
    assert variant.erase_options == Variant.parse("erase+step+adam").erase_options
    assert Variant.parse("erase+step/streams=2/early-optimizer").step_options == {
        "early_optimizer": True}
    assert Variant.parse("erase+step").step_options == {}
    with pytest.raises(ValueError, match="applies to \\+step variants only"):
        Variant.parse("erase+graphs/early-optimizer")


def test_layouts_unpinned_patches_erase_for_its_row_only():
    from erase_fx.emit import inductor_segments

    real = inductor_segments.pin_early_outputs_to_fx_layout
    variant = Variant.parse("erase+step/layouts-unpinned")
    assert variant.erase_options == Variant.parse("erase+step").erase_options
    with variant.patched():
        assert inductor_segments.pin_early_outputs_to_fx_layout(object(), [0]) == []
    assert inductor_segments.pin_early_outputs_to_fx_layout is real
    with Variant.parse("erase+step/streams=2").patched():
        assert inductor_segments.pin_early_outputs_to_fx_layout is real
    with pytest.raises(ValueError, match="apply to erase variants only"):
        Variant.parse("inductor+step/layouts-unpinned")


def test_late_cse_restores_the_order_before_the_merge_for_its_row_only():
    import importlib

    from erase_fx.passes import PassContext, pipeline

    # NB: erase_fx.passes exports the pass function under the module's name
    partition_joint_graph = importlib.import_module("erase_fx.passes.partition_joint_graph")
    merge = importlib.import_module("erase_fx.passes.merge_common_subexpressions")
    real = merge._duplicates
    with Variant.parse("erase+step/late-cse").patched():
        assert merge._duplicates is not real
        assert partition_joint_graph.PARTITIONER_CSE is True
        joint = trace_joint(Chain(3), *chain_inputs(), inner="inductor")
        untouched = pipeline.MERGE_COMMON_SUBEXPRESSIONS.run(joint.gm,
                                                             PassContext.of(EraseConfig()))
        assert untouched.gm is joint.gm and not untouched.modified
    assert merge._duplicates is real
    assert partition_joint_graph.PARTITIONER_CSE is False


def test_one_vocabulary_across_bench_and_its_tests():
    """No legacy name left in bench/ or the bench and paper tests; every list of names parses."""
    from bench import check_cuda, run
    from bench.paper import ctr, digits, nanochat

    sources = [p for p in (ROOT / "bench").rglob("*.py") if p.name != "harness.py"]
    sources += [*ROOT.glob("tests/test_bench_*.py"), *ROOT.glob("tests/test_paper_*.py")]
    sources += [ROOT / "bench" / "paper" / "README.md", ROOT / "bench" / "device_run.sh"]
    sources = [p for p in sources if p.name != "test_bench_harness.py"]
    for path in sources:
        text = path.read_text()
        for old in LEGACY_NAMES:
            assert not re.search(rf"(?<![\w+/-]){re.escape(old)}(?![\w+/-])", text), (path, old)
    names = {*run.VARIANTS, *run.ADAM_VARIANTS, *check_cuda.VARIANTS, *digits.VARIANTS,
             *nanochat.VARIANTS, *ctr.VARIANTS}
    for name in names - set(harness.EXPERIMENT_NAMES):
        assert str(Variant.parse(name)) == name


class Tiny(nn.Module):
    """Two detached blocks, each with its loss: ``a`` (head ``head``), then ``b``."""

    def __init__(self):
        super().__init__()
        self.a, self.head, self.b = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x, y):
        h = self.a(x).relu()
        ce = nn.functional.cross_entropy
        return ce(self.head(h), y) + ce(self.b(h.detach()), y)


def tiny_batch():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(16, 4, generator=generator), torch.randint(0, 2, (16,), generator=generator)


def test_build_step_runs_the_first_step_then_after_first_then_steps():
    torch.manual_seed(0)
    model, inputs = Tiny(), tiny_batch()
    seen = []
    built = harness.build_step("eager", model, inputs,
                               after_first=lambda: seen.append(harness.grads_of(model)))
    (grads,) = seen
    assert all(g is not None for g in grads) and built.optimizer is None
    built.step()
    assert harness.max_rel_err(grads, harness.grads_of(model)) == 0.0
    assert built.capture_info() == {}


def test_adam_variants_update_the_parameters_inside_the_step():
    torch.manual_seed(0)
    model, inputs = Tiny(), tiny_batch()
    before = [p.detach().clone() for p in model.parameters()]
    built = harness.build_step("eager+adam", model, inputs)
    assert isinstance(built.optimizer, torch.optim.Adam)
    assert built.optimizer.defaults["foreach"] and not built.optimizer.defaults["capturable"]
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # parameters, grads, two moments, and a float32 step count per parameter
    numel = sum(p.numel() for p in before)
    assert harness.state_bytes(model, built.optimizer) == 4 * numel * 4 + 4 * len(before)


def test_erase_variants_compile_with_the_backend_options(monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = Tiny(), tiny_batch()
    reference = Tiny()
    reference.load_state_dict(model.state_dict())
    reference(*inputs).backward()
    seen = []
    harness.build_step("erase/aot_eager", model, inputs,
                       after_first=lambda: seen.append(harness.grads_of(model)))
    assert harness.max_rel_err(harness.grads_of(reference), seen[0]) == 0.0
    options = {}
    monkeypatch.setattr(harness.torch, "compile",
                        lambda model, **kwargs: options.update(kwargs) or model)
    harness.compile_forward(Variant.parse("erase/one-stream"), Tiny())
    assert options == {"backend": "erase", "options": {
        "on_error": "raise", "inner": "inductor", "cudagraphs": False, "overlap": False}}


def test_the_one_stream_option_is_a_backend_option():
    import erase_fx

    if "overlap" not in {f.name for f in __import__("dataclasses").fields(erase_fx.EraseConfig)}:
        pytest.skip("EraseConfig has no overlap field yet")
    assert erase_fx.EraseConfig(overlap=False).overlap is False


def test_step_variants_go_through_compile_step(monkeypatch):
    import erase_fx

    calls = {}

    class FakeStep:
        captures, replays, uncaptured_reason = 1, 3, None

        def __init__(self, fn, warmup, max_captures):
            calls.update(warmup=warmup, max_captures=max_captures)
            self.fn = fn

        def __call__(self, *inputs):
            calls["calls"] = calls.get("calls", 0) + 1
            return self.fn(*inputs)

    monkeypatch.setattr(erase_fx, "compile_step", FakeStep, raising=False)
    model, inputs = Tiny(), tiny_batch()
    # NB: eager inside compile_step is no name of the grammar; built directly, it compiles nothing
    built = harness.build_step(Variant("eager", "step"), model, inputs)
    built.step()
    assert calls == {"warmup": 2, "max_captures": 8, "calls": 2}
    assert built.capture_info() == {"captures": 1, "replays": 3, "uncaptured_reason": None}
    monkeypatch.delattr(erase_fx, "compile_step")
    with pytest.raises(RuntimeError, match="no compile_step"):
        harness.build_step(Variant("eager", "step"), model, inputs)


def test_state_bytes_counts_each_tensor_once():
    model = nn.Linear(3, 5)  # 20 floats
    assert harness.state_bytes(model) == 80
    model.weight.grad = torch.zeros_like(model.weight)
    assert harness.state_bytes(model) == 80 + 60
    model.bias.grad = model.weight.grad.view(-1)[:5]  # shares the weight grad's first 5 floats
    assert harness.state_bytes(model) == 80 + 60 + 20  # a view of another size counts


def test_step_memory_subtracts_the_floor_and_the_model_state(monkeypatch):
    model = nn.Linear(3, 5)  # state: 80 bytes
    default = {"segment_pool_id": (0, 0), "total_size": 1 << 20}
    snapshots = iter([
        [dict(default, allocated_size=1000)],  # the floor
        # after: the model's state and 500 bytes more in the default pool, a graph pool of
        # 3000 bytes of which 1000 are allocated (all of it is the program's)
        [dict(default, allocated_size=1000 + 80 + 500),
         {"segment_pool_id": (1, 0), "total_size": 3000, "allocated_size": 1000}],
    ])
    cuda = harness.torch.cuda
    _native_allocator(monkeypatch)
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda: 1000 + 80 + 500 + 1000)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda: 1000 + 80 + 500 + 1000 + 300)
    monkeypatch.setattr(cuda, "memory_snapshot", lambda: next(snapshots))
    memory = harness.StepMemory()
    memory.start()
    memory.before_timing()
    weighed = memory.finish(model, None)
    assert weighed == {"peak_mem_bytes": 2880, "step_peak_bytes": 300, "kept_bytes": 3500,
                       "mem_bytes": 3800, "state_bytes": 80}


def _native_allocator(monkeypatch):
    monkeypatch.setattr(harness, "allocator_backend", lambda: "native")
    monkeypatch.setattr(harness, "clear_cublas_workspaces", lambda: None)


def test_held_bytes_under_cuda_malloc_async_adds_graph_memory(monkeypatch):
    """cudaMallocAsync: no snapshot; the default pool's bytes in use plus the graph memory."""
    cuda = harness.torch.cuda
    monkeypatch.setattr(harness, "allocator_backend", lambda: "cudaMallocAsync")
    monkeypatch.setattr(cuda, "memory_allocated", lambda: 700)
    monkeypatch.setattr(harness, "graph_memory_bytes", lambda: 5000)

    def no_snapshot():
        raise AssertionError("memory_snapshot is not meaningful under cudaMallocAsync")

    monkeypatch.setattr(cuda, "memory_snapshot", no_snapshot)
    assert harness.held_bytes() == 5700


def test_held_bytes_native_counts_graph_pools_whole(monkeypatch):
    _native_allocator(monkeypatch)
    monkeypatch.setattr(harness.torch.cuda, "memory_snapshot", lambda: [
        {"segment_pool_id": (0, 0), "total_size": 4096, "allocated_size": 100},
        {"segment_pool_id": (3, 0), "total_size": 2048, "allocated_size": 10}])
    assert harness.held_bytes() == 100 + 2048


def test_graph_memory_is_trimmed_only_under_cuda_malloc_async(monkeypatch):
    monkeypatch.setattr(harness, "allocator_backend", lambda: "native")
    monkeypatch.setattr(harness, "_cuda_driver_device",
                        lambda: (_ for _ in ()).throw(AssertionError("no driver call")))
    harness.trim_graph_memory()  # native: nothing to trim, no driver call


def test_workspaces_are_what_clearing_cublas_frees(monkeypatch):
    default = {"segment_pool_id": (0, 0), "total_size": 1 << 20}
    snapshots = iter([[dict(default, allocated_size=5000)], [dict(default, allocated_size=1000)]])
    cleared = []
    cuda = harness.torch.cuda
    monkeypatch.setattr(harness, "allocator_backend", lambda: "native")
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "memory_snapshot", lambda: next(snapshots))
    monkeypatch.setattr(harness, "clear_cublas_workspaces", lambda: cleared.append(True))
    assert harness.StepMemory().workspaces() == 4000 and cleared == [True]


def test_warm_up_goes_on_while_compile_step_tunes():
    class Program:
        tuning = True

    program, calls = Program(), []

    def step():
        calls.append(1)
        program.tuning = len(calls) < 7

    harness.BuiltStep(step, program=program).warm_up(5)
    assert len(calls) == 7
    harness.BuiltStep(lambda: calls.append(1)).warm_up(2)  # no compile_step: the steps asked
    assert len(calls) == 9
