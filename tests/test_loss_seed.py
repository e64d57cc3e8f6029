"""Loss scaling: the seed early blocks run at, given or learned (`erase_fx.emit.loss_seed`).

A GradScaler makes the loss gradient ``T`` its scale. In float32 a given seed is
exact up to rounding; in float16 the seed must follow ``T``, or the early
gradients underflow where eager's do not. Each check compares every
parameter's gradient against eager (aot_eager inside) or against stock Inductor
(Inductor inside), after every step.
"""
import copy

import pytest
import torch
import torch.nn as nn

import erase_fx
from erase_fx.config import EraseConfig
from erase_fx.emit import loss_seed
from erase_fx.emit.loss_seed import LossSeed, UntilSeeded
from erase_fx.passes import RejectReason, run_pass
from erase_fx.passes.pipeline import FIND_STOP_GRADIENT_BLOCKS
from graphs import (
    Chain,
    Float16Chain,
    GraphBreakChain,
    InFloat16,
    assert_same_grads,
    chain_inputs,
    trace_joint,
)

SCALE = 2.0 ** 16  # a GradScaler's first scale


def reports_of(fn):
    with erase_fx.collect_reports() as reports:
        fn()
    return reports


def bitwise(eager, erased):
    assert_same_grads(eager, erased, rtol=0, atol=0)


def close_to_largest(reference, erased, share):
    """Every gradient within ``share`` of the largest element of the reference's."""
    for (name, p), (_, q) in zip(reference.named_parameters(), erased.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0,
                                   atol=share * p.grad.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


def compiled_pair(model, options, inner="aot_eager", **compile_kwargs):
    """(reference, erased) copies of ``model`` and their callables: the reference is eager
    with aot_eager inside, stock Inductor with Inductor inside."""
    reference, erased = model, copy.deepcopy(model)
    run_reference = reference if inner == "aot_eager" else torch.compile(reference)
    run_erased = torch.compile(erased, backend="erase", **compile_kwargs,
                               options={"inner": inner, "on_error": "raise", **options})
    return (reference, run_reference), (erased, run_erased)


def scaler_steps(model, options, *, scale, check, steps=2, batch=6, inner="aot_eager"):
    """Reference and erase copies of ``model`` trained ``steps`` times with GradScalers at
    ``scale`` (gradients left scaled, as a GradScaler's step reads them), ``check(reference,
    erased)`` after each step; returns the erase reports."""
    pair = compiled_pair(model, options, inner)
    scalers = [torch.amp.GradScaler("cpu", init_scale=scale) for _ in pair]

    def train():
        for _ in range(steps):
            inputs = chain_inputs(batch=batch)
            for (module, run), scaler in zip(pair, scalers):
                module.zero_grad(set_to_none=True)
                scaler.scale(run(*inputs)).backward()
            check(pair[0][0], pair[1][0])
    return reports_of(train)


@pytest.fixture
def programs_run(monkeypatch):
    """Which compilation each call of a float16 graph ran: 'stock' or 'erase'."""
    ran = []
    call = UntilSeeded.__call__

    def recording(self, *args):
        erase = self.seed.known and (self._erase_ran or not loss_seed.stream_capturing())
        ran.append("erase" if erase else "stock")
        return call(self, *args)

    monkeypatch.setattr(UntilSeeded, "__call__", recording)
    return ran


# -- a given seed ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1.0, 1024.0])
def test_grad_scaler_scaled_seed(seed):
    scale = 2.0 ** 12
    scaler_steps(Chain(3), {"seed": seed}, scale=scale, check=lambda eager, erased:
                 assert_same_grads(eager, erased, rtol=1e-5, atol=1e-6 * scale))


def test_float16_blocks_run_early_at_a_given_seed():
    # NB: T == seed: nothing to scale
    reports = scaler_steps(Float16Chain(), {"seed": SCALE}, scale=SCALE, check=bitwise, batch=64)
    assert len(reports[0].blocks) == 2


class HalfParameters(nn.Module):
    """Detached float16 stages, each with a local cross-entropy computed in float32."""

    def __init__(self, stages=3, d=16, classes=5):
        super().__init__()
        self.stages = nn.ModuleList(nn.Linear(d, d) for _ in range(stages)).half()
        self.heads = nn.ModuleList(nn.Linear(d, classes) for _ in range(stages)).half()

    def forward(self, x, labels):
        loss = 0.0
        for stage, head in zip(self.stages, self.heads):
            x = torch.relu(stage(x))
            loss = loss + nn.functional.cross_entropy(head(x).float(), labels)
            x = x.detach()
        return loss


def test_float16_gradients_scaled_by_a_scale_float16_cannot_hold():
    """Float16 parameters, seed 1, T = 2**16 (above float16's largest, 65504): the early
    gradients are multiplied by T in float32, as torch's mul does (cast to float16 first,
    the scale was infinite, and so was every early gradient)."""
    eager_model = HalfParameters()
    erased_model = copy.deepcopy(eager_model)
    compiled = torch.compile(erased_model, backend="erase",
                             options={"inner": "aot_eager", "on_error": "raise", "seed": 1.0})
    x, labels = chain_inputs(batch=64)
    (eager_model(x.half(), labels) * SCALE).backward()
    reports = reports_of(lambda: (compiled(x.half(), labels) * SCALE).backward())
    assert len(reports[0].blocks) == 2
    # NB: at seed 1 the float16 early backward rounds where eager's at 2**16 does not
    assert_same_grads(eager_model, erased_model, rtol=2e-2, atol=2e-2 * SCALE / 64)


# -- a learned seed --------------------------------------------------------------------


def test_float16_blocks_run_early_at_the_last_loss_gradient(programs_run):
    """No seed given: the first step runs as aot_eager and teaches the graph T;
    from the second on, the early blocks run at it, bitwise as eager (at seed 1, nearly
    every element of their gradients differed)."""
    reports = scaler_steps(Float16Chain(), {}, scale=SCALE, check=bitwise, steps=4, batch=64)
    assert len(reports[0].blocks) == 2 and reports[0].learned_seed
    assert programs_run == ["stock", "erase", "erase", "erase"]


def test_the_report_says_the_seed_is_learned():
    from erase_fx.report_text import format_reports

    text = format_reports(erase_fx.explain(Float16Chain(), *chain_inputs()))
    assert "float16: the blocks run at the loss gradient of the last backward" in text
    assert "float16" not in format_reports(erase_fx.explain(Chain(3), *chain_inputs()))


def test_float16_with_dynamic_shapes(programs_run):
    """The seed is a static 0-d input whatever the graph's shapes."""
    pair = compiled_pair(Float16Chain(), {}, dynamic=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=SCALE) for _ in pair]
    for batch in (64, 48, 80, 33):
        inputs = chain_inputs(batch=batch)
        for (module, run), scaler in zip(pair, scalers):
            module.zero_grad(set_to_none=True)
            scaler.scale(run(*inputs)).backward()
        bitwise(pair[0][0], pair[1][0])
    assert programs_run == ["stock", "erase", "erase", "erase"]


def test_float16_with_inductor_inside_as_stock_inductor(programs_run):
    """Inductor inside: as stock Inductor up to float16's rounding where the segments cut
    its fusions (2 ulps of the largest gradient; at seed 1 the early gradients were off by
    up to 35x)."""

    reports = scaler_steps(Float16Chain(), {}, scale=SCALE, steps=3, batch=64,
                           inner="inductor", check=lambda stock, erased: close_to_largest(
                               stock, erased, 2 * 2.0 ** -10))
    assert len(reports[0].blocks) == 2
    assert programs_run == ["stock", "erase", "erase"]


def test_a_float16_graph_ended_at_a_graph_break_runs_its_last_block_there(programs_run):
    """The seed is added to a copy of Dynamo's graph, which keeps Dynamo's record of the
    graph break: the first graph's last block runs at its end, as in float32."""
    blocks = {}
    for name, model in (("float32", GraphBreakChain()), ("float16", InFloat16(GraphBreakChain()))):
        reports = scaler_steps(model, {}, scale=SCALE, check=bitwise, steps=3, batch=64)
        blocks[name] = [[b.at_graph_end for b in r.blocks] for r in reports if r.blocks]
    assert blocks["float16"] == blocks["float32"] == [[False, True], [False]]
    assert programs_run == ["stock", "stock", "erase", "erase", "erase", "erase"]


def scaler_training(steps, *, init_scale, growth_interval, check=None, batch=64):
    """Eager and erase copies of `Float16Chain` trained with SGD under GradScalers;
    ``check(eager, erased)`` after each backward. Returns, per copy, each step's
    (scale, skipped)."""
    pair = compiled_pair(Float16Chain(), {})
    scalers = [torch.amp.GradScaler("cpu", init_scale=init_scale,
                                    growth_interval=growth_interval) for _ in pair]
    optimizers = [torch.optim.SGD(module.parameters(), lr=0.1) for module, _ in pair]
    history = ([], [])
    for _ in range(steps):
        inputs = chain_inputs(batch=batch)
        for (module, run), scaler, optimizer, steps_taken in zip(pair, scalers, optimizers,
                                                                 history):
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(run(*inputs)).backward()
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            steps_taken.append((scale, scaler.get_scale() < scale))
        if check is not None:
            check(pair[0][0], pair[1][0])
    return history


def test_a_growing_scale_keeps_the_gradients_exact():
    """The scale doubles at every step: each early backward runs at half the step's T and
    is scaled by 2, which float16 does exactly away from its denormals."""
    eager, erased = scaler_training(5, init_scale=2.0 ** 10, growth_interval=1,
                                    check=lambda eager, erased: assert_same_grads(
                                        eager, erased, rtol=1e-3, atol=1e-5))
    assert [scale for scale, _ in eager] == [2.0 ** (10 + i) for i in range(5)]
    assert erased == eager


def test_a_backoff_costs_at_most_one_more_skipped_step_not_a_stall():
    """The scale grows every step until float16 overflows, then backs off. After a backoff
    the early copy runs at the scale that overflowed, once: the scaler may skip one more
    step than eager's. It never skips from then on, as a fixed seed above the scale
    would."""
    eager, erased = scaler_training(16, init_scale=2.0 ** 26, growth_interval=1)
    eager_skips = [skipped for _, skipped in eager]
    erased_skips = [skipped for _, skipped in erased]
    assert any(eager_skips), "the test needs float16 to overflow"
    backoffs = sum(1 for i, skipped in enumerate(eager_skips)
                   if skipped and (i == 0 or not eager_skips[i - 1]))
    assert sum(erased_skips) <= sum(eager_skips) + backoffs
    assert not all(erased_skips[-4:])


def test_a_forward_and_its_backward_agree_on_the_seed_whatever_runs_between():
    """Two forwards, then their backwards in the other order, at different scales: the
    second backward teaches the seed its T before the first backward runs; the first
    still divides by the seed its own forward ran at (by the seed the second taught, its
    gradients would be 16x off). The second's early backward runs at 16x its T: fewer
    elements underflow than in eager's (rounding, below 1e-3 of the largest gradient)."""
    reference, erased = compiled_pair(Float16Chain(), {})
    for _ in range(3):
        batches = [chain_inputs(batch=64) for _ in range(2)]
        for module, run in (reference, erased):
            module.zero_grad(set_to_none=True)
            first, second = (run(*inputs) for inputs in batches)
            (second * 2.0 ** 12).backward()
            (first * SCALE).backward()
        close_to_largest(reference[0], erased[0], 1e-3)


# -- the parts -------------------------------------------------------------------------


def test_the_analysis_keeps_float16_blocks_in_the_backward_without_a_seed():
    """Without a given or learned seed, a float16 block stays in the backward,
    and the reason names the fix; with the seed's input, it runs early."""
    joint = trace_joint(Float16Chain(), *chain_inputs())
    cfg = EraseConfig(inner="aot_eager")
    refused = run_pass(FIND_STOP_GRADIENT_BLOCKS, joint.gm, cfg,
                       num_fwd_outputs=joint.num_fwd_outputs).artifact
    assert not refused.blocks
    assert {r.reason for r in refused.rejected} == {RejectReason.FLOAT16_SEED,
                                                     RejectReason.LAST_BLOCK}
    assert "options={'seed': s}" in refused.rejected[0].detail
    seed_input = next(iter(joint.gm.graph.find_nodes(op="placeholder"))).name
    learned = run_pass(FIND_STOP_GRADIENT_BLOCKS, joint.gm, cfg, seed_input=seed_input,
                       num_fwd_outputs=joint.num_fwd_outputs).artifact
    assert len(learned.blocks) == 2


def outputs_with_gradient(*shapes):
    """One node's outputs, as a compiled graph's are (one autograd node for all)."""
    x = torch.ones(sum(int(torch.Size(s).numel()) for s in shapes), requires_grad=True)
    return x.split([int(torch.Size(s).numel()) for s in shapes])


@pytest.mark.parametrize("grad, learned", [
    (torch.tensor([3.0, -8.0]), 8.0),          # the largest magnitude
    (torch.tensor([float("inf"), 1.0]), 1.0),  # not finite: kept
    (torch.tensor([float("nan"), 2.0]), 1.0),
    (torch.tensor([0.0, 0.0]), 1.0),           # zero: kept
])
def test_the_seed_is_the_largest_finite_loss_gradient(grad, learned):
    seed = LossSeed(torch.device("cpu"))
    seed.losses = (0,)
    (loss, other) = outputs_with_gradient((2,), (3,))
    seed.watch((loss, other))
    torch.autograd.backward([loss, other], [grad, torch.full((3,), 1e6)])
    assert seed.known and seed.value.item() == learned


def test_until_seeded_runs_stock_until_a_backward_teaches_the_seed(monkeypatch):
    seed = LossSeed(torch.device("cpu"))
    seed.losses = (0,)
    switch = UntilSeeded(lambda: "erase", lambda: outputs_with_gradient((), (2,)), seed)
    loss, _ = switch()
    assert not seed.known
    (loss * 4.0).backward()
    assert seed.known and seed.value.item() == 4.0
    # NB: erase's program never runs for the first time under a capture (its backward
    # would compile there): stock is captured instead
    monkeypatch.setattr(loss_seed, "stream_capturing", lambda: True)
    assert switch() != "erase"
    monkeypatch.setattr(loss_seed, "stream_capturing", lambda: False)
    assert switch() == "erase"
    monkeypatch.setattr(loss_seed, "stream_capturing", lambda: True)
    assert switch() == "erase"


def test_the_seed_is_a_static_input_of_the_forward(monkeypatch):
    """Pins AOTAutograd reading the placeholder erase_fx adds to a copy of Dynamo's graph
    (``_dynamo_source``, ``tensor_dict``, ``_param_name_to_source``, torch 2.11-2.14): the
    seed is its last input, and a static one (a CUDA graph reads it in place)."""
    from erase_fx import compilation

    seen = []
    graph_forward = compilation.graph_forward

    def recording(compiled, example_inputs, *, fw_metadata, **kwargs):
        seen.append((len(example_inputs), list(fw_metadata.static_input_indices),
                     example_inputs[-1]))
        return graph_forward(compiled, example_inputs, fw_metadata=fw_metadata, **kwargs)

    monkeypatch.setattr(compilation, "graph_forward", recording)
    model = Float16Chain()
    compiled = torch.compile(model, backend="erase",
                             options={"inner": "aot_eager", "on_error": "raise"})
    compiled(*chain_inputs()).backward()
    ((count, static, last),) = seen
    # NB: the parameters too: the copy of Dynamo's graph the seed is added to keeps what
    # AOTAutograd reads to tell them (without it, no input was static)
    assert count - 1 in static and len(static) == len(list(model.parameters())) + 1
    assert last.shape == () and last.dtype == torch.float32


def test_a_float16_graph_is_a_stock_candidate_too(monkeypatch, programs_run):
    """Inside a compile_step with ``Tuning.stock_candidate``: the switch's erase side is the
    graph's stock-until-seeded program, its stock side the stock candidate; gradients
    bitwise as eager whichever runs."""
    from erase_fx import backend as backend_module
    from erase_fx.capture_tuning import STOCK_CHOICE
    from erase_fx.emit.capture_scope import StepScope
    from erase_fx.emit.stock_switch import StockSwitch

    built = []
    monkeypatch.setattr(backend_module, "StockSwitch",
                        lambda *args: built.append(StockSwitch(*args)) or built[-1])
    eager = Float16Chain()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="erase", options={
        "inner": "aot_eager", "on_error": "raise", "tuning": {"stock_candidate": True}})
    scope = StepScope()
    for choice in (None, None, STOCK_CHOICE, None):
        inputs = chain_inputs(batch=64)
        for module, run in ((eager, eager), (model, compiled)):
            module.zero_grad(set_to_none=True)
            with scope.entered():
                if choice is None:
                    (run(*inputs) * SCALE).backward()
                else:
                    with scope.trying(choice):
                        (run(*inputs) * SCALE).backward()
        bitwise(eager, model)
    assert len(built) == 1
    # NB: the third step ran the stock candidate, past the seeded program
    assert programs_run == ["stock", "erase", "erase"]
