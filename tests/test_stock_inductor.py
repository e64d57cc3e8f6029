"""With Inductor inside, erase_fx is stock Inductor wherever it schedules nothing.

erase_fx plugs into stock ``compile_fx`` as its partitioner and inner
compiler, so Inductor's own passes (pre-grad, joint-graph, post-grad), its
decompositions and its layout choices run as they do for
``torch.compile(model)``. These tests compare the code Inductor generates,
not only gradients, and pin the random ops (dropout) that once failed in
Inductor's joint-graph passes when erase_fx ran them itself, outside
Inductor's fake mode.
"""
import copy
import json
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import erase_fx
from erase_fx.emit import inductor_segments
from graphs import assert_same_grads

RAISE = {"on_error": "raise"}


class ConvNet(nn.Module):
    """A small conv net in train mode: BatchNorm, dropout, one loss (nothing to run early)."""

    def __init__(self, dropout: float = 0.2):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(dropout),
            nn.Conv2d(8, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))

    def forward(self, x, labels):
        return F.cross_entropy(self.body(x), labels)


class LocalLossStages(nn.Module):
    """Stages, each with a local head and cross-entropy; each stage reads the last one detached."""

    def forward(self, x, labels):
        loss = x.new_zeros(())
        for stage, head in zip(self.stages, self.heads):
            x = stage(x)
            loss = loss + F.cross_entropy(head(x), labels)
            x = x.detach()
        return loss


class DetachedConvStages(LocalLossStages):
    """Three detached conv stages, each with a local conv head (the DGL style)."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        widths = (3, 8, 16, 16)
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                          nn.Dropout(dropout))
            for i, o in zip(widths, widths[1:]))
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, 8, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 5))
            for c in widths[1:])



class DropoutChain(LocalLossStages):
    """Detached Linear-ReLU-Dropout stages with local heads: dropout in every early block."""

    def __init__(self, stages: int = 3, d: int = 16, p: float = 0.3):
        super().__init__()
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Dropout(p)) for _ in range(stages))
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Dropout(p), nn.Linear(d, 3)) for _ in range(stages))



def image_inputs():
    return torch.randn(4, 3, 12, 12), torch.randint(0, 5, (4,))


def vector_inputs():
    return torch.randn(8, 16), torch.randint(0, 3, (8,))


def generated_code(model, inputs, train=True, **compile_kwargs):
    """The code Inductor generated for one step of ``model``, AOT graph ids blanked out."""
    torch._dynamo.reset()
    compiled = torch.compile(model, **compile_kwargs)

    def step():
        if not train:
            with torch.no_grad():
                return compiled(*inputs)
        loss = compiled(*inputs)
        loss.backward()
        return loss

    _, code = run_and_get_code(step)
    return [re.sub(r"# AOT ID: \['\d+_", "# AOT ID: ['", c) for c in code]


@pytest.mark.parametrize("train, dropout", [(True, 0.2), (True, 0.0), (False, 0.2)],
                         ids=["training", "training-no-dropout", "inference"])
def test_a_graph_with_no_early_block_compiles_to_stock_inductors_code(train, dropout):
    model, inputs = ConvNet(dropout), image_inputs()
    if not train:
        model.eval()
    stock = generated_code(copy.deepcopy(model), inputs, train)
    with erase_fx.collect_reports() as reports:
        erased = generated_code(copy.deepcopy(model), inputs, train,
                                backend="erase", options=RAISE)
    assert reports[0].blocks == ()
    assert len(stock) == (2 if train else 1)
    assert erased == stock


@pytest.mark.parametrize("stages_on_side", [None, True], ids=["default", "stages-on-side"])
def test_dropout_in_early_blocks_matches_stock_inductors_masks(stages_on_side, tmp_path):
    """Inductor's random ops draw the same masks in erase's segments as in the whole graph,
    also when a block's stage, dropout included, runs on its side stream."""
    model, inputs = DropoutChain(), vector_inputs()
    stock, erased = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(1)
    torch.compile(stock)(*inputs).backward()
    options = {**RAISE, "tuning": {"stages_on_side": stages_on_side}, "dump_dir": str(tmp_path)}
    with erase_fx.collect_reports() as reports:
        torch.manual_seed(1)
        torch.compile(erased, backend="erase", options=options)(*inputs).backward()
    segments = json.loads(next(tmp_path.glob("graph_*/*.segments.json")).read_text())
    random_stages = [s["name"] for s in segments
                     if s["stage"] and any("inductor_random" in n for n in s["nodes"])]
    assert len(random_stages) == (2 if stages_on_side else 0)
    assert len(reports[0].blocks) == 2
    assert_same_grads(stock, erased, rtol=1e-5, atol=1e-6)
    zero_rows = (erased.stages[0][0].weight.grad == 0).all(dim=1)
    assert 0 < int(zero_rows.sum()) < 16  # the masks dropped something, and not everything


@pytest.mark.parametrize("stages_on_side", [None, True], ids=["default", "stages-on-side"])
def test_dropout_with_fallback_random_matches_eager(stages_on_side):
    """``fallback_random``: Inductor draws eager's random numbers; so does erase."""
    model, inputs = DropoutChain(), vector_inputs()
    eager, erased = copy.deepcopy(model), copy.deepcopy(model)
    with torch._inductor.config.patch(fallback_random=True):
        torch.manual_seed(2)
        eager(*inputs).backward()
        torch.manual_seed(2)
        torch.compile(erased, backend="erase",
                      options={**RAISE, "tuning": {"stages_on_side": stages_on_side}})(*inputs).backward()
    assert_same_grads(eager, erased, rtol=1e-5, atol=1e-6)


def test_dropout_masks_are_fresh_each_step():
    model, inputs = DropoutChain(), vector_inputs()
    compiled = torch.compile(model, backend="erase", options=RAISE)
    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        compiled(*inputs).backward()
        grads.append(model.stages[0][0].weight.grad.clone())
    assert not torch.equal(*grads)


def test_conv_stages_keep_the_whole_forwards_layout_and_match_stock(monkeypatch):
    """Segments compile with the whole forward's layout choice, for the strides producers make."""
    calls = []
    real = torch._inductor.compile_fx.compile_fx_inner

    def recording(gm, example_inputs, **kwargs):
        calls.append(([tuple(v.stride()) if isinstance(v, torch.Tensor) else None
                       for v in example_inputs], kwargs.get("layout_opt")))
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", recording)
    model, inputs = DetachedConvStages(), image_inputs()
    stock, erased = copy.deepcopy(model), copy.deepcopy(model)
    torch.compile(stock)(*inputs).backward()
    calls.clear()
    with erase_fx.collect_reports() as reports:
        torch.compile(erased, backend="erase", options=RAISE)(*inputs).backward()
    assert len(reports[0].blocks) == 2
    assert_same_grads(stock, erased, rtol=1e-4, atol=1e-5)
    segment_calls = calls[:-1]  # the last compile is the backward's
    assert len(segment_calls) > 1
    assert {layout for _, layout in segment_calls} == {True}  # CPU + mkldnn: channels-last
    channels_last = [s for strides, _ in segment_calls[1:] for s in strides
                     if s is not None and len(s) == 4 and s[1] == 1]
    assert channels_last, "no segment read a channels-last activation made by an earlier one"


def test_segments_keep_fx_strides_for_user_visible_outputs(monkeypatch):
    """Only the forward's user-visible outputs are held to FX strides in the segments."""
    model, inputs = DetachedConvStages(), image_inputs()
    captured = {}
    real = inductor_segments.mark_outputs_user_visible

    def recording(gm, indices=None):
        captured[id(gm)] = indices
        real(gm, indices)

    monkeypatch.setattr(inductor_segments, "mark_outputs_user_visible", recording)
    torch.compile(model, backend="erase", options=RAISE)(*inputs).backward()
    visible_counts = [len(v) for v in captured.values() if v is not None]
    assert len(captured) > 1 and sum(visible_counts) >= 1
    assert all(v is not None for v in captured.values())  # static shapes: strides flow


class WideChain(LocalLossStages):
    """Detached Linear-ReLU stages 1100 wide: rows Inductor pads on a GPU (stride 1100 > 1024)."""

    def __init__(self, stages: int = 3, d: int = 1100):
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU())
                                    for _ in range(stages))
        self.heads = nn.ModuleList(nn.Linear(d, 5) for _ in range(stages))



def test_early_gradients_keep_the_parameters_layout_under_padding(monkeypatch):
    """Padded (non-dense) early grads would be copied by AccumulateGrad and scaled out of place.

    Inductor pads rows of non-user-visible outputs on GPUs (comprehensive
    padding, forced on here for the CPU): erase's early grads must keep the
    FX strides so that every one of them is scaled in place, no copy.
    """
    from erase_fx.emit import scale_grads

    in_place = []
    real = scale_grads.scale_unless_one_
    monkeypatch.setattr(scale_grads, "scale_unless_one_",
                        lambda tensors, scale: (in_place.extend(tensors), real(tensors, scale)))
    model, inputs = WideChain(), (torch.randn(8, 1100), torch.randint(0, 5, (8,)))
    # NB: no FX graph cache: its key does not see which outputs are user-visible
    with torch._inductor.config.patch(comprehensive_padding=True, disable_padding_cpu=False,
                                      fx_graph_cache=False), \
            erase_fx.collect_reports() as reports:
        torch.compile(model, backend="erase", options=RAISE)(*inputs).backward()
    early = sum(len(b.params) for b in reports[0].blocks)
    assert early == 8  # two early blocks: stage and head weight and bias each
    assert len(in_place) == early
    assert all(t.is_contiguous() for t in in_place)


def test_a_cached_segment_with_other_strides_is_compiled_again(monkeypatch):
    """Inductor's FX graph cache does not key on user-visible outputs: erase checks and recompiles."""
    import erase_fx.compilation as compilation
    from erase_fx.emit import scale_grads

    in_place = []
    real = scale_grads.scale_unless_one_
    monkeypatch.setattr(scale_grads, "scale_unless_one_",
                        lambda tensors, scale: (in_place.extend(tensors), real(tensors, scale)))
    model, inputs = WideChain(), (torch.randn(8, 1100), torch.randint(0, 5, (8,)))
    keep = compilation.keep_early_values_at_fx_strides
    with torch._inductor.config.patch(comprehensive_padding=True, disable_padding_cpu=False,
                                      fx_graph_cache=True):
        # first: the segments cached with the early grads padded
        monkeypatch.setattr(compilation, "keep_early_values_at_fx_strides", lambda fw: None)
        torch.compile(copy.deepcopy(model), backend="erase", options=RAISE)(*inputs).backward()
        torch._dynamo.reset()
        in_place.clear()
        monkeypatch.setattr(compilation, "keep_early_values_at_fx_strides", keep)
        torch.compile(copy.deepcopy(model), backend="erase", options=RAISE)(*inputs).backward()
    assert len(in_place) == 8


def _segment_returning(example: torch.Tensor, early: bool,
                       grad_of: int | None = 0) -> torch.fx.GraphModule:
    """A segment that returns ``x * 2`` (tagged early, the gradient of primal ``grad_of``, or not
    early), its example value ``example``."""
    from erase_fx.passes.node_meta import NodeMeta, Role, set_meta

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    y.meta["val"] = example
    if early:
        set_meta(y, NodeMeta(Role.EARLY_BACKWARD, block=0, grad_of=grad_of))
    graph.output((y, x))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("example, memory_format", [
    (torch.empty(8, 4, 3, 3), torch.contiguous_format),
    (torch.empty(8, 4, 3, 3).to(memory_format=torch.channels_last), torch.channels_last),
    (torch.empty(2, 8, 4, 3, 3).to(memory_format=torch.channels_last_3d),
     torch.channels_last_3d),
    (torch.empty(4, 8).t(), None),  # strides that are no memory format: left alone
], ids=["contiguous", "channels-last", "channels-last-3d", "transposed"])
def test_early_outputs_are_returned_through_a_clone_to_their_fx_memory_format(example,
                                                                              memory_format):
    segment = _segment_returning(example, early=True)
    pinned = inductor_segments.pin_early_outputs_to_fx_layout(segment, [0, 1])
    returned = list(segment.graph.find_nodes(op="output")[0].args[0])
    if memory_format is None:
        assert pinned == [] and returned[0].target is torch.ops.aten.mul.Tensor
        return
    assert pinned == [0]  # the placeholder (output 1) is not an early value
    clone = returned[0]
    assert clone.target is torch.ops.aten.clone.default
    assert clone.kwargs == {"memory_format": memory_format}
    assert clone.meta["val"].stride() == example.stride()
    assert inductor_segments.is_early(clone)
    x = torch.randn(example.shape)
    got = segment(x)[0]
    assert torch.equal(got, x * 2) and got.is_contiguous(memory_format=memory_format)


def test_forward_values_and_early_parts_of_gradients_are_not_pinned():
    forward = _segment_returning(torch.empty(8, 4, 3, 3), early=False)
    assert inductor_segments.pin_early_outputs_to_fx_layout(forward, [0, 1]) == []
    # NB: a part a sum in the backward reads: no .grad to match, Inductor's layout stays
    part = _segment_returning(torch.empty(8, 4, 3, 3), early=True, grad_of=None)
    assert inductor_segments.pin_early_outputs_to_fx_layout(part, [0, 1]) == []


def test_a_pinned_early_value_costs_nothing_where_its_strides_agree(monkeypatch):
    """Inductor removes the clone when the segment makes the FX strides anyway (noop removal)."""
    model, inputs = DetachedConvStages(), image_inputs()
    pinned = []
    real = inductor_segments.pin_early_outputs_to_fx_layout
    monkeypatch.setattr(inductor_segments, "pin_early_outputs_to_fx_layout",
                        lambda segment, indices: pinned.extend(real(segment, indices)))
    with torch._inductor.config.patch(fx_graph_cache=False):
        with_pins = generated_code(copy.deepcopy(model), inputs, backend="erase", options=RAISE)
        monkeypatch.setattr(inductor_segments, "pin_early_outputs_to_fx_layout",
                            lambda segment, indices: [])
        without = generated_code(copy.deepcopy(model), inputs, backend="erase", options=RAISE)
    assert pinned  # the early grads went through the clones
    assert with_pins == without


def test_every_early_gradient_of_a_parameter_is_pinned(monkeypatch):
    """Each early parameter gradient a segment returns goes through the pin (a pass that lost
    the ``grad_of`` tag would leave a conv weight's gradient in Inductor's layout on a GPU)."""
    pinned = []
    real = inductor_segments.pin_early_outputs_to_fx_layout
    monkeypatch.setattr(inductor_segments, "pin_early_outputs_to_fx_layout",
                        lambda segment, indices: pinned.extend(real(segment, indices)))
    with erase_fx.collect_reports() as reports:
        torch.compile(DetachedConvStages(), backend="erase", options=RAISE)(
            *image_inputs()).backward()
    early_params = sum(len(b.params) for b in reports[0].blocks)
    assert early_params == 16 and len(pinned) == early_params
