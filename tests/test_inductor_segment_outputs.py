"""Segment outputs Inductor must hand on as they are: views of a larger tensor, unbacked sizes.

Two crashes of `erase_fx.emit.inductor_segments` seen on code as users
write it (issue 36), each reproduced here with ``on_error="raise"`` (the
default fallback would hide them behind a stock compile):

- a multi-task model (shared experts, a gate and a tower per task, local
  losses on detached inputs) returns per-task slices of a stacked tensor:
  user-visible outputs whose strides are those of a view, not dense, which
  the segments' padding check took for padding;
- a boolean mask between detached blocks under
  ``capture_dynamic_output_shape_ops``: values whose sizes are unbacked
  symbols cross segments (the row count itself, a SymInt), and Inductor
  reports no strides for those; and a segment reading a tensor of
  data-dependent size was told by its input's meta that it binds the size.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import erase_fx
from graphs import assert_same_grads

RAISE = {"on_error": "raise"}


class MultiTaskTowers(nn.Module):
    """MMoE-style: shared experts, a softmax gate per task mixing them, a tower per task.

    The tasks' mixtures are stacked into one ``(batch, tasks, hidden)``
    tensor; each tower reads its slice, and an auxiliary head per task
    learns from the slice detached (a local loss). The forward returns the
    loss and each task's slice (views of the stacked tensor, not dense).
    """

    def __init__(self, d: int = 32, experts: int = 4, tasks: int = 2, hidden: int = 32):
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.ReLU())
                                     for _ in range(experts))
        self.gates = nn.ModuleList(nn.Linear(d, experts) for _ in range(tasks))
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
            for _ in range(tasks))
        self.aux_heads = nn.ModuleList(nn.Linear(hidden, 1) for _ in range(tasks))

    def forward(self, x: torch.Tensor, targets: torch.Tensor):
        experts = torch.stack([expert(x) for expert in self.experts], dim=1)
        mixed = torch.cat([F.softmax(gate(x), dim=-1).unsqueeze(1) @ experts
                           for gate in self.gates], dim=1)
        loss = x.new_zeros(())
        for task, (tower, aux) in enumerate(zip(self.towers, self.aux_heads)):
            h = mixed[:, task:task + 1]
            target = targets[:, task]
            loss = loss + F.mse_loss(aux(h.detach()).flatten(), target)
            loss = loss + F.binary_cross_entropy_with_logits(tower(h).flatten(), target)
        return (loss, *(mixed[:, task:task + 1] for task in range(len(self.towers))))


def multi_task_inputs(batch: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 32), torch.rand(batch, 2)


def test_sliced_outputs_of_a_multi_task_model_compile_in_segments_as_stock_does():
    model, inputs = MultiTaskTowers(), multi_task_inputs()
    stock, erased = copy.deepcopy(model), copy.deepcopy(model)
    expected = torch.compile(stock)(*inputs)
    expected[0].backward()
    with erase_fx.collect_reports() as reports:
        outputs = torch.compile(erased, backend="erase", options=RAISE)(*inputs)
    outputs[0].backward()
    (report,) = reports
    assert report.blocks and report.fallback_reason is None
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got.stride() == want.stride()  # a view of the stacked tensor, as eager's
    assert expected[1].stride() == (64, 32, 1)  # the user-visible outputs are not dense
    assert_same_grads(stock, erased, rtol=1e-4, atol=1e-5)


def _segment_returning_a_slice() -> torch.fx.GraphModule:
    """A segment returning ``x[:, 0:1]`` of a ``(64, 2, 32)`` input: FX strides (64, 32, 1)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(64, 2, 32)
    view = graph.call_function(torch.ops.aten.slice.Tensor, (x, 1, 0, 1))
    view.meta["val"] = x.meta["val"][:, 0:1]
    graph.output((view,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("strides, unpadded", [
    ((64, 32, 1), True),   # the view's own strides: eager's, not dense
    ((32, 32, 1), True),   # dense: a layout Inductor chose
    ((72, 32, 1), False),  # rows padded to 72
], ids=["fx-strides-of-a-view", "dense", "padded"])
def test_a_view_at_its_fx_strides_is_not_taken_for_padding(strides, unpadded):
    from erase_fx.emit.inductor_segments import _unpadded

    assert _unpadded(_segment_returning_a_slice(), [strides], [0]) is unpadded


# -- unbacked sizes: a boolean mask between detached blocks --------------------


class MaskedChain(nn.Module):
    """Three detached blocks with local heads; the second and third read only the rows the
    first keeps (a boolean mask: the row count is data-dependent). The second block reads
    them through a features-major copy, whose strides hold the row count."""

    def __init__(self, d: int = 16, classes: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(3))
        self.heads = nn.ModuleList(nn.Linear(d, classes) for _ in range(3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        loss = F.cross_entropy(self.heads[0](h), labels)
        h = h.detach()
        kept = h.sum(-1) > 0
        features_major = h[kept].t().contiguous()  # (d, rows): strides (rows, 1)
        labels = labels[kept]
        h = self.blocks[1](features_major.t())
        loss = loss + F.cross_entropy(self.heads[1](h), labels)
        h = self.blocks[2](h.detach())
        return loss + F.cross_entropy(self.heads[2](h), labels)


def masked_inputs(batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 16), torch.randint(0, 5, (batch,))


@pytest.fixture
def data_dependent_shapes():
    """Dynamo keeps a boolean mask in the graph (unbacked sizes) instead of breaking it."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        yield


@pytest.mark.usefixtures("data_dependent_shapes")
@pytest.mark.parametrize("inner", ["inductor", "aot_eager"])
def test_unbacked_sizes_between_detached_blocks_compile_in_segments(inner):
    model = MaskedChain()
    reference, erased = copy.deepcopy(model), copy.deepcopy(model)
    compiled_reference = torch.compile(reference) if inner == "inductor" else reference
    compiled = torch.compile(erased, backend="erase", options={**RAISE, "inner": inner})
    with erase_fx.collect_reports() as reports:
        for step in range(2):  # the second step: other rows kept, the same graph
            inputs = masked_inputs()
            for module in (reference, erased):
                module.zero_grad(set_to_none=True)
            compiled_reference(*inputs).backward()
            compiled(*inputs).backward()
            if inner == "aot_eager":
                assert_same_grads(reference, erased, rtol=0, atol=0)
            else:
                assert_same_grads(reference, erased, rtol=1e-4, atol=1e-5)
    (report,) = reports
    assert len(report.blocks) == 2 and report.fallback_reason is None


@pytest.mark.usefixtures("data_dependent_shapes")
def test_a_graph_with_unbacked_sizes_is_refused_cuda_graphs_as_stock_inductor_refuses_it():
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    from erase_fx.emit.cudagraphs import data_dependent_refusal
    from graphs import Chain, chain_inputs, trace_joint

    masked = trace_joint(MaskedChain(), *masked_inputs()).gm
    assert get_first_incompatible_cudagraph_node(masked) is not None
    assert data_dependent_refusal(masked).startswith("data-dependent sizes or values (node ")
    assert data_dependent_refusal(trace_joint(Chain(3), *chain_inputs()).gm) is None


@pytest.mark.usefixtures("data_dependent_shapes")
def test_the_compiled_forward_with_unbacked_sizes_is_refused_its_cuda_graph(monkeypatch):
    """The refusal reaches `graph_forward` (on CUDA the capture would fail at the mask's host
    read, or replay the captured step's sizes)."""
    from erase_fx import compilation

    asked = []
    monkeypatch.setattr(compilation, "graph_forward",
                        lambda compiled, *args, refusal=None, **kwargs: asked.append(refusal))
    compiled = torch.compile(MaskedChain(), backend="erase",
                             options={"inner": "aot_eager", "on_error": "raise"})
    compiled(*masked_inputs()).backward()
    assert asked and asked[0].startswith("data-dependent sizes or values (node ")
