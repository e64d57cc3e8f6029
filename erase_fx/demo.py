"""erase_fx's showcase: train two local-loss models with and without ``backend="erase"``.

Run ``python -m erase_fx.demo`` (or ``erase-fx demo``; ``--help`` lists the
flags). For each model the demo

1. builds one model and deep-copies it into an eager copy and an erase copy
   (same initial weights, one Adam optimizer each, same hyper-parameters);
2. prints the early blocks erase_fx found in the compiled graph (and each
   backward component it left in the backward, with the reason), as a table
   per graph, the graphs numbered from 0 for each model; the table's key
   once, under the first table;
3. checks that the first step's gradients of the erase copy equal the reference's;
4. trains both copies on the same batches and prints their loss curves side
   by side (each row the running mean over the steps since the row before);
5. checks that the erase copy's parameters after the last step equal eager's,
   and prints a held-out metric and the median step time of each copy.

It exits 1 if a first-step gradient differs from the reference by more than
fp32 round-off (`GRAD_RTOL`, relative to the largest gradient of that
parameter), or a final parameter from eager's by more than `PARAM_RTOL`:
that is a bug in erase_fx, not noise. The gradients' reference is eager, or,
with ``--inner inductor``, stock ``torch.compile`` with Inductor (whose fused
kernels round differently from eager; see `stock_reference`); with Inductor
the final parameters are shown but not judged.

The models:

- ``ff``: a greedy layer-wise chain in the style of Forward-Forward training.
  K=4 stages ``Linear(d, h) - ReLU - Linear(h, d) - LayerNorm(d)``, each with
  its own classification head ``Linear(d, 10)`` and cross-entropy loss. Stage
  k+1 reads the *detached* output of stage k, so each stage learns from its
  own loss only; the total loss is the sum of the local losses. Data:
  Gaussian class centroids plus noise (`GaussianClusters`). Stages 1-3 are
  early blocks: their backward runs as soon as their loss is computed; stage
  4's is ready only when the forward ends and stays in the backward.
- ``ctr``: a multi-tower click-through-rate model on Criteo-like synthetic
  data (`PlantedClicks`: 13 dense features, 8 categorical fields, labels from
  a planted logistic model). Embedding tables and a bottom MLP build a shared
  representation; 3 towers read it, each with its own BCE-with-logits head on
  the click label; a top model reads the detached tower outputs and gives
  the final BCE loss; the total loss is the sum of the 4 losses. Towers 2 and
  3 read the shared representation *detached*; tower 1 reads it as is, so
  the embeddings and the bottom MLP get their gradients from tower 1's loss
  only, and belong to tower 1's block. Towers 1-3 are early blocks; the top
  model stays in the backward.

On CPU the side streams are virtual (segments run in program order), so the
erase copy is not expected to be faster there: the demo lists the early
blocks found and checks exactness (``erase-fx explain erase_fx.demo:ff_factory
--dump DIR`` draws the schedule). On CUDA the early blocks overlap the rest
of the forward on side streams.

The model factories for ``erase-fx explain`` are `ff_factory` and
`ctr_factory`; each returns ``(model, example_inputs)`` on CPU::

    erase-fx explain erase_fx.demo:ff_factory
    python -m erase_fx explain erase_fx.demo:ctr_factory --json
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import erase_fx
from erase_fx._training import build_seeded, mlp, normalized_entropy
from erase_fx.config import INNER_COMPILERS
from erase_fx.report import GraphReport
from erase_fx.report_text import TABLE_KEY, format_report, format_table

Batch = tuple[torch.Tensor, ...]

#: Largest first-step gradient difference accepted, relative to the largest
#: gradient entry of the same parameter: fp32 round-off, with room for the
#: different summation orders of fused kernels.
#: NB: with ``--inner inductor`` the reference is stock Inductor: its fused
#: kernels move a detached input by ~1e-7 from eager, which can flip a ReLU
#: unit of the next block and change a weight gradient's row by ~1e-3 of its
#: maximum, far beyond this tolerance, for stock Inductor as for erase.
GRAD_RTOL = 1e-5
#: Largest difference of a parameter after training, relative to its largest
#: entry in eager's copy. ``aot_eager`` and ``eager`` run eager's ops in eager's
#: order, and the demo's CPU runs end with equal parameters (difference 0); the
#: room is for rounding the step-1 tolerance allows, over the run. Not judged
#: with ``--inner inductor`` (`final_parameter_tolerance`).
PARAM_RTOL = 1e-4
#: Steps left out of the median step time: the first ones compile and warm up.
WARMUP_STEPS = 5
#: Rows of the loss curve; each shows the running mean of the loss over the
#: steps since the row before (`curve_window`).
CURVE_ROWS = 10
LEARNING_RATE = 1e-3
#: The task (centroids, planted weights) is drawn with ``seed``, the held-out
#: batch with ``seed + EVAL_SEED_OFFSET``, the training batches with
#: ``seed + TRAIN_SEED_OFFSET``; the weights with ``seed`` too (`build_seeded`).
EVAL_SEED_OFFSET = 1
TRAIN_SEED_OFFSET = 2


# -- ff: a chain of stages, each with its own local loss -----------------------


@dataclasses.dataclass(frozen=True)
class FFSizes:
    """Sizes of the ``ff`` model and its data."""

    stages: int = 4
    dim: int = 64
    hidden: int = 128
    classes: int = 10
    batch: int = 128
    eval_batch: int = 4096
    #: standard deviation of the noise around the unit-variance class centroids.
    #: Centroids lie about ``sqrt(2 * dim)`` apart, so the noise grows with
    #: ``sqrt(dim)`` to keep the task as hard (eval accuracy about 0.9).
    noise: float = 2.5


def ff_sizes(device: torch.device) -> FFSizes:
    """Small on CPU so the demo runs in seconds; large enough on CUDA to overlap."""
    if device.type == "cuda":
        return FFSizes(dim=512, hidden=2048, batch=1024, noise=7.0)
    return FFSizes()


@dataclasses.dataclass(frozen=True)
class GaussianClusters:
    """Synthetic classification: a random centroid per class in R^dim, plus isotropic noise."""

    centroids: torch.Tensor
    noise: float

    @classmethod
    def make(cls, sizes: FFSizes, seed: int) -> GaussianClusters:
        generator = torch.Generator().manual_seed(seed)
        return cls(torch.randn(sizes.classes, sizes.dim, generator=generator), sizes.noise)

    def sample(self, batch: int, generator: torch.Generator) -> Batch:
        """``(x, labels)``: ``batch`` points, on the CPU."""
        classes, dim = self.centroids.shape
        labels = torch.randint(classes, (batch,), generator=generator)
        noise = torch.randn(batch, dim, generator=generator)
        return self.centroids[labels] + self.noise * noise, labels


class LocalLossStage(nn.Module):
    """One stage of the chain: a residual-free MLP block and its classification head."""

    def __init__(self, dim: int, hidden: int, classes: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim), nn.LayerNorm(dim)
        )
        self.head = nn.Linear(dim, classes)


class LocalLossChain(nn.Module):
    """Stages trained greedily: each on its own loss, on the detached output of the last.

    ``forward(x, labels)`` returns the sum of the stages' cross-entropy losses;
    `predict` the logits of the last stage's head.
    """

    def __init__(self, sizes: FFSizes):
        super().__init__()
        self.stages = nn.ModuleList(
            LocalLossStage(sizes.dim, sizes.hidden, sizes.classes) for _ in range(sizes.stages)
        )

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = []
        for stage in self.stages:
            x = stage.body(x)
            losses.append(F.cross_entropy(stage.head(x), labels))
            # NB: the stop-gradient: the next stage's loss does not reach this stage.
            x = x.detach()
        return sum(losses)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage.body(x)
        return self.stages[-1].head(x)


def accuracy(model: LocalLossChain, batch: Batch) -> float:
    x, labels = batch
    return (model.predict(x).argmax(dim=1) == labels).float().mean().item()


# -- ctr: towers on a shared representation, each with its own loss ------------


@dataclasses.dataclass(frozen=True)
class CTRSizes:
    """Sizes of the ``ctr`` model and its data."""

    dense: int = 13
    fields: int = 8
    cardinality: int = 1000
    embedding_dim: int = 16
    bottom_hidden: int = 64
    towers: int = 3
    tower_hidden: int = 64
    batch: int = 256
    eval_batch: int = 8192
    #: exponent of the Zipf law the categories are drawn from.
    zipf: float = 1.1
    #: bias of the planted logit: sets the click rate (about 25%).
    bias: float = -1.5


def ctr_sizes(device: torch.device) -> CTRSizes:
    """Small on CPU so the demo runs in seconds; large enough on CUDA to overlap."""
    if device.type == "cuda":
        return CTRSizes(cardinality=100_000, embedding_dim=64, bottom_hidden=512,
                        tower_hidden=1024, batch=4096)
    return CTRSizes()


@dataclasses.dataclass(frozen=True)
class PlantedClicks:
    """Criteo-like synthetic clicks whose labels a logistic model can learn.

    Dense features are standard normal (Criteo's counts after the usual
    ``log1p`` and standardisation); each categorical field draws its category
    from a Zipf law, so a few categories are frequent and most are rare. A
    click is drawn with probability ``sigmoid(w . dense + sum_f effect_f[c_f] + bias)``.
    """

    dense_weight: torch.Tensor
    category_effect: torch.Tensor
    category_probs: torch.Tensor
    bias: float

    @classmethod
    def make(cls, sizes: CTRSizes, seed: int) -> PlantedClicks:
        generator = torch.Generator().manual_seed(seed)
        ranks = torch.arange(1, sizes.cardinality + 1, dtype=torch.float32)
        probs = ranks.pow(-sizes.zipf)
        return cls(
            dense_weight=torch.randn(sizes.dense, generator=generator) / math.sqrt(sizes.dense),
            category_effect=0.5 * torch.randn(sizes.fields, sizes.cardinality, generator=generator),
            category_probs=probs / probs.sum(),
            bias=sizes.bias,
        )

    def sample(self, batch: int, generator: torch.Generator) -> Batch:
        """``(dense, categorical, labels)``: ``batch`` impressions, on the CPU."""
        fields, _ = self.category_effect.shape
        dense = torch.randn(batch, self.dense_weight.numel(), generator=generator)
        categorical = torch.multinomial(
            self.category_probs.expand(fields, -1), batch, replacement=True, generator=generator
        ).T
        effects = self.category_effect.gather(1, categorical.T).sum(dim=0)
        logits = dense @ self.dense_weight + effects + self.bias
        labels = torch.bernoulli(torch.sigmoid(logits), generator=generator)
        return dense, categorical, labels


class MultiTowerCTR(nn.Module):
    """Towers with local click losses on a shared representation, and a top model.

    ``forward(dense, categorical, labels)`` returns the sum of the towers'
    BCE losses and the top model's; `predict` the top model's click logit.

    The shared representation (bottom MLP of the dense features, concatenated
    with one embedding per categorical field) feeds tower 1 as is, and towers
    2 and 3 detached: the embeddings and the bottom MLP learn from tower 1's
    loss only. The top model reads the detached tower outputs.
    """

    def __init__(self, sizes: CTRSizes):
        super().__init__()
        self.embeddings = nn.ModuleList(
            nn.Embedding(sizes.cardinality, sizes.embedding_dim) for _ in range(sizes.fields)
        )
        self.bottom = mlp(sizes.dense, sizes.bottom_hidden, sizes.embedding_dim)
        shared = sizes.embedding_dim * (sizes.fields + 1)
        self.towers = nn.ModuleList(
            mlp(shared, sizes.tower_hidden, sizes.tower_hidden) for _ in range(sizes.towers)
        )
        self.tower_heads = nn.ModuleList(
            nn.Linear(sizes.tower_hidden, 1) for _ in range(sizes.towers)
        )
        self.top = nn.Sequential(
            *mlp(sizes.towers * sizes.tower_hidden, sizes.tower_hidden),
            nn.Linear(sizes.tower_hidden, 1),
        )

    def forward(
        self, dense: torch.Tensor, categorical: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        shared = self.shared_representation(dense, categorical)
        losses, tower_outputs = [], []
        for index, (tower, head) in enumerate(zip(self.towers, self.tower_heads)):
            # NB: only the first tower trains the embeddings and the bottom MLP.
            hidden = tower(shared if index == 0 else shared.detach())
            losses.append(F.binary_cross_entropy_with_logits(head(hidden).squeeze(1), labels))
            tower_outputs.append(hidden.detach())
        top_logit = self.top(torch.cat(tower_outputs, dim=1)).squeeze(1)
        losses.append(F.binary_cross_entropy_with_logits(top_logit, labels))
        return sum(losses)

    def shared_representation(self, dense: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        embedded = [table(categorical[:, field]) for field, table in enumerate(self.embeddings)]
        return torch.cat([self.bottom(dense), *embedded], dim=1)

    def predict(self, dense: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        shared = self.shared_representation(dense, categorical)
        return self.top(torch.cat([tower(shared) for tower in self.towers], dim=1)).squeeze(1)


def model_normalized_entropy(model: MultiTowerCTR, batch: Batch) -> float:
    """NE of the model's click predictions on ``batch`` (`normalized_entropy`; lower is better).

    1.0 is what always predicting the base rate scores.
    """
    dense, categorical, labels = batch
    return normalized_entropy(model.predict(dense, categorical), labels)


# -- workloads -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model of the demo: how to build it, feed it and score it.

    Attributes:
        name: the ``--model`` choice.
        title: one line about the model and its sizes.
        model: the model, on the device, with its initial weights.
        sample: draws a training batch (on the CPU) from a generator.
        eval_batch: the held-out batch the metric is computed on, on the device.
        metric: the metric's name: ``"accuracy"`` (higher is better) or ``"NE"`` (lower is).
        score: the metric of a model on a batch.
    """

    name: str
    title: str
    model: nn.Module
    sample: Callable[[torch.Generator], Batch]
    eval_batch: Batch
    metric: str
    score: Callable[[nn.Module, Batch], float]


def ff_workload(device: torch.device, seed: int) -> Workload:
    sizes = ff_sizes(device)
    return _workload(
        "ff",
        f"{sizes.stages}-stage local-loss chain (d={sizes.dim}, h={sizes.hidden}, "
        f"{sizes.classes} classes, batch {sizes.batch})",
        lambda: LocalLossChain(sizes), GaussianClusters.make(sizes, seed), sizes,
        "accuracy", accuracy, device, seed,
    )


def ctr_workload(device: torch.device, seed: int) -> Workload:
    sizes = ctr_sizes(device)
    return _workload(
        "ctr",
        f"{sizes.towers}-tower CTR model ({sizes.dense} dense, {sizes.fields} fields x "
        f"{sizes.cardinality} categories, dim {sizes.embedding_dim}, batch {sizes.batch})",
        lambda: MultiTowerCTR(sizes), PlantedClicks.make(sizes, seed), sizes,
        "NE", model_normalized_entropy, device, seed,
    )


def _workload(
    name: str, title: str, build: Callable[[], nn.Module], data: Any, sizes: Any,
    metric: str, score: Callable[[nn.Module, Batch], float], device: torch.device, seed: int,
) -> Workload:
    """A workload whose data source has ``sample(batch, generator)`` and sizes a ``batch``."""
    eval_generator = torch.Generator().manual_seed(seed + EVAL_SEED_OFFSET)
    return Workload(
        name=name,
        title=title,
        model=build_seeded(build, seed).to(device),
        sample=lambda generator: data.sample(sizes.batch, generator),
        eval_batch=to_device(data.sample(sizes.eval_batch, eval_generator), device),
        metric=metric,
        score=score,
    )


WORKLOADS: dict[str, Callable[[torch.device, int], Workload]] = {
    "ff": ff_workload,
    "ctr": ctr_workload,
}


def ff_factory() -> tuple[nn.Module, Batch]:
    """``(model, (x, labels))`` of the ``ff`` demo on the CPU.

    For ``erase-fx explain erase_fx.demo:ff_factory``.
    """
    workload = ff_workload(torch.device("cpu"), seed=0)
    return workload.model, workload.sample(torch.Generator().manual_seed(0))


def ctr_factory() -> tuple[nn.Module, Batch]:
    """``(model, (dense, categorical, labels))`` of the ``ctr`` demo on the CPU.

    For ``erase-fx explain erase_fx.demo:ctr_factory``.
    """
    workload = ctr_workload(torch.device("cpu"), seed=0)
    return workload.model, workload.sample(torch.Generator().manual_seed(0))


def to_device(batch: Batch, device: torch.device) -> Batch:
    return tuple(t.to(device) for t in batch)


# -- training ------------------------------------------------------------------


@dataclasses.dataclass
class Trainee:
    """One copy of the model being trained, and what its training measured.

    Attributes:
        name: ``"eager"`` or ``"erase"``.
        module: the model (its parameters; evaluated eagerly).
        step: what a training step calls: the module or its compiled wrapper.
        optimizer: the optimizer of ``module``'s parameters.
        losses: the training loss of each step.
        step_seconds: the wall time of each step (forward, backward, update).
    """

    name: str
    module: nn.Module
    step: Callable[..., torch.Tensor]
    optimizer: torch.optim.Optimizer
    losses: list[float] = dataclasses.field(default_factory=list)
    step_seconds: list[float] = dataclasses.field(default_factory=list)

    def compute_gradients(self, batch: Batch, device: torch.device) -> float:
        """Forward and backward on ``batch``; returns the seconds it took."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.step(*batch)
        loss.backward()
        seconds = _synchronized_since(start, device)
        self.losses.append(loss.item())
        return seconds

    def update(self, device: torch.device) -> float:
        """The optimizer step; returns the seconds it took."""
        start = time.perf_counter()
        self.optimizer.step()
        return _synchronized_since(start, device)

    def final_loss(self) -> float:
        """The loss at the end of training, smoothed as the loss curve is (`curve_window`)."""
        return running_mean(self.losses, curve_window(len(self.losses)))

    def median_step_seconds(self) -> float:
        """Median step time, leaving out the warm-up steps when there are others.

        NaN with a single step: it compiles, so it is no measure of a step.
        """
        timed = self.step_seconds[WARMUP_STEPS:] or self.step_seconds[1:]
        return statistics.median(timed) if timed else math.nan


def _synchronized_since(start: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def make_trainees(model: nn.Module, inner: str) -> tuple[Trainee, Trainee]:
    """An eager and an erase copy of ``model``: same weights, same optimizer settings."""
    eager_model = copy.deepcopy(model)
    erase_model = copy.deepcopy(model)
    compiled = torch.compile(erase_model, backend="erase", options={"inner": inner})
    return (
        Trainee("eager", eager_model, eager_model,
                torch.optim.Adam(eager_model.parameters(), lr=LEARNING_RATE)),
        Trainee("erase", erase_model, compiled,
                torch.optim.Adam(erase_model.parameters(), lr=LEARNING_RATE)),
    )


@dataclasses.dataclass(frozen=True)
class Difference:
    """How far the erase copy's gradients, or parameters, are from the reference's.

    Attributes:
        max_abs: the largest absolute difference of an entry.
        max_rel: the largest, over parameters, of the parameter's largest
            absolute difference over its largest reference entry.
        worst_param: the parameter ``max_rel`` comes from.
        tolerance: the largest ``max_rel`` accepted; None for a difference
            that is shown but not judged.
    """

    max_abs: float
    max_rel: float
    worst_param: str
    tolerance: float | None = GRAD_RTOL

    @property
    def ok(self) -> bool:
        """Within the tolerance; a difference that is not judged is ok."""
        return self.tolerance is None or self.max_rel <= self.tolerance

    @property
    def verdict(self) -> str:
        """``PASS``, ``FAIL`` or ``not judged``: the word the demo's lines and summary print."""
        if self.tolerance is None:
            return "not judged"
        return "PASS" if self.ok else "FAIL"


def compare_gradients(reference: nn.Module, erase: nn.Module) -> Difference:
    """The gradient difference over all parameters (infinite if one side lacks a gradient)."""
    erase_params = dict(erase.named_parameters())
    return _largest_difference(
        ((name, param.grad, erase_params[name].grad)
         for name, param in reference.named_parameters()),
        GRAD_RTOL,
    )


def compare_parameters(
    reference: nn.Module, erase: nn.Module, tolerance: float | None = PARAM_RTOL
) -> Difference:
    """The difference of the parameters themselves (after training), judged by ``tolerance``."""
    erase_params = dict(erase.named_parameters())
    return _largest_difference(
        ((name, param.detach(), erase_params[name].detach())
         for name, param in reference.named_parameters()),
        tolerance,
    )


def _largest_difference(
    triples: Iterable[tuple[str, torch.Tensor | None, torch.Tensor | None]],
    tolerance: float | None,
) -> Difference:
    """`Difference` over ``(name, expected, actual)``: infinite where only one side is None."""
    max_abs, max_rel, worst = 0.0, 0.0, ""
    for name, expected, actual in triples:
        if expected is None and actual is None:
            continue
        if expected is None or actual is None:
            return Difference(math.inf, math.inf, name, tolerance)
        abs_diff = (expected - actual).abs().max().item()
        rel_diff = abs_diff / max(expected.abs().max().item(), torch.finfo(expected.dtype).tiny)
        max_abs = max(max_abs, abs_diff)
        if rel_diff >= max_rel:
            max_rel, worst = rel_diff, name
    return Difference(max_abs, max_rel, worst, tolerance)


def final_parameter_tolerance(inner: str) -> float | None:
    """`PARAM_RTOL`; None (not judged) with Inductor, whose rounding training amplifies."""
    return None if inner == "inductor" else PARAM_RTOL


@dataclasses.dataclass(frozen=True)
class WorkloadResult:
    """What the demo measured on one model.

    ``gradient_diff`` compares the first step's gradients with the
    reference's; ``param_diff`` the parameters after the last step with
    eager's.
    """

    workload: Workload
    reports: tuple[GraphReport, ...]
    gradient_diff: Difference
    param_diff: Difference
    eager: Trainee
    erase: Trainee
    eager_metric: float
    erase_metric: float

    @property
    def ok(self) -> bool:
        return self.gradient_diff.ok and self.param_diff.ok

    @property
    def compile_seconds(self) -> float:
        """The erase copy's first step (compilation included) less a typical step."""
        typical = self.erase.median_step_seconds()
        return self.erase.step_seconds[0] - (0.0 if math.isnan(typical) else typical)


def run_workload(
    workload: Workload, steps: int, inner: str, device: torch.device, seed: int,
    say: Callable[[str], None], table_key: bool = True,
) -> WorkloadResult:
    """Train an eager and an erase copy of the workload's model side by side.

    Both copies see the same batches, drawn from a generator seeded
    ``seed + TRAIN_SEED_OFFSET``. The first step compiles the erase copy and
    compares its gradients with eager's, before either optimizer steps; the
    last is followed by a comparison of the parameters. ``table_key``: print
    the key of the blocks table under it (the demo prints it once).
    """
    eager, erase = make_trainees(workload.model, inner)
    generator = torch.Generator().manual_seed(seed + TRAIN_SEED_OFFSET)
    window = curve_window(steps)
    for step in range(1, steps + 1):
        batch = to_device(workload.sample(generator), device)
        eager_seconds = eager.compute_gradients(batch, device)
        if step == 1:
            erase_seconds, reports = compile_and_compute_gradients(
                erase, batch, device, inner, say, table_key
            )
            reference = stock_reference(workload.model, inner, batch, say)
            gradient_diff = compare_gradients(reference or eager.module, erase.module)
            say(describe_difference("step-1 gradients", gradient_diff,
                                    "stock " + inner if reference else "eager"))
            if reference is not None:
                say(f"  (for reference, stock {inner} vs eager: max rel diff "
                    f"{compare_gradients(eager.module, reference).max_rel:.3g}: the inner "
                    "compiler's own rounding)")
            for line in curve_header(window):
                say(line)
        else:
            erase_seconds = erase.compute_gradients(batch, device)
        eager.step_seconds.append(eager_seconds + eager.update(device))
        erase.step_seconds.append(erase_seconds + erase.update(device))
        if step % window == 0 or step == steps:
            say(curve_row(step, running_mean(eager.losses, window),
                          running_mean(erase.losses, window)))
    param_diff = compare_parameters(eager.module, erase.module, final_parameter_tolerance(inner))
    with torch.no_grad():
        eager_metric = workload.score(eager.module, workload.eval_batch)
        erase_metric = workload.score(erase.module, workload.eval_batch)
    return WorkloadResult(workload, reports, gradient_diff, param_diff, eager, erase,
                          eager_metric, erase_metric)


def stock_reference(
    model: nn.Module, inner: str, batch: Batch, say: Callable[[str], None]
) -> nn.Module | None:
    """For Inductor, a copy trained one step with stock ``torch.compile`` (None otherwise).

    Inductor's fused kernels round differently from eager (and a ReLU that
    flips amplifies it), so erase with Inductor is held to what stock
    Inductor computes; ``aot_eager`` and ``eager`` compute what eager does.
    """
    if inner != "inductor":
        return None
    say("compiling a stock Inductor copy as the gradient reference ...")
    reference = copy.deepcopy(model)
    torch.compile(reference, backend="inductor")(*batch).backward()
    return reference


def compile_and_compute_gradients(
    erase: Trainee, batch: Batch, device: torch.device, inner: str, say: Callable[[str], None],
    table_key: bool = True,
) -> tuple[float, tuple[GraphReport, ...]]:
    """The erase copy's first step, which compiles it; prints and returns erase_fx's reports.

    The graphs are numbered from 0 for this model (a report's ``graph_id``
    counts graphs across the process, for the dumps' folders).
    """
    say(f"compiling the erase copy (backend='erase', inner={inner!r}) ...")
    with erase_fx.collect_reports() as reports:
        seconds = erase.compute_gradients(batch, device)
    say(f"compiled: {len(reports)} graph(s); first step {seconds:.2f} s (compilation included)")
    for number, report in enumerate(reports):
        say(format_report(report, number=number, key=False))
    if table_key and has_table(reports):
        say(TABLE_KEY)
    return seconds, tuple(reports)


def has_table(reports: Sequence[GraphReport]) -> bool:
    """Whether `format_report` prints a table (and so its key) for any of ``reports``."""
    return any(report.blocks or report.rejected for report in reports)


# -- output --------------------------------------------------------------------


def describe_difference(what: str, diff: Difference, reference: str) -> str:
    """``<what>, erase vs <reference>: max abs diff .., max rel diff .. (tolerance ..): PASS``."""
    if diff.tolerance is None:
        judged = f": {diff.verdict} ({NOT_JUDGED_WHY})"
    else:
        judged = f" (tolerance {diff.tolerance:g}): {diff.verdict}"
        if not diff.ok:
            judged += f" (worst: {diff.worst_param})"
    return (f"{what}, erase vs {reference}: max abs diff {diff.max_abs:.3g}, max rel diff "
            f"{diff.max_rel:.3g}{judged}")


#: Why the final parameters are not judged with Inductor.
NOT_JUDGED_WHY = ("Inductor's kernels round differently from eager's, and training amplifies "
                  "it; the step-1 check holds erase to stock Inductor")


def curve_window(steps: int) -> int:
    """How many steps each row of the loss curve averages: about `CURVE_ROWS` rows in all."""
    return max(1, steps // CURVE_ROWS)


def running_mean(losses: Sequence[float], window: int) -> float:
    """The mean of the last ``window`` losses (of all of them, when there are fewer)."""
    last = losses[-window:]
    return sum(last) / len(last)


def curve_header(window: int) -> list[str]:
    """The loss curve's title, which says how it is smoothed, and its column names."""
    smoothing = "per step" if window == 1 else f"running mean over the last {window} steps"
    return [
        f"training loss, {smoothing} (both copies train on the same batches):",
        f"{'step':>6}  {'eager loss':>10}  {'erase loss':>10}  {'|diff|':>8}",
    ]


def curve_row(step: int, eager_loss: float, erase_loss: float) -> str:
    return (
        f"{step:>6}  {eager_loss:>10.4f}  {erase_loss:>10.4f}  "
        f"{abs(eager_loss - erase_loss):>8.2g}"
    )


def describe_result(result: WorkloadResult) -> list[str]:
    """The lines printed after a model's training."""
    metric = result.workload.metric
    steps = len(result.erase.step_seconds)
    lines = [
        describe_difference(f"final parameters (after {steps} steps)", result.param_diff,
                            "eager"),
        f"final eval {metric}: eager {result.eager_metric:.4f}, erase {result.erase_metric:.4f}",
    ]
    if steps < 2:
        lines.append(f"compilation and first step {result.compile_seconds:.2f} s (one step: "
                     "no step time to report)")
        return lines
    eager_ms = 1e3 * result.eager.median_step_seconds()
    erase_ms = 1e3 * result.erase.median_step_seconds()
    first_timed = WARMUP_STEPS + 1 if steps > WARMUP_STEPS else 2
    lines.append(
        f"median step time (steps {first_timed}-{steps}): eager {eager_ms:.2f} ms, "
        f"erase {erase_ms:.2f} ms (erase/eager {erase_ms / eager_ms:.2f}x); "
        f"compilation {result.compile_seconds:.2f} s"
    )
    return lines


def summarize(results: Sequence[WorkloadResult]) -> list[str]:
    """The closing table: one row per model, then the verdict."""
    headers = ("model", "early blocks", "step-1 grad rel diff", "final param rel diff",
               "final loss eager/erase", "eval metric eager/erase", "step ms eager/erase",
               "compile s")
    # NB: the final loss as the curve's last row shows it: smoothed the same way.
    rows = [
        (
            r.workload.name,
            sum(len(report.blocks) for report in r.reports),
            f"{r.gradient_diff.max_rel:.2g} {r.gradient_diff.verdict}",
            f"{r.param_diff.max_rel:.2g} {r.param_diff.verdict}",
            f"{r.eager.final_loss():.4f} / {r.erase.final_loss():.4f}",
            f"{r.workload.metric} {r.eager_metric:.4f} / {r.erase_metric:.4f}",
            f"{1e3 * r.eager.median_step_seconds():.2f} / "
            f"{1e3 * r.erase.median_step_seconds():.2f}",
            f"{r.compile_seconds:.2f}",
        )
        for r in results
    ]
    lines = format_table(headers, rows)
    failed_grads = [r.workload.name for r in results if not r.gradient_diff.ok]
    failed_params = [r.workload.name for r in results if not r.param_diff.ok]
    if failed_grads:
        lines.append(
            f"FAIL: the first-step gradients of {', '.join(failed_grads)} differ from the "
            f"reference's beyond the relative tolerance {GRAD_RTOL:g}"
        )
    else:
        lines.append("PASS: all first-step gradients equal the reference's (eager; stock "
                     f"Inductor with --inner inductor), relative tolerance {GRAD_RTOL:g}")
    judged = [r for r in results if r.param_diff.tolerance is not None]
    if failed_params:
        lines.append(
            f"FAIL: the final parameters of {', '.join(failed_params)} differ from eager's "
            f"beyond the relative tolerance {PARAM_RTOL:g}"
        )
    elif judged:
        lines.append("PASS: all final parameters equal eager's, relative tolerance "
                     f"{PARAM_RTOL:g}")
    else:
        lines.append(f"final parameters not judged ({NOT_JUDGED_WHY})")
    return lines


# -- command line --------------------------------------------------------------

#: The demo's name in its usage line when run as a module.
PROG = "python -m erase_fx.demo"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_inner(device: torch.device) -> str:
    """Inductor on CUDA; ``aot_eager`` on CPU, where Inductor's C++ compilation takes long."""
    return "inductor" if device.type == "cuda" else "aot_eager"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Train local-loss models eagerly and with torch.compile(backend='erase') side by "
            "side: the early blocks found, first-step gradients and final parameters vs eager, "
            "losses, eval metric and step times."
        ),
    )
    parser.add_argument("--model", choices=(*WORKLOADS, "all"), default="all",
                        help="which model to train (default: all)")
    parser.add_argument("--steps", type=int, default=200,
                        help="training steps per model (default: 200)")
    parser.add_argument("--device", default=None,
                        help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--inner", choices=INNER_COMPILERS, default=None,
                        help="erase_fx's inner compiler (default: inductor on CUDA, "
                        "aot_eager on CPU)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and the data (default: 0)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads during the run (default: 1 on CPU, "
                        "torch's default on CUDA)")
    parser.add_argument("--quiet", action="store_true",
                        help="print only the closing summary")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the demo; 0 if every gradient and parameter check passes, else 1.

    ``prog`` is the demo's name in its usage line (``erase-fx demo`` from the CLI).
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    try:
        device = torch.device(args.device or default_device())
    except RuntimeError as error:
        parser.error(f"--device: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    threads = args.threads if args.threads is not None else default_threads(device)
    if threads is not None and threads < 1:
        parser.error("--threads must be at least 1")
    inner = args.inner or default_inner(device)
    say = _silent if args.quiet else _print

    say(f"erase_fx demo: device {device}, inner compiler {inner}, {args.steps} steps, "
        f"seed {args.seed}, {threads or torch.get_num_threads()} CPU thread(s)")
    if device.type != "cuda":
        say("(side streams are virtual off CUDA: segments run in program order, so no "
            "speed-up is expected; the demo lists the early blocks found and checks exactness)")
    names = list(WORKLOADS) if args.model == "all" else [args.model]
    results: list[WorkloadResult] = []
    with intra_op_threads(threads):
        for name in names:
            workload = WORKLOADS[name](device, args.seed)
            say("")
            say(f"== {name}: {workload.title} ==")
            # NB: the blocks table's key once, under the first table printed.
            key_shown = any(has_table(r.reports) for r in results)
            result = run_workload(workload, args.steps, inner, device, args.seed, say,
                                  table_key=not key_shown)
            for line in describe_result(result):
                say(line)
            results.append(result)
    say("")
    say("== summary ==")
    for line in summarize(results):
        print(line)
    return 0 if all(r.ok for r in results) else 1


def default_threads(device: torch.device) -> int | None:
    """One intra-op thread on CPU; torch's default (None) on CUDA.

    NB: the demo's CPU tensors are small, and torch's OpenMP threads spin at
    barriers: when the cores are shared (a CI runner, a laptop), a step then
    takes 10-100x its usual time now and then, which would swamp the timing.
    """
    return 1 if device.type == "cpu" else None


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block (unchanged for None)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _print(line: str) -> None:
    print(line, flush=True)


def _silent(line: str) -> None:
    del line


if __name__ == "__main__":
    sys.exit(main())
