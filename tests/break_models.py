"""Models written as users write them, whose forward Dynamo splits at graph breaks.

Each has two detached blocks with local losses and, between them, one thing
Dynamo cannot put in a graph. The ``*_factory`` functions are for
``erase-fx explain break_models:<factory>`` (``(model, example_inputs)``).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class TwoLocalBlocks(nn.Module):
    """Two blocks, each with a local head and loss; the second reads the first detached."""

    def __init__(self, d: int = 16, classes: int = 5):
        super().__init__()
        self.b1 = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU())
        self.head1 = nn.Linear(d, classes)
        self.b2 = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU())
        self.head2 = nn.Linear(d, classes)


class ItemLogged(TwoLocalBlocks):
    """Logs the first block's loss with ``.item()`` (kept on the module) between the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[float] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.b1(x)
        loss1 = F.cross_entropy(self.head1(h), labels)
        self.logged.append(loss1.item())  # ITEM_LINE
        h = self.b2(h.detach())
        return loss1 + F.cross_entropy(self.head2(h), labels)


class MaskedRows(TwoLocalBlocks):
    """The second block reads only the rows the first keeps: a data-dependent op between them."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.b1(x)
        loss1 = F.cross_entropy(self.head1(h), labels)
        kept = h.detach().sum(-1) > 0
        h, labels = h.detach()[kept], labels[kept]  # MASK_LINE
        return loss1 + F.cross_entropy(self.head2(self.b2(h)), labels)


class LossAfterBreak(TwoLocalBlocks):
    """The first block's loss is computed after a ``.item()`` of its activations: the block
    and its loss land in two graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[float] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.b1(x)
        self.logged.append(h.detach().norm().item())  # NORM_LINE
        loss1 = F.cross_entropy(self.head1(h), labels)
        h = self.b2(h.detach())
        return loss1 + F.cross_entropy(self.head2(h), labels)


class PassGradient(torch.autograd.Function):
    """Identity with a hand-written backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class FunctionInstance(TwoLocalBlocks):
    """Keeps an ``autograd.Function`` instance as an attribute and applies it through it (a
    module that cannot be deep-copied or pickled)."""

    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():  # torch: "should not be instantiated"
            warnings.simplefilter("ignore", DeprecationWarning)
            self.pass_gradient = PassGradient()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.pass_gradient.apply(self.b1(x))  # APPLY_LINE
        loss1 = F.cross_entropy(self.head1(h), labels)
        h = self.b2(h.detach())
        return loss1 + F.cross_entropy(self.head2(h), labels)


def inputs(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(batch, 16, generator=generator),
            torch.randint(0, 5, (batch,), generator=generator))


def item_factory() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return ItemLogged(), inputs()


def masked_factory() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return MaskedRows(), inputs()


def function_instance_factory() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return FunctionInstance(), inputs()


def line_of(cls: type, marker: str) -> int:
    """The line number of the source line of ``cls`` that ends with ``# marker``."""
    import inspect

    lines, first = inspect.getsourcelines(cls)
    return next(first + i for i, line in enumerate(lines) if line.rstrip().endswith(f"# {marker}"))
