"""Backward uses of a graph with early blocks that erase_fx cannot run exactly: clear errors.

The early blocks' gradients are computed in the forward, outside autograd,
so a double backward (``create_graph=True``) cannot differentiate them, and a
second backward (``retain_graph=True``) would read saved tensors the first
one overwrote when the backward reuses (donates) them. `BackwardGuard`
registers a pre-hook on each output's autograd node that raises
`EraseRuntimeError` with the fix instead.
"""
from __future__ import annotations

from typing import Any

import torch

from erase_fx.errors import EraseRuntimeError


class BackwardGuard:
    """Raises a clear error on the backward uses erase_fx cannot run (see the module doc).

    Attributes:
        donates_buffers: whether the compiled backward reuses its saved tensors
            (AOTAutograd's donated buffers), known once the forward compiled.
    """

    def __init__(self) -> None:
        self.donates_buffers = False
        # NB: a backward called inside a compiled frame runs the hook while Dynamo's frame
        # callback is active: disabled, the hook is not traced (no graph break of ours)
        self._hook = torch._dynamo.disable(self._check)

    def guard(self, outputs: Any) -> None:
        """Hook each distinct autograd node among ``outputs``."""
        seen = set()
        for value in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
            grad_fn = getattr(value, "grad_fn", None)
            if grad_fn is None or id(grad_fn) in seen:
                continue
            seen.add(id(grad_fn))
            grad_fn.register_prehook(self._hook)

    def _check(self, grad_outputs: Any) -> None:
        if torch.is_grad_enabled():
            raise EraseRuntimeError(
                "backward",
                "double backward (create_graph=True) through a graph with early blocks is not "
                "supported: their gradients were computed in the forward, outside autograd",
                fix="compile this model without backend='erase' for higher-order gradients",
            )
        if self.donates_buffers and torch._C._autograd._get_current_graph_task_keep_graph():
            raise EraseRuntimeError(
                "backward",
                "retain_graph=True through a graph whose backward reuses (donates) its saved "
                "tensors, early gradients included: a second backward would read overwritten "
                "values",
                fix="call backward once per forward, or set "
                "torch._functorch.config.donated_buffer = False before compiling",
            )
