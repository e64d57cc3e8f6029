"""bench.segment_cost's pieces that run without a GPU: the forward compiled whole (the same
early-backward program, no segments) trains like eager; the kernel families of a trace."""
import copy
import json

import torch

from bench import segment_cost
from bench.harness import Variant
from erase_fx import compilation
from graphs import Chain, assert_same_grads, chain_inputs


def test_the_forward_compiled_whole_trains_like_eager_without_segments(monkeypatch):
    segmented = []
    real = compilation.GraphCompilation._compile_segments
    monkeypatch.setattr(compilation.GraphCompilation, "_compile_segments",
                        lambda self, *a: segmented.append(1) or real(self, *a))
    torch.manual_seed(0)
    model = Chain(3)
    eager, erased = copy.deepcopy(model), copy.deepcopy(model)
    with segment_cost.forward_compiled_whole():
        compiled = torch.compile(erased, backend="erase",
                                 options={"inner": "aot_eager", "on_error": "raise"})
        inputs = chain_inputs()
        eager(*inputs).backward()
        compiled(*inputs).backward()
    assert_same_grads(eager, erased)
    assert segmented == []  # patched away inside
    torch._dynamo.reset()
    again = torch.compile(copy.deepcopy(model), backend="erase",
                          options={"inner": "aot_eager", "on_error": "raise"})
    again(*chain_inputs()).backward()
    assert segmented  # restored after: the same model compiles in segments
    torch._dynamo.reset()


def test_erase_options_patch_adds_options_and_restores():
    before = Variant.parse("erase+step/one-stream").erase_options
    with segment_cost.erase_options(recompute_boundary_values=True):
        inside = Variant.parse("erase+step/one-stream").erase_options
    assert inside == {**before, "recompute_boundary_values": True}
    assert Variant.parse("erase+step/one-stream").erase_options == before


def test_kernel_families_per_step(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": n, "dur": d} for n, d in [
        ("nvjet_sm90_tst_128x128", 40), ("triton_poi_fused_gelu_3", 10),
        ("triton_red_fused_sum_1", 6), ("cudnn_generated_sdpa", 20), ("Memset", 2)]]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 99})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert segment_cost.kernel_families(str(path), steps=2) == {
        "matrix products": 20.0, "cuDNN (attention, conv)": 10.0, "Triton poi": 5.0,
        "Triton red": 3.0, "other": 1.0}
