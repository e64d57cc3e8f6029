"""explain runs the model itself, not a copy, and puts back what its forward changed.

A copy cannot always be made (a module holding an ``autograd.Function``
instance cannot be pickled, so ``copy.deepcopy`` fails), so explain runs
the user's model and restores its tensors' values, its modules' attributes
and the random number generators.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import erase_fx
from break_models import FunctionInstance, inputs
from erase_fx.explain import _TensorValues
from graphs import BatchNormBlocks, Chain, chain_inputs


def test_explain_runs_on_a_model_that_cannot_be_deep_copied():
    model = FunctionInstance()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    reports = erase_fx.explain(model, *inputs())
    assert reports and sum(len(r.blocks) for r in reports) == 1
    assert isinstance(model.pass_gradient, torch.autograd.Function)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_buffers_a_forward_updates_are_put_back_and_parameters_keep_their_versions():
    model = BatchNormBlocks()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    versions = {name: p._version for name, p in model.named_parameters()}
    erase_fx.explain(model, torch.randn(8, 8), torch.randint(0, 3, (8,)))
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    assert {name: p._version for name, p in model.named_parameters()} == versions
    assert all(p.grad is None for p in model.parameters())


class Logging(nn.Module):
    """A detached pair of blocks with dropout, whose forward keeps state on the module as
    training code does: a tensor with history, a step counter, a list of losses."""

    def __init__(self):
        super().__init__()
        self.b1 = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.5))
        self.head1 = nn.Linear(16, 5)
        self.b2 = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.head2 = nn.Linear(16, 5)
        self.steps = 0
        self.losses = []

    def forward(self, x, labels):
        h = self.b1(x)
        loss1 = F.cross_entropy(self.head1(h), labels)
        self.last_hidden = h  # kept for logging, with its history
        self.steps += 1
        self.losses.append(loss1.detach())
        return loss1 + F.cross_entropy(self.head2(self.b2(h.detach())), labels)


def test_attributes_a_forward_sets_and_the_random_generator_are_put_back():
    model, example = Logging(), chain_inputs()
    state = torch.get_rng_state()
    erase_fx.explain(model, *example)
    assert not hasattr(model, "last_hidden")
    assert model.steps == 0 and model.losses == []
    assert torch.equal(torch.get_rng_state(), state)  # the dropout masks drawn are taken back


def test_a_bound_forward_is_explained_with_its_modules_state_kept():
    model = Logging()
    erase_fx.explain(model.forward, *chain_inputs())
    assert model.steps == 0 and not hasattr(model, "last_hidden")


def test_the_same_model_is_explained_again_and_then_compiled_with_its_own_options():
    model = Chain(3)
    for _ in range(3):
        (report,) = erase_fx.explain(model, *chain_inputs())
        assert len(report.blocks) == 2
    # NB: Dynamo keys compiled code by backend: explain's is never the user's
    with erase_fx.collect_reports() as reports:
        compiled = torch.compile(model, backend="erase",
                                 options={"inner": "aot_eager", "streams": 2, "on_error": "raise"})
        compiled(*chain_inputs()).backward()
    (report,) = reports
    assert report.streams == 2 and len(report.blocks) == 2


def test_a_write_through_data_is_put_back_and_an_untouched_tensor_keeps_its_version():
    module = nn.Linear(4, 4)
    kept = _TensorValues([module])
    weight, bias_version = module.weight.clone(), module.bias._version
    module.weight.data.mul_(2)  # moves no version counter of the parameter
    kept.restore()
    assert torch.equal(module.weight, weight)
    assert module.bias._version == bias_version


def test_a_model_with_lazy_parameters_is_refused_with_the_fix_and_left_lazy():
    model = nn.Sequential(nn.LazyLinear(5))
    with pytest.raises(erase_fx.EraseError, match="run one forward of the model on a batch"):
        erase_fx.explain(model, torch.randn(4, 3))
    assert isinstance(model[0], nn.LazyLinear)
