"""The value every structural pass returns."""
from __future__ import annotations

import dataclasses

import torch.fx as fx


@dataclasses.dataclass(frozen=True)
class PassResult:
    """A new module (the input is never mutated), and whether it differs from the input."""

    gm: fx.GraphModule
    modified: bool
