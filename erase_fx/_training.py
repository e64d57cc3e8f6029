"""Training helpers the demo and the paper's experiments share: one copy, in the package.

``erase_fx.demo`` ships in the installed package, which cannot import
``bench/``; ``bench/paper/common.py`` imports these from here.

- `build_seeded`: a model with its weights drawn from a seed;
- `mlp`: Linear-ReLU layers through given widths;
- `binary_entropy`, `normalized_entropy`: NE, the click models' metric.

Only torch is imported here.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn


def build_seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` with its weights drawn from ``seed``; torch's global RNG is left as it was.

    Copies of this one module (the demo's eager and erase copies, the
    variants of one seed in the experiments) share their initial weights
    exactly.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def mlp(*widths: int) -> nn.Sequential:
    """Linear-ReLU layers through ``widths`` (ReLU after the last one too, as DLRM's bottom MLP)."""
    layers: list[nn.Module] = []
    for width_in, width_out in zip(widths, widths[1:]):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers)


def binary_entropy(rate: float) -> float:
    """``H(p) = -(p log p + (1-p) log(1-p))`` in nats (0 at p = 0 or 1)."""
    if rate <= 0.0 or rate >= 1.0:
        return 0.0
    return -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """NE: mean BCE of the predicted click logits over the entropy of the labels' base rate.

    ``NE = mean BCE / H(p)`` with ``p`` the click rate of ``labels``: 1.0 is
    what always predicting the base rate scores; lower is better. Computed in
    float64 so that two runs' NE are equal exactly when their logits are.
    """
    logits = logits.detach().double().flatten()
    labels = labels.detach().double().flatten()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).item()
    return bce / binary_entropy(labels.mean().item())
