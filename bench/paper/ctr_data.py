"""The planted Criteo-like data of the CTR experiment (``bench/paper/ctr.py``).

13 dense features (standard normal: Criteo's counts after ``log1p`` and
standardisation) and 26 categorical fields with the Criteo Kaggle
cardinalities (`CRITEO_KAGGLE_CARDINALITIES`), each capped at ``--cap``.
Categories follow a Zipf law (a few frequent, most rare). Clicks are drawn
from a planted logistic model (`PlantedCriteo`): a linear term in the dense
features, a per-category effect per field, and two low-rank interaction
terms: the pairwise dot products of hidden rank-``r`` category vectors (what
a factorization machine or DLRM's dot interaction can learn) and the dot
product of their sum with a projection of the dense features. Each term is
scaled to a fixed share of the logit (`PLANTED_TERM_STD`) and the bias is
set so the click rate is ``--ctr`` (0.25). The data seed is fixed
(``--data-seed``); seeds vary the model's initial weights only. The
training stream (``steps x batch`` rows) and the held-out eval set
(`Dataset`) are drawn once, on the device, and every variant sees the same
rows in the same order. The NE of the planted probabilities themselves on
the eval set is reported as the "oracle" NE, the best any model can score.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from bench.paper import common

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
