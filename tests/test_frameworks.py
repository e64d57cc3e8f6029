"""Lightning's Trainer and a transformers loop with erase_fx, on CPU: the examples in examples/.

- The drop-in: the LightningModule of ``examples/lightning_dropin.py``,
  compiled as Lightning's docs say (``torch.compile(module, backend="erase")``,
  then ``trainer.fit``): its early blocks found, every parameter bitwise equal
  to an eager Trainer run (``inner="aot_eager"``).
- The whole step (`erase_fx.integrations.lightning.compile_manual_step`, the
  module of ``examples/lightning_whole_step.py``): under the stand-in for CUDA
  graphs (`fake_cuda`) the step is captured and replayed, the Trainer counts
  every step, and the training equals the uncaptured run bitwise; a hook Lightning
  would call inside the step makes it run as written; without the helper,
  Lightning's step count stops at the capture (what the helper is for).
- ``examples/transformers_probes.py``: the drop-in against eager, the
  compile_step loop against its uncaptured run, and the graphs and blocks
  Dynamo and erase make of transformers' GPT-2.
"""
import copy
import logging
import pathlib
import sys

import pytest
import torch

import erase_fx
from erase_fx import StepCaptureError
from erase_fx.step import arguments as step_arguments
from erase_fx.errors import EraseError
from fake_cuda import fake_cuda  # noqa: F401 - a fixture

L = pytest.importorskip("lightning")

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
import lightning_dropin  # noqa: E402
import lightning_whole_step  # noqa: E402

from erase_fx.integrations.lightning import compile_manual_step  # noqa: E402

#: erase with every gradient bitwise equal to eager's, and no fallback to hide a crash.
EXACT = {"inner": "aot_eager", "on_error": "raise"}

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*(num_workers|does not have many workers|LeafSpec|max_epochs).*")


@pytest.fixture(autouse=True)
def quiet_lightning():
    """No banner lines ("GPU available: False")."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


def fit(module, steps, callbacks=(), **compile_kwargs):
    """Train ``steps`` steps (one epoch of twice as many batches: a Trainer that miscounts
    its steps stops at the epoch's end instead of never); returns the Trainer."""
    model = torch.compile(module, **compile_kwargs) if compile_kwargs else module
    trainer = L.Trainer(max_steps=steps, max_epochs=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks))
    data = lightning_dropin.random_batches(2 * steps)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    return trainer


def batches_run(trainer):
    return trainer.fit_loop.epoch_loop.batch_progress.total.completed


def assert_same_parameters(module, reference):
    for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), name


def seeded(cls, **kwargs):
    torch.manual_seed(0)
    return cls(**kwargs)


# -- the drop-in ------------------------------------------------------------------


def test_lightning_drop_in_finds_the_blocks_and_trains_like_eager():
    eager = seeded(lightning_dropin.LocalLosses)
    fit(eager, 3)
    module = seeded(lightning_dropin.LocalLosses)
    with erase_fx.collect_reports() as reports:
        trainer = fit(module, 3, backend="erase", options=EXACT)
    assert [len(r.blocks) for r in reports] == [2]  # the last block stays: last_block
    assert [r.reason for r in reports[0].rejected] == ["last_block"]
    assert trainer.global_step == 3 and "loss" in trainer.callback_metrics
    assert_same_parameters(module, eager)


def test_the_lightning_examples_run(capsys):
    lightning_dropin.main(steps=2, options=EXACT)
    lightning_whole_step.main(steps=2, options=EXACT)
    out = capsys.readouterr().out
    assert "early block 0: blocks.0.0.weight" in out and "early block 1" in out
    assert "2 steps: 0 capture(s)" in out and "CUDA is not available" in out
    assert out.count("final loss") == 2


# -- the whole step ---------------------------------------------------------------


class CapturableWholeStep(lightning_whole_step.WholeStep):
    """The example's module with its Adam capturable on CPU (`fake_cuda` allows it)."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=torch.tensor(1e-3), capturable=True)


def test_the_whole_step_is_captured_and_trains_like_the_step_as_written(fake_cuda, monkeypatch):
    monkeypatch.setattr(step_arguments, "cuda_available", lambda: False)
    reference = seeded(CapturableWholeStep)
    fit(reference, 6)
    assert reference.step.compiled.replays == 0  # ran as written
    monkeypatch.setattr(step_arguments, "cuda_available", lambda: True)
    module = seeded(CapturableWholeStep)
    with erase_fx.collect_reports() as reports:
        trainer = fit(module, 6, backend="erase", options=EXACT)
    step = module.step
    assert (step.compiled.warmups, step.compiled.captures, step.compiled.replays) == (2, 1, 4)
    assert step.uncaptured_reason is None and step.optimizer_steps == 1
    assert sum(len(r.blocks) for r in reports) == 2
    # NB: Lightning saw six optimizer steps, four of them replayed
    assert trainer.global_step == 6 and batches_run(trainer) == 6
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress.total
    assert (progress.ready, progress.completed) == (6, 6)
    assert_same_parameters(module, reference)
    opt, ref_opt = trainer.optimizers[0], reference.trainer.optimizers[0]
    for p, q in zip(module.parameters(), reference.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(value, ref_opt.state[q][key]), key


class PlainCompileStep(CapturableWholeStep):
    """The step wrapped by erase_fx.compile_step alone, without the Lightning helper."""

    def __init__(self):
        super().__init__()
        self.plain_step = erase_fx.compile_step(self.step.compiled.fn)

    def training_step(self, batch, batch_idx):
        return self.plain_step(*batch)


def test_without_the_helper_lightning_stops_counting_steps_at_the_capture(fake_cuda):
    # LightningOptimizer.step counts steps in Python (lightning/pytorch/core/optimizer.py:146,
    # 156; loops/optimization/manual.py:131-137): replays skip it, max_steps is never reached
    module = seeded(PlainCompileStep)
    trainer = fit(module, 4)
    assert module.plain_step.replays == 6
    assert trainer.global_step == 3 and batches_run(trainer) == 8  # the epoch's end stopped it


class HookedStep(L.Callback):
    """Reads the gradients in a hook Lightning calls inside ``opt.step()``."""

    def __init__(self):
        self.calls = 0

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.calls += 1


def test_a_hook_inside_the_step_runs_the_step_as_written(fake_cuda, caplog):
    module = seeded(CapturableWholeStep)
    hook = HookedStep()
    with caplog.at_level(logging.WARNING, logger="erase_fx.integrations.lightning"):
        trainer = fit(module, 4, callbacks=[hook])
    assert module.step.compiled.captures == 0 and hook.calls == 4
    assert trainer.global_step == 4
    assert "HookedStep.on_before_optimizer_step would run only when the step is captured" \
        in module.step.uncaptured_reason
    assert sum("running uncaptured" in r.getMessage() for r in caplog.records) == 1


def test_a_copy_of_the_module_gets_a_step_of_its_own():
    module = seeded(CapturableWholeStep)
    step = module.step
    clone = copy.deepcopy(module)  # NB: what SWA and EMA callbacks do
    assert clone.step is not step and clone.step.module is clone and step.module is module
    assert clone.step.compiled.fn.__self__ is clone


class StrictHookedStep(CapturableWholeStep):
    @compile_manual_step(on_unsupported="raise")
    def step(self, x, y):
        return lightning_whole_step.WholeStep.step.fn(self, x, y)

    def on_after_backward(self):
        pass


class AutomaticStep(CapturableWholeStep):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = True

    def training_step(self, batch, batch_idx):
        self.step(*batch)
        return None


def test_bad_options_raise_when_the_step_is_defined():
    from erase_fx.errors import EraseOptionError

    with pytest.raises(EraseOptionError, match="warmup=0"):
        compile_manual_step(warmup=0)(lambda self, x: x)
    with pytest.raises(TypeError, match="max_capture"):
        compile_manual_step(max_capture=3)(lambda self, x: x)
    compile_manual_step(warmup=3, early_optimizer=True)(lambda self, x: x)


def test_misuses_raise_naming_the_fix(fake_cuda):
    with pytest.raises(StepCaptureError, match="StrictHookedStep.on_after_backward"):
        fit(seeded(StrictHookedStep), 1)
    with pytest.raises(EraseError, match="automatic_optimization = False"):
        fit(seeded(AutomaticStep), 1)


# -- transformers -----------------------------------------------------------------


@pytest.fixture
def probes():
    pytest.importorskip("transformers")
    import transformers_probes

    return transformers_probes


# NB: slow (9 s, Dynamo tracing transformers' code): tests/test_user_patterns.py checks the
# same model's drop-in against eager in make test (gpt2_probes); this one pins the reasons too
@pytest.mark.slow
def test_gpt2_probes_drop_in_trains_like_eager(probes):
    batches = probes.token_batches(3)
    eager = seeded(probes.GPT2WithProbes)
    eager_loss, _ = probes.train(eager, batches)
    model = seeded(probes.GPT2WithProbes)
    with erase_fx.collect_reports() as reports:
        loss, _ = probes.train(model, batches, backend="erase", options=EXACT)
    assert torch.equal(loss, eager_loss)
    assert_same_parameters(model, eager)
    # NB: transformers' graph breaks (probes.fewer_graph_breaks says where) leave the first
    # probe the only early block: the GPT's backward needs its outputs' gradients from later
    # graphs, and each graph's last loss term is its last block
    assert [len(r.blocks) for r in reports] == [0, 0, 0, 1]
    assert [sorted({x.reason for x in r.rejected}) for r in reports] == [
        ["last_block"], ["last_block", "not_scalar_tangent"], ["last_block"], ["last_block"]]


def test_gpt2_probes_in_one_graph_without_transformers_breaks(probes):
    batches = probes.token_batches(2)
    model = seeded(probes.GPT2WithProbes)
    probes.fewer_graph_breaks(model, batches[0])
    with erase_fx.collect_reports() as reports:
        probes.train(model, batches, backend="erase", options=EXACT)
    (report,) = reports
    assert [len(b.params) for b in report.blocks] == [28, 2]  # the whole GPT-2, the 1st probe


def test_gpt2_probes_whole_step_is_captured_and_trains_like_as_written(probes, fake_cuda,
                                                                       monkeypatch):
    batches = probes.token_batches(4)
    monkeypatch.setattr(step_arguments, "cuda_available", lambda: False)
    reference = seeded(probes.GPT2WithProbes)
    ref_loss, ref_step = probes.train(reference, batches, whole_step=True, capturable=True,
                                      backend="erase", options=EXACT)
    assert ref_step.replays == 0
    monkeypatch.setattr(step_arguments, "cuda_available", lambda: True)
    model = seeded(probes.GPT2WithProbes)
    loss, step = probes.train(model, batches, whole_step=True, capturable=True,
                              backend="erase", options=EXACT)
    assert (step.captures, step.replays, step.uncaptured_reason) == (1, 2, None)
    assert torch.equal(loss, ref_loss)
    assert_same_parameters(model, reference)
