"""The ERASE paper's CTR experiment, reproduced with erase_fx: ``python -m bench.paper.ctr``.

The paper reports up to +9.51% p90 QPS on a large CTR model with six
detached dense subarchitectures. Its reviewers found that (1) the local
losses of the detached blocks were never specified (without one, a detached
block gets no gradient at all: it is frozen, and skipping its backward is
not a schedule but a freezing artifact) and (2) the normalized entropy (NE)
of the fastest configuration was never measured. This script measures both
on a synthetic Criteo-like task, with every block's local loss explicit.

Data (`PlantedCriteo`)
    13 dense features (standard normal: Criteo's counts after ``log1p`` and
    standardisation) and 26 categorical fields with the Criteo Kaggle
    cardinalities (`CRITEO_KAGGLE_CARDINALITIES`), each capped at ``--cap``.
    Categories follow a Zipf law (a few frequent, most rare). Clicks are drawn
    from a planted logistic model: a linear term in the dense features, a
    per-category effect per field, and two low-rank interaction terms: the
    pairwise dot products of hidden rank-``r`` category vectors (what a
    factorization machine or DLRM's dot interaction can learn) and the dot
    product of their sum with a projection of the dense features. Each term
    is scaled to a fixed share of the logit (`PLANTED_TERM_STD`) and the bias
    is set so the click rate is ``--ctr`` (0.25). The data seed is fixed
    (``--data-seed``); seeds vary the model's initial weights only. The
    training stream (``steps x batch`` rows) and the held-out eval set are
    drawn once, on the device, and every variant sees the same rows in the
    same order. The NE of the planted probabilities themselves on the eval
    set is reported as the "oracle" NE, the best any model can score.

Model (`BlockChainCTR`)
    A DLRM-style front (one embedding table for the 26 fields, a bottom MLP
    ``13-512-256-E`` on the dense features, DLRM's pairwise dot interaction
    of the 27 vectors, a projection to width ``d``), then six dense blocks
    in a chain, each ``LayerNorm(h + MLP(h))`` with the MLP
    ``Linear(d,h)-ReLU-Linear(h,h)-ReLU-Linear(h,d)``, and a click head
    ``Linear(d,1)``. Block k+1 reads block k's output *detached*; block 1
    reads the front as is, so the front trains through block 1's loss. We
    chose the chain (rather than six towers over the shared features)
    because every block then contributes to the final prediction and a
    frozen block visibly costs NE. The interaction keeps the 351 dot
    products of distinct pairs by multiplying the 27x27 matrix with a strict
    upper-triangle mask (``--interaction mask``, the default): the same
    features as DLRM's ``index_select`` of the upper triangle
    (``--interaction select``), whose backward under ``aot_eager``
    (``new_zeros`` then ``index_add``) erase_fx does not yet prove linear:
    ``erase/aot_eager`` would keep block 1 and the front in the backward (4
    early blocks instead of 5; Inductor's decomposition is proven). The
    results' table of erase_fx's decisions shows, per erase variant, which
    blocks ran early and why the others did not.

Local losses (the reviewers' first point)
    Every block has an explicit local objective: BCE-with-logits of its head
    on the click label, weight ``--local-weight`` (1.0) for blocks 1-5 and
    1.0 for block 6. With weight 1.0 every block is trained as a click model
    on its own input (greedy layer-wise training, as in deep supervision);
    in the detached model a block's weight only scales its own gradient. The
    training loss is the sum of the six local losses; the prediction NE is
    computed on is block 6's head. ``--no-local-loss`` drops the local losses
    of blocks 1-5 (only block 6's loss is left): then blocks 1-5 and the
    front get exactly zero gradient, the freezing artifact.

Variants (same initial weights: deep copies of one module per seed; same
optimizer, Adam by default; same data order)
    ``baseline``          the same architecture without detach, trained end to
                          end on the same total loss (eager);
    ``eager``             the detached model, eager;
    ``eager/1ulp``        the rounding control: ``eager`` with every initial
                          weight moved one float step (``torch.nextafter``);
                          how far rounding alone carries the loss, NE and
                          weights over a run;
    ``inductor``          stock ``torch.compile`` of the detached model;
    ``reduce-overhead``   stock ``torch.compile(mode="reduce-overhead")``
                          (Inductor and CUDA graph trees; CUDA only);
    ``erase/aot_eager``   ``backend="erase"``, inner ``aot_eager``, no CUDA
                          graphs: the exactness proof, its losses and NE must
                          equal ``eager``'s exactly;
    ``erase``             ``backend="erase"``, inner ``--inner`` (Inductor on
                          CUDA), no CUDA graphs;
    ``erase+graphs``      the same with ``cudagraphs=True`` (CUDA only).
    Inductor's fused kernels round differently from eager (~1e-3 relative on
    some gradients), so ``erase`` is also compared with ``inductor``: its NE
    difference from eager is expected tiny but not zero. Training amplifies
    any rounding difference over the steps; ``eager/1ulp`` measures by how
    much, so the NE differences of the Inductor variants have a yardstick.

Throughput
    Per-step QPS = batch / step time (forward, backward, optimizer step;
    CUDA events), over the steps after ``--warmup`` (audited steps left out).
    ``p90`` is the 90th percentile of per-step QPS (10% of steps are faster:
    our reading of the paper's "p90 QPS"), ``p10`` the 10th percentile (90%
    of steps beat it), and the median. Mean and std across seeds.

Audit (the reviewers' point, made checkable)
    At steps 1, 10 and 100 (``--audit-steps``), in every variant of the first
    seed: the gradient norm of the front's and of each block's own
    parameters (its body and head), and the local loss the gradient came
    from, recomputed eagerly on the same batch before the optimizer step. A
    zero gradient is flagged ``FAIL``. A separate demonstration trains the
    ``--no-local-loss`` model (eager and ``erase/aot_eager``, ``--freeze-steps``
    steps) and asks ``erase_fx.explain`` what it finds in both models.

Results go to ``<--results-dir>/ctr.json`` (``ctr-no-local-loss.json`` with
``--no-local-loss``), rewritten after every run, in the contract of
``bench/paper/README.md``; ``python -m bench.paper.report`` renders them.
A run too long for one sitting can be split over seeds (``--seed 0 --seeds
3``, then ``--seed 3 --seeds 2``, each with its own ``--name``) and joined
with ``--merge``: the same results as one run of all the seeds, with the
command of each part in ``meta.merged_from``.
"""
from __future__ import annotations

import os

# NB: cuBLAS is deterministic across streams only with a fixed workspace,
# which must be set before CUDA starts. It does not slow the kernels.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import erase_fx  # noqa: E402
from bench.paper import common  # noqa: E402
from bench.paper.common import fmt, fmt_mean_std, mean_std  # noqa: E402

#: Rows of the 26 categorical fields of the Criteo Kaggle Display Advertising
#: Challenge (C1..C26), as in DLRM's and TorchRec's Kaggle configurations.
CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
DENSE_FEATURES = 13
FIELDS = len(CRITEO_KAGGLE_CARDINALITIES)

#: Standard deviation each term of the planted logit is scaled to: linear in
#: the dense features, per-category effects, pairwise field interactions,
#: field x dense interactions. The logit's std is about 1.4: a model can
#: learn an NE well below 1, and the Bayes-optimal NE is about 0.8.
PLANTED_TERM_STD = {"dense": 0.6, "field": 0.8, "pairs": 0.8, "cross": 0.6}
#: Rows the planted model's term scales and bias are calibrated on.
CALIBRATION_ROWS = 1 << 16
#: Rows of the training stream drawn per call (bounds temporary memory).
CHUNK_ROWS = 1 << 20

#: Variants in run order; see the module docstring.
VARIANTS = ("baseline", "eager", "eager/1ulp", "inductor", "reduce-overhead", "erase/aot_eager",
            "erase", "erase+graphs")
#: Variants that need CUDA.
CUDA_ONLY = ("reduce-overhead", "erase+graphs")
#: Variants run by default on the CPU (no Inductor, no CUDA graphs).
CPU_DEFAULT_VARIANTS = ("baseline", "eager", "erase/aot_eager")
#: Variants whose throughput is compared with the paper's: erase, fastest first.
ERASE_VARIANTS = ("erase+graphs", "erase", "erase/aot_eager")
#: Stock compilations of the same detached model, the fair baselines of erase.
STOCK_VARIANTS = ("eager", "inductor", "reduce-overhead")
#: The rounding control: ``eager`` from initial weights one float step away.
ROUNDING_CONTROL = "eager/1ulp"

#: The paper's claim: p90 QPS gain on its CTR model (percent).
PAPER_P90_GAIN = 9.51

#: Presets; a flag given on the command line overrides its preset value.
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(steps=1000, seeds=5, batch=4096, eval_every=50, eval_rows=1 << 18,
                 warmup=20, freeze_steps=100, budget_s=0),
    "quick": dict(steps=200, seeds=2, batch=4096, eval_every=25, eval_rows=1 << 16,
                  warmup=10, freeze_steps=100, budget_s=210),
}


# -- data ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataSizes:
    """What the synthetic data looks like."""

    cap: int = 100_000
    rank: int = 8
    zipf: float = 1.1
    ctr: float = 0.25

    def rows_per_field(self) -> list[int]:
        return [min(card, self.cap) for card in CRITEO_KAGGLE_CARDINALITIES]


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class PlantedCriteo:
    """Criteo-like impressions whose clicks come from a planted logistic model.

    The planted tables are drawn on the CPU from ``seed`` (the same on every
    device); rows are drawn on ``device`` from a generator seeded with
    ``seed`` and a stream number, so a stream is the same for every variant.
    """

    def __init__(self, sizes: DataSizes, seed: int, device: torch.device):
        self.sizes, self.device = sizes, device
        rows = sizes.rows_per_field()
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.tensor([0, *rows[:-1]]).cumsum(0).to(device)
        # NB: one Zipf cumulative distribution per field, padded to the largest.
        width = max(rows)
        ranks = torch.arange(1, width + 1, dtype=torch.float64)
        cdfs = torch.ones(FIELDS, width, dtype=torch.float64)
        for field, n in enumerate(rows):
            probs = ranks[:n].pow(-sizes.zipf)
            cdfs[field, :n] = probs.cumsum(0) / probs.sum()
        self.cdfs = cdfs.to(device)
        self.rows = torch.tensor(rows, device=device)
        total = sum(rows)
        self.effect = torch.randn(total, generator=generator).to(device)
        self.latent = (torch.randn(total, sizes.rank, generator=generator)
                       / math.sqrt(sizes.rank)).to(device)
        self.dense_weight = torch.randn(DENSE_FEATURES, generator=generator).to(device)
        self.dense_to_latent = torch.randn(DENSE_FEATURES, sizes.rank,
                                           generator=generator).to(device)
        self.scale = {name: 1.0 for name in PLANTED_TERM_STD}
        self.bias = 0.0
        self._calibrate(seed)

    def _terms(self, dense: torch.Tensor, sparse: torch.Tensor) -> dict[str, torch.Tensor]:
        flat = sparse + self.offsets
        latent = self.latent[flat]  # [n, 26, r]
        summed = latent.sum(dim=1)
        return {
            "dense": dense @ self.dense_weight,
            "field": self.effect[flat].sum(dim=1),
            # sum over field pairs f < g of <u_f, u_g>
            "pairs": 0.5 * (summed.pow(2).sum(dim=1) - latent.pow(2).sum(dim=(1, 2))),
            "cross": (summed * (dense @ self.dense_to_latent)).sum(dim=1),
        }

    def logits(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        terms = self._terms(dense, sparse)
        return sum(self.scale[name] * term for name, term in terms.items()) + self.bias

    def _calibrate(self, seed: int) -> None:
        """Scale each term to its `PLANTED_TERM_STD` and set the bias for the target click rate."""
        dense, sparse = self._features(CALIBRATION_ROWS, self._generator(seed, stream=99))
        terms = self._terms(dense, sparse)
        for name, term in terms.items():
            self.scale[name] = PLANTED_TERM_STD[name] / term.std().clamp_min(1e-12).item()
        logits = self.logits(dense, sparse)
        low, high = -20.0, 20.0
        for _ in range(60):  # bisection on the mean click probability
            mid = (low + high) / 2
            if torch.sigmoid(logits + mid).mean().item() < self.sizes.ctr:
                low = mid
            else:
                high = mid
        self.bias = (low + high) / 2

    def _generator(self, seed: int, stream: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + stream)

    def _features(self, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        dense = torch.randn(rows, DENSE_FEATURES, device=self.device, generator=generator)
        uniform = torch.rand(FIELDS, rows, device=self.device, generator=generator,
                             dtype=torch.float64)
        # inverse CDF, one field per row of cdfs; the clamp guards against round-off at 1
        sparse = torch.searchsorted(self.cdfs, uniform)
        sparse = torch.minimum(sparse, (self.rows - 1).unsqueeze(1)).T.contiguous()
        return dense, sparse

    def sample(self, rows: int, seed: int, stream: int) -> tuple[Batch, torch.Tensor]:
        """``((dense, sparse, labels), planted click logits)`` of ``rows`` impressions."""
        generator = self._generator(seed, stream)
        parts: list[tuple[torch.Tensor, ...]] = []
        for start in range(0, rows, CHUNK_ROWS):
            dense, sparse = self._features(min(CHUNK_ROWS, rows - start), generator)
            logits = self.logits(dense, sparse)
            labels = torch.bernoulli(torch.sigmoid(logits), generator=generator)
            parts.append((dense, sparse, labels, logits))
        dense, sparse, labels, logits = (torch.cat(column) for column in zip(*parts))
        return (dense, sparse, labels), logits


@dataclasses.dataclass
class Dataset:
    """The training stream (``steps x batch`` rows, in order) and the eval set."""

    train: Batch
    eval: Batch
    batch: int
    oracle_ne: float
    train_ctr: float

    @classmethod
    def make(cls, sizes: DataSizes, steps: int, batch: int, eval_rows: int, seed: int,
             device: torch.device, train_rows: int | None = None) -> Dataset:
        """``steps x batch`` training rows (at most ``train_rows``, at least one batch)."""
        rows = steps * batch if train_rows is None else min(steps * batch, train_rows)
        planted = PlantedCriteo(sizes, seed, device)
        train, _ = planted.sample(max(rows // batch, 1) * batch, seed, stream=1)
        held_out, planted_logits = planted.sample(eval_rows, seed, stream=2)
        oracle = common.normalized_entropy(planted_logits, held_out[2])
        return cls(train, held_out, batch, oracle, train[2].mean().item())

    def step_batch(self, step: int) -> Batch:
        """The batch of training step ``step`` (0-based): views into the stream.

        The stream repeats when the steps outrun it (``--train-rows``).
        """
        start = step % (self.train[2].numel() // self.batch) * self.batch
        return tuple(t[start:start + self.batch] for t in self.train)  # type: ignore[return-value]


# -- model -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """Sizes of `BlockChainCTR`."""

    rows_per_field: tuple[int, ...]
    embed_dim: int = 64
    bottom: tuple[int, ...] = (512, 256)
    width: int = 512
    hidden: int = 1024
    blocks: int = 6
    #: ``"select"``: DLRM's interaction, the upper triangle of the dot products
    #: picked with ``index_select``; ``"mask"``: the whole matrix times a
    #: strict upper-triangle mask (the same features, no index op).
    interaction: str = "mask"


def mlp(*widths: int) -> nn.Sequential:
    """Linear-ReLU layers through ``widths`` (ReLU after the last one too, as DLRM's bottom MLP)."""
    layers: list[nn.Module] = []
    for width_in, width_out in zip(widths, widths[1:]):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers)


class DLRMFront(nn.Module):
    """Embeddings, bottom MLP, DLRM's pairwise dot interaction, a projection to the block width."""

    def __init__(self, sizes: ModelSizes):
        super().__init__()
        self.interaction = sizes.interaction
        rows = sizes.rows_per_field
        # NB: one table for all fields (per-field row offsets): one lookup kernel, not 26.
        self.embedding = nn.Embedding(sum(rows), sizes.embed_dim)
        nn.init.normal_(self.embedding.weight, std=sizes.embed_dim ** -0.5)
        self.register_buffer("offsets", torch.tensor([0, *rows[:-1]]).cumsum(0),
                             persistent=False)
        self.bottom = mlp(DENSE_FEATURES, *sizes.bottom, sizes.embed_dim)
        vectors = FIELDS + 1
        upper = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pair_index", upper[0] * vectors + upper[1], persistent=False)
        self.register_buffer("pair_mask", torch.ones(vectors, vectors).triu(1).flatten(),
                             persistent=False)
        pairs = upper.shape[1] if sizes.interaction == "select" else vectors * vectors
        self.projection = mlp(sizes.embed_dim + pairs, sizes.width)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        bottom = self.bottom(dense)
        embedded = self.embedding(sparse + self.offsets)  # [B, 26, E]
        vectors = torch.cat([bottom.unsqueeze(1), embedded], dim=1)  # [B, 27, E]
        dots = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)  # [B, 729]
        if self.interaction == "select":
            pairs = dots.index_select(1, self.pair_index)  # [B, 351]: each pair once, as DLRM
        else:
            pairs = dots * self.pair_mask  # the same pairs, the other 378 entries zeroed
        return self.projection(torch.cat([bottom, pairs], dim=1))


class DenseBlock(nn.Module):
    """One dense subarchitecture, ``LayerNorm(h + MLP(h))``, and its click head.

    NB: the residual connection lets each block start close to its input's
    features: without it, a chain of six 3-layer blocks learned the planted
    clicks about twice as slowly (eval NE after 300 steps on the CPU sizes).
    """

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, width),
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + self.mlp(h))


class BlockChainCTR(nn.Module):
    """The DLRM front, then a chain of dense blocks, each with a local BCE head.

    ``forward(dense, sparse, labels)`` returns the training loss: the sum of
    the blocks' local losses (`block_losses`). `predict` returns the last block's
    click logits.

    Args:
        detach: block k+1 reads block k's output detached (False: the
            baseline, trained end to end).
        local_losses: blocks 1..K-1 have a local loss (False: only the last
            block's loss, the freezing artifact).
        local_weight: weight of blocks 1..K-1's local losses.
    """

    def __init__(self, sizes: ModelSizes, detach: bool = True, local_losses: bool = True,
                 local_weight: float = 1.0):
        super().__init__()
        self.detach, self.local_losses, self.local_weight = detach, local_losses, local_weight
        self.front = DLRMFront(sizes)
        self.blocks = nn.ModuleList(DenseBlock(sizes.width, sizes.hidden)
                                    for _ in range(sizes.blocks))

    def has_local_loss(self, index: int) -> bool:
        return self.local_losses or index == len(self.blocks) - 1

    def loss_weight(self, index: int) -> float:
        return 1.0 if index == len(self.blocks) - 1 else self.local_weight

    def block_losses(self, dense: torch.Tensor, sparse: torch.Tensor,
                     labels: torch.Tensor) -> list[torch.Tensor | None]:
        """Each block's weighted local loss (None for a block without one)."""
        h = self.front(dense, sparse)
        losses: list[torch.Tensor | None] = []
        for index, block in enumerate(self.blocks):
            h = block(h)
            if self.has_local_loss(index):
                logits = block.head(h).squeeze(-1)
                losses.append(self.loss_weight(index)
                              * F.binary_cross_entropy_with_logits(logits, labels))
            else:
                losses.append(None)
            if self.detach:
                # NB: the stop-gradient: later losses do not reach this block.
                h = h.detach()
        return losses

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        return sum(loss for loss in self.block_losses(dense, sparse, labels) if loss is not None)

    def predict(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        h = self.front(dense, sparse)
        for block in self.blocks:
            h = block(h)
        return self.blocks[-1].head(h).squeeze(-1)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """``front`` and ``block1`` .. ``blockK``: each block's own parameters (body and head)."""
        groups = {"front": list(self.front.parameters())}
        for index, block in enumerate(self.blocks):
            groups[f"block{index + 1}"] = list(block.parameters())
        return groups

    def loss_sources(self, group: str) -> list[int]:
        """The 0-based blocks whose local losses reach ``group``'s parameters (none: frozen).

        Detached: only the group's own block (the front's is block 1).
        Without detach (the baseline): its block and every later one.
        """
        index = 0 if group == "front" else int(group.removeprefix("block")) - 1
        reach = [index] if self.detach else range(index, len(self.blocks))
        return [i for i in reach if self.has_local_loss(i)]


def group_of_param(name: str) -> str:
    """``front.bottom.0.weight`` -> ``front``; ``blocks.2.head.bias`` -> ``block3``."""
    parts = name.replace("_orig_mod.", "").split(".")
    if "blocks" in parts:
        return f"block{int(parts[parts.index('blocks') + 1]) + 1}"
    return "front" if "front" in parts else name


# -- variants --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a training run needs besides the variant and the seed."""

    device: torch.device
    steps: int
    warmup: int
    eval_every: int
    audit_steps: tuple[int, ...]
    optimizer: str
    lr: float
    inner: str
    streams: int


def compile_variant(name: str, model: nn.Module, settings: Settings) -> Callable[..., Any]:
    """What a training step of variant ``name`` calls: the module or a compiled wrapper."""
    if name in ("baseline", "eager", ROUNDING_CONTROL):
        return model
    if name == "inductor":
        return torch.compile(model)
    if name == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    inner = "aot_eager" if name == "erase/aot_eager" else settings.inner
    options = {"inner": inner, "streams": settings.streams,
               "cudagraphs": name == "erase+graphs"}
    return torch.compile(model, backend="erase", options=options)


def nudge_one_ulp(model: nn.Module) -> None:
    """Move every parameter one float step up (``torch.nextafter`` towards +inf), in place."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.nextafter(param, torch.full_like(param, math.inf)))


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """Adam (default), Adagrad (DLRM's usual choice) or SGD; dense updates of every parameter."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    return torch.optim.SGD(params, lr=lr)


# -- one training run --------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    """What one (variant, seed) run measured."""

    variant: str
    seed: int
    losses: list[float] = dataclasses.field(default_factory=list)
    ne_curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    timed_steps: list[int] = dataclasses.field(default_factory=list)
    qps: dict[str, float] = dataclasses.field(default_factory=dict)
    compile_seconds: float = math.nan
    peak_mib: float = math.nan
    audit: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    erase_reports: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    error: str | None = None
    #: largest |parameter difference| at the end from the same seed's eager / inductor run
    param_diffs: dict[str, float] = dataclasses.field(default_factory=dict)
    final_params: dict[str, torch.Tensor] | None = None

    @property
    def final_ne(self) -> float:
        return self.ne_curve[-1][1] if self.ne_curve else math.nan


def evaluate(model: BlockChainCTR, data: Dataset, chunk: int = 1 << 16) -> float:
    """Eval NE of the last block's head on the held-out set (eager, in chunks)."""
    dense, sparse, labels = data.eval
    with torch.no_grad():
        logits = torch.cat([model.predict(dense[i:i + chunk], sparse[i:i + chunk])
                            for i in range(0, labels.numel(), chunk)])
    return common.normalized_entropy(logits, labels)


def audit_gradients(model: BlockChainCTR, batch: Batch, step: int, variant: str) -> list[dict]:
    """Gradient norm of every group's own parameters, and the local loss it came from.

    Called after ``backward()`` and before the optimizer step, so the loss
    values (recomputed eagerly on the same batch, with the same weights) are
    those the gradients came from. A zero norm (or no gradient) is ``FAIL``.
    """
    with torch.no_grad():
        losses = model.block_losses(*batch)
    rows = []
    for group, params in model.param_groups().items():
        squares = [p.grad.double().pow(2).sum() for p in params if p.grad is not None]
        norm = torch.stack(squares).sum().sqrt().item() if squares else 0.0
        sources = model.loss_sources(group)
        rows.append({
            "variant": variant, "step": step, "group": group, "grad_norm": norm,
            "loss_from": "+".join(f"L{i + 1}" for i in sources) or "none",
            "local_loss": sum(losses[i].item() for i in sources) if sources else None,
            "status": "OK" if norm > 0 else "FAIL",
        })
    return rows


def train_run(variant: str, seed: int, base: BlockChainCTR, data: Dataset, settings: Settings,
              audit: bool, keep_params: bool) -> RunResult:
    """Train a deep copy of ``base`` as ``variant``; never raises (errors are recorded)."""
    result = RunResult(variant, seed)
    try:
        _train(result, base, data, settings, audit, keep_params)
    except Exception as error:  # noqa: BLE001 - one failing variant must not lose the others
        result.error = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        traceback.print_exc()
    finally:
        torch._dynamo.reset()
    return result


def _train(result: RunResult, base: BlockChainCTR, data: Dataset, settings: Settings,
           audit: bool, keep_params: bool) -> None:
    device = settings.device
    torch._dynamo.reset()
    model = copy.deepcopy(base).to(device)
    if result.variant == ROUNDING_CONTROL:
        nudge_one_ulp(model)
    step_fn = compile_variant(result.variant, model, settings)
    optimizer = make_optimizer(settings.optimizer, model.parameters(), settings.lr)
    timer = common.StepTimer(device)
    losses = torch.zeros(settings.steps, device=device, dtype=torch.float64)
    untimed: set[int] = set(range(min(settings.warmup, settings.steps)))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result.ne_curve.append((0, evaluate(model, data)))
    for step in range(settings.steps):
        batch = data.step_batch(step)
        first = step == 0
        wall = time.perf_counter()
        timer.start()
        optimizer.zero_grad(set_to_none=True)
        with erase_fx.collect_reports() if first else contextlib.nullcontext([]) as reports:
            loss = step_fn(*batch)
        loss.backward()
        if audit and step + 1 in settings.audit_steps:
            result.audit += audit_gradients(model, batch, step + 1, result.variant)
            untimed.add(step)
        optimizer.step()
        timer.stop()
        losses[step] = loss.detach()
        if first:
            common.synchronize(device)
            result.compile_seconds = time.perf_counter() - wall
            result.erase_reports = [r.to_dict() for r in reports]
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            result.ne_curve.append((step + 1, evaluate(model, data)))
    result.step_seconds = timer.seconds()
    result.losses = losses.tolist()
    result.timed_steps = [s for s in range(settings.steps) if s not in untimed]
    result.qps = common.throughput_stats([result.step_seconds[s] for s in result.timed_steps],
                                         data.batch)
    if device.type == "cuda":
        result.peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
    if keep_params:
        # NB: on the host, so that the next run's peak memory does not count them
        result.final_params = {n: p.detach().to("cpu", copy=True)
                               for n, p in model.named_parameters()}


def compare_final_params(runs: Sequence[RunResult]) -> None:
    """Fill each run's ``param_diffs`` against the same seed's eager and inductor runs, then
    drop the kept parameters (one seed's worth is held at a time)."""
    references = {run.variant: run for run in runs
                  if run.variant in ("eager", "inductor") and run.final_params is not None}
    for run in runs:
        if run.final_params is None or run.variant == "baseline":
            continue
        for name, reference in references.items():
            if reference is not run:
                run.param_diffs[name] = max(
                    (param - reference.final_params[key]).abs().max().item()
                    for key, param in run.final_params.items())
    for run in runs:
        run.final_params = None


# -- explain and the freezing demonstration ----------------------------------------


def explain_model(model: BlockChainCTR, batch: Batch, streams: int) -> dict[str, Any]:
    """What erase_fx finds in ``model``: early blocks and components left in the backward.

    Parameters are named by group (front, block1, ...): which block's
    backward erase_fx runs early.
    """
    reports = erase_fx.explain(model, *(t[:256] for t in batch),
                               erase_options={"streams": streams})
    early, rejected, summaries = [], [], []
    for report in reports:
        summaries.append(report.summary())
        for block in report.blocks:
            early.append({"id": block.id, "stream": block.stream,
                          "groups": sorted({group_of_param(p) for p in block.params}),
                          "flops": block.flops})
        for component in report.rejected:
            rejected.append({"reason": component.reason, "detail": component.detail,
                             "groups": sorted({group_of_param(p) for p in component.params})})
    return {"summaries": summaries, "early_blocks": early, "rejected": rejected}


def freeze_demo(base_sizes: ModelSizes, data: Dataset, settings: Settings, seed: int,
                local_weight: float, say: Callable[[str], None]) -> dict[str, Any]:
    """The reviewers' freezing artifact: blocks 1-5 without a local loss get zero gradient.

    Trains the no-local-loss model (eager and erase/aot_eager) for
    ``settings.steps`` steps, auditing the gradients, and asks
    `erase_fx.explain` what it finds in it and in the model with local losses.
    """
    build = lambda: BlockChainCTR(  # noqa: E731
        base_sizes, detach=True, local_losses=False, local_weight=local_weight)
    base = common.build_seeded(build, seed)
    runs = []
    for variant in ("eager", "erase/aot_eager"):
        run = train_run(variant, seed, base, data, settings, audit=True, keep_params=False)
        runs.append(run)
        say(f"  no-local-loss {variant:16s} final NE {fmt(run.final_ne)}"
            + (f" ERROR {run.error}" if run.error else ""))
        for step in settings.audit_steps:
            frozen = [row["group"] for row in run.audit
                      if row["step"] == step and row["status"] == "FAIL"]
            if frozen:
                say(f"    step {step}: zero gradient FAIL in {', '.join(frozen)} (expected: no "
                    f"local loss reaches them)")
    with_losses = common.build_seeded(lambda: BlockChainCTR(
        base_sizes, detach=True, local_losses=True, local_weight=local_weight), seed)
    batch = tuple(t.cpu() for t in data.step_batch(0))
    explained = {
        "with_local_losses": explain_model(with_losses, batch, settings.streams),
        "no_local_loss": explain_model(base, batch, settings.streams),
    }
    for key, found in explained.items():
        say(f"  explain ({key}): " + "; ".join(found["summaries"]))
    return {"runs": runs, "explain": explained}


# -- summaries ---------------------------------------------------------------------


def by_variant(runs: Sequence[RunResult]) -> dict[str, list[RunResult]]:
    grouped: dict[str, list[RunResult]] = {}
    for run in runs:
        if run.error is None:
            grouped.setdefault(run.variant, []).append(run)
    return grouped


def paired(a: list[RunResult], b: list[RunResult]) -> list[tuple[RunResult, RunResult]]:
    """Runs of two variants with the same seed."""
    seeds = {run.seed: run for run in b}
    return [(run, seeds[run.seed]) for run in a if run.seed in seeds]


def exactness(a: list[RunResult], b: list[RunResult]) -> dict[str, Any]:
    """Largest train-loss, NE and final-parameter differences between two variants, all seeds."""
    pairs = paired(a, b)
    if not pairs:
        return {}
    reference = b[0].variant
    loss_diff = max(max(abs(x - y) for x, y in zip(r.losses, s.losses)) for r, s in pairs)
    ne_diff = max(abs(r.final_ne - s.final_ne) for r, s in pairs)
    curve_diff = max(max(abs(x[1] - y[1]) for x, y in zip(r.ne_curve, s.ne_curve))
                     for r, s in pairs)
    diffs = [r.param_diffs.get(reference) for r, _ in pairs]
    param_diff = None if None in diffs else max(diffs)
    return {"seeds": len(pairs), "max_train_loss_diff": loss_diff, "final_ne_diff": ne_diff,
            "ne_curve_max_diff": curve_diff, "max_param_diff": param_diff,
            "final_ne_signed_diff_mean": mean_std([r.final_ne - s.final_ne for r, s in pairs])[0],
            "final_ne_abs_diff_mean": mean_std([abs(r.final_ne - s.final_ne)
                                                for r, s in pairs])[0]}


def gain(a: list[RunResult], b: list[RunResult], stat: str = "p90") -> tuple[float, float]:
    """Percent QPS gain of ``a`` over ``b`` (paired by seed): mean and std."""
    return mean_std([100 * (r.qps[stat] / s.qps[stat] - 1) for r, s in paired(a, b)])


def verdict(gain_mean: float, gain_std: float, paper: float) -> str:
    """``equal`` within max(2 std, 1 point) of the paper's gain; else ``better`` or ``worse``."""
    if math.isnan(gain_mean):
        return "not comparable"
    if abs(gain_mean - paper) <= max(2 * gain_std, 1.0):
        return "equal"
    return "better" if gain_mean > paper else "worse"


def summarize(runs: Sequence[RunResult], demo: dict[str, Any] | None, data: Dataset | DataFacts,
              args: argparse.Namespace, meta: dict[str, Any]) -> dict[str, Any]:
    """The results JSON (contract of bench/paper/README.md) from the runs so far."""
    grouped = by_variant(runs)
    name, k = args.name, args.blocks
    # NB: runs before the fix kept each run's final parameters on the GPU until the seed ended
    kept_on = meta.get("final_params_kept_on", "gpu")
    peak_note = ("" if kept_on == "cpu" else
                 " (peak memory includes the final parameters of the seed's earlier variants, "
                 "kept on the GPU for the exactness table: one model's worth per variant "
                 f"before it in the row order; final parameters kept on: {kept_on})")
    tables = [_variant_table(grouped, data, peak_note)]
    exact = _exactness_rows(grouped)
    if exact:
        tables.append(common.table(
            "Exactness: largest difference from the reference over every step and seed "
            "(erase/aot_eager vs eager must be exactly 0; the rounding control "
            f"{ROUNDING_CONTROL}, eager from weights one float step away, shows how far "
            "rounding alone carries a run)",
            ["variant", "reference", "seeds", "max |d train loss|", "max |d final NE|",
             "mean |d final NE|", "max |d NE curve|", "max |d param|", "exact"],
            [row["cells"] for row in exact]))
    speed = _speed_rows(grouped)
    if speed:
        tables.append(common.table(
            "QPS gain of each variant over the stock compilations of the same detached model "
            "(percent, paired by seed, mean ± std)",
            ["variant", *[f"p90 vs {r}" for r in STOCK_VARIANTS], "median vs best stock"],
            speed))
    decisions = _erase_decisions_table(grouped)
    if decisions["rows"]:
        tables.append(decisions)
    audit_rows = [row for run in runs for row in run.audit]
    if audit_rows:
        tables.append(_audit_table(audit_rows, "Gradient audit (first seed): norm of each "
                                   "group's own parameter gradients and the local loss it "
                                   "came from; zero is FAIL"))
    if demo:
        demo_rows = [row for run in demo["runs"] for row in run.audit]
        tables.append(_audit_table(demo_rows, f"No-local-loss demonstration: blocks 1-{k - 1} "
                                   "without a local loss (FAIL is the expected freezing "
                                   "artifact)"))
        tables.append(_explain_table(demo["explain"]))
    errors = [[run.variant, run.seed, run.error] for run in runs if run.error]
    if errors:
        tables.append(common.table("Runs that failed", ["variant", "seed", "error"], errors))
    failures = _failures(runs, exact)
    title = f"CTR model with {k} detached dense blocks"
    if args.no_local_loss:
        title += f" (no local losses on blocks 1-{k - 1})"
    subset = tuple(args.variants) != VARIANTS
    if subset:
        title += f": {', '.join(args.variants)} only"
    return {
        "title": title,
        "order": 11 if subset else 10,  # NB: the run of every variant first
        "meta": meta,
        "summary": _summary_text(grouped, data, args, failures),
        "tables": tables,
        "figures": _figures(grouped, name, data.oracle_ne),
        "paper_comparison": _paper_comparison(grouped, demo, exact, audit_rows, args),
        "data": {
            "failures": failures,
            "oracle_ne": data.oracle_ne,
            "train_ctr": data.train_ctr,
            "runs": [_run_data(run) for run in runs],
            "freeze_demo": ({"runs": [_run_data(run) for run in demo["runs"]],
                             "explain": demo["explain"]} if demo else None),
            "exactness": {f"{r['variant']} vs {r['reference']}": r["numbers"] for r in exact},
        },
    }


def _run_data(run: RunResult) -> dict[str, Any]:
    fields = dataclasses.asdict(dataclasses.replace(run, final_params=None))
    fields.pop("final_params")
    return fields


def _variant_table(grouped: dict[str, list[RunResult]], data: Dataset | DataFacts,
                   peak_note: str = "") -> dict[str, Any]:
    baseline = grouped.get("baseline", [])
    rows = []
    for variant in VARIANTS:
        runs = grouped.get(variant)
        if not runs:
            continue
        stat = {key: mean_std([run.qps[key] for run in runs]) for key in ("median", "p90", "p10")}
        gap = mean_std([r.final_ne - s.final_ne for r, s in paired(runs, baseline)])
        early = {len(report["blocks"]) for run in runs for report in run.erase_reports}
        rows.append([
            variant, len(runs),
            *(fmt_mean_std(*stat[key], digits=4) for key in ("median", "p90", "p10")),
            fmt_mean_std(*mean_std([run.qps["mean_step_ms"] for run in runs]), digits=3),
            fmt_mean_std(*mean_std([run.final_ne for run in runs]), digits=5),
            fmt_mean_std(*gap, digits=3) if variant != "baseline" else "-",
            fmt(mean_std([run.compile_seconds for run in runs])[0], 3),
            fmt(mean_std([run.peak_mib for run in runs])[0], 5),
            ",".join(str(n) for n in sorted(early)) if early else "-",
        ])
    return common.table(
        f"Per variant, mean ± std over seeds: per-step QPS (samples/s), step time, final eval "
        f"NE (oracle NE {data.oracle_ne:.4f}), NE gap vs the end-to-end baseline, first-step "
        f"seconds (compilation), peak memory, early blocks erase found" + peak_note,
        ["variant", "seeds", "median QPS", "p90 QPS", "p10 QPS", "step ms", "final NE",
         "NE - baseline NE", "first step s", "peak MiB", "early blocks"],
        rows)


#: (variant, reference) pairs of the exactness table, in its order. The first
#: must be exact; the rounding control's row is the yardstick of the others.
EXACTNESS_PAIRS = (
    ("erase/aot_eager", "eager"), ("erase/aot_eager", "inductor"),
    ("erase", "eager"), ("erase", "inductor"),
    ("erase+graphs", "eager"), ("erase+graphs", "inductor"),
    ("inductor", "eager"), ("reduce-overhead", "eager"),
    (ROUNDING_CONTROL, "eager"),
)


def _exactness_rows(grouped: dict[str, list[RunResult]]) -> list[dict[str, Any]]:
    rows = []
    for variant, reference in EXACTNESS_PAIRS:
        if variant not in grouped or reference not in grouped:
            continue
        numbers = exactness(grouped[variant], grouped[reference])
        is_exact = (numbers["max_train_loss_diff"] == 0 and numbers["final_ne_diff"] == 0
                    and numbers["max_param_diff"] in (0, 0.0, None))
        required = variant == "erase/aot_eager" and reference == "eager"
        flag = ("yes" if is_exact else "FAIL" if required
                else "no (control)" if variant == ROUNDING_CONTROL else "no (rounding)")
        rows.append({"variant": variant, "reference": reference, "numbers": numbers,
                     "required": required, "exact": is_exact, "cells": [
                         variant, reference, numbers["seeds"],
                         fmt(numbers["max_train_loss_diff"], 3),
                         fmt(numbers["final_ne_diff"], 3),
                         fmt(numbers["final_ne_abs_diff_mean"], 3),
                         fmt(numbers["ne_curve_max_diff"], 3),
                         fmt(numbers["max_param_diff"], 3), flag]})
    return rows


def _speed_rows(grouped: dict[str, list[RunResult]]) -> list[list[Any]]:
    stock = [v for v in STOCK_VARIANTS if v in grouped]
    rows = []
    for variant in ("erase/aot_eager", "erase", "erase+graphs", "inductor", "reduce-overhead"):
        if variant not in grouped or not stock:
            continue
        cells = [fmt_mean_std(*gain(grouped[variant], grouped[ref]), digits=3)
                 if ref in grouped and ref != variant else "-" for ref in STOCK_VARIANTS]
        best = _best_stock(grouped, "median", exclude=variant)
        cells.append(fmt_mean_std(*gain(grouped[variant], grouped[best], "median"), digits=3)
                     if best else "-")
        rows.append([variant, *cells])
    return rows


def _erase_decisions_table(grouped: dict[str, list[RunResult]]) -> dict[str, Any]:
    """What erase_fx did with each erase variant's graph (first seed): early or left, and why."""
    rows = []
    for variant in ERASE_VARIANTS[::-1]:
        for report in (grouped[variant][0].erase_reports if variant in grouped else []):
            early = ["+".join(sorted({group_of_param(p) for p in block["params"]}))
                     for block in report["blocks"]]
            left = [f"{'+'.join(sorted({group_of_param(p) for p in c['params']}))} "
                    f"({c['reason']}: {c['detail']})" for c in report["rejected"]]
            rows.append([variant, report["inner"], ", ".join(early) or "none",
                         "; ".join(left) or "-", report.get("fallback_reason") or "-"])
    return common.table("What erase_fx did with each erase variant's graph: the blocks whose "
                        "backward runs early, and what stays in the backward, with the reason",
                        ["variant", "inner", "early blocks", "left in the backward",
                         "stock path"], rows)


def _best_stock(grouped: dict[str, list[RunResult]], stat: str, exclude: str = "") -> str | None:
    """The stock variant with the highest mean ``stat`` QPS."""
    candidates = [v for v in STOCK_VARIANTS if v in grouped and v != exclude]
    if not candidates:
        return None
    return max(candidates, key=lambda v: mean_std([r.qps[stat] for r in grouped[v]])[0])


def _audit_table(rows: list[dict[str, Any]], caption: str) -> dict[str, Any]:
    """One row per (variant, step); a cell per group: ``norm (Lk = loss value)`` or FAIL."""
    groups = list(dict.fromkeys(r["group"] for r in rows))
    cells: dict[tuple[str, int], dict[str, str]] = {}
    for r in rows:
        text = f"{r['grad_norm']:.3g} ({r['loss_from']} = {fmt(r['local_loss'], 4)})"
        if r["status"] == "FAIL":
            text = f"**FAIL** {r['grad_norm']:.3g} (loss: {r['loss_from']})"
        cells.setdefault((r["variant"], r["step"]), {})[r["group"]] = text
    key = (". Cell: gradient norm of the group's own parameters (the local losses Lk that "
           "reach them = their value at that step)")
    return common.table(caption + key, ["variant", "step", *groups],
                        [[variant, step, *(row.get(g, "-") for g in groups)]
                         for (variant, step), row in cells.items()])


def _explain_table(explained: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for model, found in explained.items():
        for block in found["early_blocks"]:
            rows.append([model, f"early block {block['id']} (stream {block['stream']})",
                         " + ".join(block["groups"]), "runs during the forward"])
        for component in found["rejected"]:
            rows.append([model, "left in the backward", " + ".join(component["groups"]),
                         f"{component['reason']}: {component['detail']}"])
        if not found["early_blocks"] and not found["rejected"]:
            rows.append([model, "nothing found", "-", "; ".join(found["summaries"])])
    return common.table("What erase_fx.explain finds, with and without local losses",
                        ["model", "component", "parameters of", "why"], rows)


def _zero_gradients(run: RunResult) -> list[str]:
    """One line per audited step with a zero-gradient group: ``eager step 1: front, block1``."""
    lines = []
    for step in dict.fromkeys(row["step"] for row in run.audit):
        frozen = [row["group"] for row in run.audit
                  if row["step"] == step and row["status"] == "FAIL"]
        if frozen:
            lines.append(f"{run.variant} step {step}: zero gradient in {', '.join(frozen)}")
    return lines


def _failures(runs: Sequence[RunResult], exact: list[dict[str, Any]]) -> list[str]:
    failures = [f"{r['variant']} vs {r['reference']} not exact" for r in exact
                if r["required"] and not r["exact"]]
    failures += [failure for run in runs for failure in _zero_gradients(run)]
    failures += [f"{run.variant} seed {run.seed}: {run.error}" for run in runs if run.error]
    return failures


def _summary_text(grouped: dict[str, list[RunResult]], data: Dataset | DataFacts,
                  args: argparse.Namespace, failures: list[str]) -> str:
    k = args.blocks
    text = (
        f"Synthetic Criteo-like data (26 fields, Criteo Kaggle cardinalities capped at "
        f"{args.cap}, base CTR {data.train_ctr:.3f}, planted logistic model with interactions; "
        f"oracle NE {data.oracle_ne:.4f}). Model: DLRM front, {k} dense blocks "
        f"(d={args.width}, h={args.hidden}) in a chain, block k+1 reading block k's output "
        f"detached, each with a BCE head on the click (weight {args.local_weight} for blocks "
        f"1-{k - 1}, 1.0 for block {k}); NE from block {k}'s head. {args.optimizer} lr {args.lr}, "
        f"batch {args.batch}, {args.steps} steps, seeds {args.seed}..{args.seed + args.seeds - 1}."
        f" QPS: per-step batch/step time after {args.warmup} warm-up steps; p90 = 90th "
        f"percentile of per-step QPS, p10 = 10th. Paper verdict rule: equal within "
        f"max(2 std, 1 point) of +{PAPER_P90_GAIN}%."
    )
    if ROUNDING_CONTROL in grouped:
        text += (f" {ROUNDING_CONTROL} is the rounding control: eager training from initial "
                 "weights each one float step away; its differences from eager are what "
                 "rounding alone does to a run.")
    if args.no_local_loss:
        text += f" Blocks 1-{k - 1} have no local loss here: they are frozen (zero gradient)."
    if failures:
        text += " **FAIL:** " + "; ".join(failures[:10])
    return text


def _frozen_ne(demo: dict[str, Any], grouped: dict[str, list[RunResult]]) -> str:
    """The frozen model's eval NE next to the trained one's at the same step (first seed)."""
    frozen = demo["runs"][0]
    if frozen.error or not frozen.ne_curve:
        return ""
    step, ne = frozen.ne_curve[-1]
    text = f"; eval NE after {step} steps: {ne:.4f} frozen"
    trained = grouped.get("eager", [])
    at_step = [v for s, v in trained[0].ne_curve if s == step] if trained else []
    if at_step:
        text += f" vs {at_step[0]:.4f} with local losses (eager)"
    return text


def _ne_ylim(curves: list[dict[str, Any]], oracle: float) -> list[float | None]:
    """A y range that shows training, not the untrained model's NE at step 0."""
    later = [y for c in curves for x, y in zip(c["x"], c["y"]) if x > 0 and not math.isnan(y)]
    if not later:
        return [None, None]
    low, high = min(min(later), oracle), max(later)
    margin = 0.05 * (high - low) or 0.01
    return [low - margin, high + margin]


def _against_rounding(exact: list[dict[str, Any]], variant: str) -> str:
    """``variant``'s |d final NE| from eager next to the rounding control's, or ''."""
    numbers = {row["variant"]: row["numbers"] for row in exact if row["reference"] == "eager"}
    if variant not in numbers or ROUNDING_CONTROL not in numbers:
        return ""
    return "; |d final NE| from eager, mean (max) over seeds: " + ", ".join(
        f"{v} {numbers[v]['final_ne_abs_diff_mean']:.3g} ({numbers[v]['final_ne_diff']:.3g})"
        for v in (variant, ROUNDING_CONTROL)) + " (the rounding control)"


def _figures(grouped: dict[str, list[RunResult]], name: str,
             oracle_ne: float) -> list[dict[str, Any]]:
    curves = []
    for variant in VARIANTS:
        runs = grouped.get(variant)
        if not runs:
            continue
        steps = [step for step, _ in runs[0].ne_curve]
        stats = [mean_std([run.ne_curve[i][1] for run in runs if i < len(run.ne_curve)])
                 for i in range(len(steps))]
        curves.append({"label": variant, "x": steps, "y": [m for m, _ in stats],
                       "yerr": [s for _, s in stats]})
    bars = []
    for variant in VARIANTS:
        runs = grouped.get(variant)
        if runs and variant != ROUNDING_CONTROL:
            stats = [mean_std([run.qps[key] for run in runs]) for key in ("median", "p90", "p10")]
            bars.append({"label": variant, "y": [m for m, _ in stats],
                         "yerr": [s for _, s in stats]})
    figures = []
    if curves:
        figures.append({"file": f"{name}_ne_curves.png", "kind": "line",
                        "caption": "Eval NE of the last block's head during training, mean ± std "
                                   "over seeds (lower is better; the step-0 point is above the "
                                   "plotted range when it is cut)",
                        "xlabel": "training step", "ylabel": "eval NE", "series": curves,
                        "ylim": _ne_ylim(curves, oracle_ne),
                        "hlines": [{"y": oracle_ne, "label": "oracle NE (planted model)"}]})
    if bars:
        figures.append({"file": f"{name}_qps.png", "kind": "bar",
                        "caption": "Per-step QPS: median, p90 and p10 over the timed steps, "
                                   "mean ± std over seeds",
                        "xlabel": "statistic", "ylabel": "samples / s",
                        "categories": ["median", "p90", "p10"], "series": bars})
    return figures


def _paper_comparison(grouped: dict[str, list[RunResult]], demo: dict[str, Any] | None,
                      exact: list[dict[str, Any]], audit_rows: list[dict[str, Any]],
                      args: argparse.Namespace) -> list[dict[str, Any]]:
    rows, k = [], args.blocks
    fastest = next((v for v in ERASE_VARIANTS if v in grouped and v != "erase/aot_eager"), None)
    best = _best_stock(grouped, "p90")
    if fastest and best:
        mean, std = gain(grouped[fastest], grouped[best])
        per_seed = ", ".join(f"{100 * (r.qps['p90'] / s.qps['p90'] - 1):+.1f}"
                             for r, s in paired(grouped[fastest], grouped[best]))
        rows.append({
            "claim": f"p90 QPS gain of the early-backward schedule, CTR model with {k} "
                     "detached dense blocks",
            "paper": f"+{PAPER_P90_GAIN}%",
            "erase_fx": f"{mean:+.2f}% ± {std:.2f} ({fastest} vs {best}, the fastest stock "
                        f"compilation of the same detached model; per seed: {per_seed})",
            "verdict": verdict(mean, std, PAPER_P90_GAIN),
            "note": "different model sizes, GPU and baseline: the paper's baseline and local "
                    "losses are unspecified",
        })
        if "eager" in grouped and best != "eager":
            mean, std = gain(grouped[fastest], grouped["eager"])
            rows.append({
                "claim": "p90 QPS gain over eager training of the same detached model",
                "paper": f"+{PAPER_P90_GAIN}% (baseline unspecified)",
                "erase_fx": f"{mean:+.2f}% ± {std:.2f} ({fastest} vs eager)",
                "verdict": verdict(mean, std, PAPER_P90_GAIN),
                "note": "most of this gain is compilation (Inductor, CUDA graphs), not the "
                        "schedule: compare the row above",
            })
    else:
        rows.append({"claim": "p90 QPS gain of the early-backward schedule",
                     "paper": f"+{PAPER_P90_GAIN}%",
                     "erase_fx": "not measured in this run (no erase variant with Inductor, "
                                 "or no stock baseline; CPU runs measure no speed)",
                     "verdict": "not comparable"})
    ne_variant = fastest or ("erase/aot_eager" if "erase/aot_eager" in grouped else None)
    if ne_variant:
        parts = [f"{v} {fmt_mean_std(*mean_std([r.final_ne for r in grouped[v]]), digits=5)}"
                 for v in (ne_variant, "eager", "baseline") if v in grouped]
        rows.append({"claim": "NE of the fastest configuration",
                     "paper": "not measured",
                     "erase_fx": "final eval NE: " + "; ".join(parts)
                                 + _against_rounding(exact, ne_variant),
                     "verdict": "not comparable",
                     "note": "the paper gives no NE to compare with"})
    proof = next((r for r in exact if r["required"]), None)
    if proof:
        numbers = proof["numbers"]
        rows.append({"claim": "the early backward leaves training unchanged",
                     "paper": "not shown",
                     "erase_fx": f"erase/aot_eager vs eager over {args.steps} steps x "
                                 f"{numbers['seeds']} seeds: max |d train loss| "
                                 f"{numbers['max_train_loss_diff']:.3g}, |d NE| "
                                 f"{numbers['final_ne_diff']:.3g}, max |d param| "
                                 f"{fmt(numbers['max_param_diff'], 3)}",
                     "verdict": "not comparable",
                     "note": "exact equality is the erase_fx guarantee; the paper has no number"})
    zero = sorted({r["group"] for r in audit_rows if r["status"] == "FAIL"})
    text = ("every block's gradient is non-zero at the audited steps" if not zero
            else "zero gradient in " + ", ".join(zero))
    if demo:
        found = demo["explain"]
        text += (f"; without local losses on blocks 1-{k - 1} their gradient is exactly zero "
                 f"(frozen): erase_fx finds {len(found['no_local_loss']['early_blocks'])} early "
                 f"blocks, vs {len(found['with_local_losses']['early_blocks'])} with local "
                 f"losses")
        text += _frozen_ne(demo, grouped)
    losses = (f"BCE head on block {k} only (this run: --no-local-loss)" if args.no_local_loss
              else f"BCE head per block (weight {args.local_weight})")
    rows.append({"claim": "local losses of the detached blocks",
                 "paper": "not specified",
                 "erase_fx": f"{losses}; {text}",
                 "verdict": "not comparable",
                 "note": "without local losses a speed-up comes from freezing blocks, not from "
                         "scheduling"})
    return rows


# -- command line ------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.paper.ctr", description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"the quick preset {PRESETS['quick']} (else {PRESETS['full']})")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated, of {','.join(VARIANTS)} (default: all on CUDA, "
                             f"{','.join(CPU_DEFAULT_VARIANTS)} on CPU)")
    sizes = parser.add_argument_group("run sizes (default: the preset's)")
    for flag, kind in (("steps", int), ("seeds", int), ("batch", int), ("eval-every", int),
                       ("eval-rows", int), ("warmup", int), ("freeze-steps", int)):
        sizes.add_argument(f"--{flag}", type=kind, default=None)
    parser.add_argument("--seed", type=int, default=0, help="first model seed")
    parser.add_argument("--data-seed", type=int, default=1234)
    parser.add_argument("--cap", type=int, default=100_000, help="most rows of a field's table")
    parser.add_argument("--rank", type=int, default=8, help="rank of the planted interactions")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the categories")
    parser.add_argument("--ctr", type=float, default=0.25, help="target click rate")
    parser.add_argument("--embed-dim", type=int, default=64)
    parser.add_argument("--bottom", default="512,256", help="bottom MLP hidden widths")
    parser.add_argument("--width", type=int, default=512, help="block width d")
    parser.add_argument("--hidden", type=int, default=1024, help="block hidden width h")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--interaction", choices=("select", "mask"), default="mask",
                        help="pairwise dots times an upper-triangle mask, or DLRM's index_select")
    parser.add_argument("--local-weight", type=float, default=1.0,
                        help="weight of blocks 1..K-1's local BCE losses")
    parser.add_argument("--no-local-loss", action="store_true",
                        help="blocks 1..K-1 without a local loss (the freezing artifact)")
    parser.add_argument("--optimizer", choices=("adam", "adagrad", "sgd"), default="adam")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--inner", choices=("inductor", "aot_eager", "eager"), default=None,
                        help="erase's inner compiler (default: inductor on CUDA, aot_eager on CPU)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--audit-steps", default="1,10,100")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.use_deterministic_algorithms for every variant")
    parser.add_argument("--strict", action="store_true", help="exit 1 on any FAIL")
    sizes.add_argument("--budget-s", type=float, default=None,
                       help="start no new run after this many seconds (0: no limit)")
    parser.add_argument("--train-rows", type=int, default=None,
                        help="training rows drawn (default steps x batch); the stream repeats")
    parser.add_argument("--results-dir", default=str(common.DEFAULT_RESULTS_DIR))
    parser.add_argument("--name", default=None,
                        help="results file stem (default: ctr, or ctr-no-local-loss)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="run nothing: join results files of one run split over disjoint "
                             "seeds (e.g. --seed 0 --seeds 3, then --seed 3 --seeds 2) into "
                             "<results-dir>/<name>.json; every other flag of the parts must "
                             "agree, and here only --name, --results-dir and --strict count. "
                             "Given one file: summarize its runs again with this code")
    args = parser.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.inner is None:
        args.inner = "inductor" if args.device.type == "cuda" else "aot_eager"
    if args.variants is None:
        args.variants = VARIANTS if args.device.type == "cuda" else CPU_DEFAULT_VARIANTS
    else:
        args.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; allowed: {', '.join(VARIANTS)}")
    if args.device.type != "cuda" and any(v in CUDA_ONLY for v in args.variants):
        parser.error(f"{', '.join(CUDA_ONLY)} need CUDA (CUDA graphs)")
    args.variants = tuple(v for v in VARIANTS if v in args.variants)  # run order
    args.audit_steps = tuple(int(s) for s in args.audit_steps.split(",") if s.strip())
    args.bottom = tuple(int(w) for w in args.bottom.split(","))
    args.name = args.name or ("ctr-no-local-loss" if args.no_local_loss else "ctr")
    return args


class Budget:
    """``--budget-s``: once spent, no new run starts; what ran is kept and written."""

    def __init__(self, seconds: float | None, say: Callable[[str], None]):
        self.seconds, self.say = seconds, say
        self.start = time.perf_counter()
        self.exhausted: str | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self, where: str) -> bool:
        if not self.seconds or self.elapsed() < self.seconds:
            return False
        if self.exhausted is None:
            self.exhausted = where
            self.say(f"--budget-s {self.seconds:g} spent: no new run ({where})")
        return True


def run_seeds(args: argparse.Namespace, data: Dataset, model_sizes: ModelSizes,
              settings: Settings, budget: Budget, save: Callable[[list[RunResult]], None],
              say: Callable[[str], None]) -> list[RunResult]:
    """Every variant of every seed; the variants of a seed start from one module's weights.

    The first seed's runs are audited. After each seed the final parameters
    are compared across variants and the results file is rewritten.
    """
    runs: list[RunResult] = []
    total = args.seeds * len(args.variants)
    for seed in range(args.seed, args.seed + args.seeds):
        base = common.build_seeded(lambda: BlockChainCTR(
            model_sizes, detach=True, local_losses=not args.no_local_loss,
            local_weight=args.local_weight), seed)
        seed_runs = []
        for variant in args.variants:
            if budget.spent(f"after {len(runs)} of {total} runs"):
                break
            model = base if variant != "baseline" else _undetached(base)
            run = train_run(variant, seed, model, data, settings, audit=seed == args.seed,
                            keep_params=True)
            seed_runs.append(run)
            runs.append(run)
            say(_progress(len(runs), total, run, budget.elapsed()))
            for failure in _zero_gradients(run):
                say(f"  FAIL: {failure}")
        compare_final_params(seed_runs)
        _report_exactness(seed_runs, say)
        save(runs)
        if budget.exhausted:
            break
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    say = lambda text: print(text, flush=True)  # noqa: E731
    if args.merge:
        payload = merge([Path(p) for p in args.merge], args.name,
                        common.command_line("bench.paper.ctr", argv))
        common.write_results(args.name, payload, args.results_dir)
        return _finish(payload, args, f"from {len(args.merge)} results file(s)", say)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    budget = Budget(args.budget_s, say)
    say(f"ctr: torch {torch.__version__} on {common.device_name(device)}; variants "
        f"{','.join(args.variants)}; {args.seeds} seeds x {args.steps} steps, batch {args.batch}")
    data_sizes = DataSizes(cap=args.cap, rank=args.rank, zipf=args.zipf, ctr=args.ctr)
    data = Dataset.make(data_sizes, args.steps, args.batch, args.eval_rows, args.data_seed, device,
                        args.train_rows)
    say(f"data: {data.train[2].numel()} training rows, {args.eval_rows} eval rows, click rate "
        f"{data.train_ctr:.3f}, oracle NE {data.oracle_ne:.4f} ({budget.elapsed():.1f} s)")
    model_sizes = ModelSizes(tuple(data_sizes.rows_per_field()), args.embed_dim, args.bottom,
                             args.width, args.hidden, args.blocks, args.interaction)
    settings = Settings(device, args.steps, args.warmup, args.eval_every, args.audit_steps,
                        args.optimizer, args.lr, args.inner, args.streams)
    meta = common.run_meta(
        device, common.command_line("bench.paper.ctr", argv), quick=args.quick,
        erase_fx=erase_fx.__version__, variants=list(args.variants), steps=args.steps,
        seeds=args.seeds, batch=args.batch, deterministic=args.deterministic, tf32=args.tf32,
        settings=settings_record(args), final_params_kept_on="cpu")
    demo: dict[str, Any] | None = None

    def save(runs: list[RunResult]) -> dict[str, Any]:
        if budget.exhausted:
            meta["budget_exhausted"] = budget.exhausted
        payload = summarize(runs, demo, data, args, meta)
        common.write_results(args.name, payload, args.results_dir)
        return payload

    # NB: the demonstration first: it is cheap, and --budget-s must not skip it.
    if args.freeze_steps > 0 and not args.no_local_loss:
        say(f"no-local-loss demonstration: {args.freeze_steps} steps, eager and erase/aot_eager")
        freeze_settings = dataclasses.replace(settings, steps=args.freeze_steps,
                                              warmup=min(args.warmup, args.freeze_steps))
        demo = freeze_demo(model_sizes, data, freeze_settings, args.seed, args.local_weight, say)
    runs = run_seeds(args, data, model_sizes, settings, budget, save, say)
    return _finish(save(runs), args, f"in {budget.elapsed():.0f} s", say)


def _finish(payload: dict[str, Any], args: argparse.Namespace, how: str,
            say: Callable[[str], None]) -> int:
    """Print the main tables and the failures; the exit status."""
    for table in payload["tables"][:3]:
        say(_format_table(table))
    failures = payload["data"]["failures"]
    say(f"wrote {args.results_dir}/{args.name}.json {how}; "
        + ("FAIL: " + "; ".join(failures) if failures else "no FAIL"))
    return 1 if failures and args.strict else 0


# -- merging runs split over several invocations ------------------------------------

#: Flags that may differ between the parts of a merged run.
MERGE_MAY_DIFFER = ("seed", "seeds", "budget_s", "results_dir", "name", "merge", "strict",
                    "freeze_steps")


@dataclasses.dataclass(frozen=True)
class DataFacts:
    """What a summary needs to know of the data (a merge has no `Dataset`)."""

    oracle_ne: float
    train_ctr: float


def settings_record(args: argparse.Namespace) -> dict[str, Any]:
    """Every flag of a run, JSON-ready (``meta.settings``): what ``--merge`` checks."""
    record = {}
    for key, value in vars(args).items():
        if isinstance(value, torch.device):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        record[key] = value
    return record


def merge(paths: Sequence[Path], name: str, command: str) -> dict[str, Any]:
    """One results payload from the files of one run split over disjoint seeds.

    Given one file, it summarizes that run again with this version of the
    code (new tables from the same measurements).

    The gradient audit is the first seed's, as in a run of all the seeds
    (each part audited its own first seed); the no-local-loss demonstration
    is the first part's that has one.

    Raises ValueError when the files do not belong together: a flag other
    than `MERGE_MAY_DIFFER`, the device, the torch version or the data
    differ, a seed is in two files, or the seeds have a gap.
    """
    if not paths:
        raise ValueError("--merge needs a results file or more")
    parts = [json.loads(Path(path).read_text()) for path in paths]
    for path, part in zip(paths, parts):
        if "settings" not in part["meta"]:
            raise ValueError(f"{path} has no meta.settings: it was written before --merge "
                             f"existed; run it again")
    first = parts[0]
    for path, part in zip(paths[1:], parts[1:]):
        differ = sorted(key for key in first["meta"]["settings"].keys()
                        | part["meta"]["settings"].keys()
                        if key not in MERGE_MAY_DIFFER
                        and first["meta"]["settings"].get(key) != part["meta"]["settings"].get(key))
        differ += [f"meta.{key}" for key in ("torch", "device")
                   if part["meta"][key] != first["meta"][key]]
        differ += [f"data.{key}" for key in ("oracle_ne", "train_ctr")
                   if part["data"][key] != first["data"][key]]
        if differ:
            raise ValueError(f"{path} and {paths[0]} are not parts of one run: they differ in "
                             f"{', '.join(differ)}")
    seeds_by_file = [sorted({run["seed"] for run in part["data"]["runs"]}) for part in parts]
    seeds = sorted(seed for part_seeds in seeds_by_file for seed in part_seeds)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"a seed is in two files (seeds per file: {seeds_by_file})")
    if seeds != list(range(seeds[0], seeds[0] + len(seeds))):
        raise ValueError(f"the seeds have a gap (seeds per file: {seeds_by_file})")
    runs = sorted((_run_from_data(run) for part in parts for run in part["data"]["runs"]),
                  key=lambda run: (run.seed, VARIANTS.index(run.variant)))
    for run in runs:
        # NB: each part audited its own first seed; the audit is the first seed's
        if run.seed != seeds[0]:
            run.audit = []
    demo = next(({"runs": [_run_from_data(run) for run in part["data"]["freeze_demo"]["runs"]],
                  "explain": part["data"]["freeze_demo"]["explain"]}
                 for part in parts if part["data"]["freeze_demo"]), None)
    settings = {**first["meta"]["settings"], "seed": seeds[0], "seeds": len(seeds), "name": name}
    meta = {key: value for key, value in first["meta"].items() if key != "budget_exhausted"}
    kept_on: dict[str, list[int]] = {}
    for part, part_seeds in zip(parts, seeds_by_file):
        kept_on.setdefault(part["meta"].get("final_params_kept_on", "gpu"), []).extend(part_seeds)
    meta["final_params_kept_on"] = (next(iter(kept_on)) if len(kept_on) == 1 else ", ".join(
        f"{where} for seeds {','.join(map(str, sorted(where_seeds)))}"
        for where, where_seeds in kept_on.items()))
    meta.update(command=command, seeds=len(seeds), settings=settings, merged_from=[
        {"file": Path(path).name, "seeds": part_seeds, **{
            key: part["meta"].get(key)
            for key in ("date", "command", "git_commit", "budget_exhausted")}}
        for path, part, part_seeds in zip(paths, parts, seeds_by_file)])
    data = DataFacts(first["data"]["oracle_ne"], first["data"]["train_ctr"])
    return summarize(runs, demo, data, argparse.Namespace(**settings), meta)


def _run_from_data(fields: dict[str, Any]) -> RunResult:
    """A `RunResult` back from its JSON (``null`` was NaN)."""
    fields = dict(fields, ne_curve=[tuple(point) for point in fields["ne_curve"]])
    for key in ("compile_seconds", "peak_mib"):
        if fields[key] is None:
            fields[key] = math.nan
    return RunResult(**fields)


def _undetached(base: BlockChainCTR) -> BlockChainCTR:
    """The baseline: the same weights, no stop-gradient."""
    baseline = copy.deepcopy(base)
    baseline.detach = False
    return baseline


def _report_exactness(runs: list[RunResult], say: Callable[[str], None]) -> None:
    grouped = by_variant(runs)
    for row in _exactness_rows(grouped):
        numbers = row["numbers"]
        flag = "OK" if row["exact"] else ("FAIL" if row["required"] else "(rounding)")
        say(f"  {row['variant']} vs {row['reference']}: max |d loss| "
            f"{numbers['max_train_loss_diff']:.3g}, |d NE| {numbers['final_ne_diff']:.3g}, "
            f"max |d param| {fmt(numbers['max_param_diff'], 3)} {flag}")


def _progress(done: int, total: int, run: RunResult, elapsed: float) -> str:
    head = f"[{done}/{total}] {run.variant:16s} seed {run.seed}"
    if run.error:
        return f"{head}: ERROR {run.error}"
    return (f"{head}: p90 QPS {run.qps['p90']:.4g}, median {run.qps['median']:.4g}, "
            f"step {run.qps['mean_step_ms']:.2f} ms, first step {run.compile_seconds:.1f} s, "
            f"final NE {run.final_ne:.5f}, elapsed {elapsed:.0f} s")


def _format_table(table: dict[str, Any]) -> str:
    lines = [table["caption"], "| " + " | ".join(table["columns"]) + " |",
             "|" + "---|" * len(table["columns"])]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
