"""A call's arguments: their signature, and whether the step can be captured on this device.

One graph is captured per *signature* (`signature`): tensor shapes, dtypes,
devices and ``requires_grad``, the values of the other arguments, grad mode,
the arguments' structure. Tensors are copied into the graph's static inputs
at each replay; arguments that are neither tensors nor plain values, and
tensor arguments that require grad, cannot be captured (the reason says
what to pass instead). `cuda_available` and `on_cuda` are the seams the CPU
tests replace (``tests/fake_cuda.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.utils._pytree as pytree

from erase_fx.step.guards import PythonState
from erase_fx.step.uses import PLAIN

#: The leaves of a call's arguments that need no pytree: tensors and plain values.
LEAF = (torch.Tensor,) + PLAIN


@dataclasses.dataclass(frozen=True)
class _Flat:
    """The spec of positional arguments that are all tensors or plain values (no pytree)."""

    count: int


def flatten(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """The arguments' leaves and structure; plain positional arguments skip pytree (it is slow)."""
    if not kwargs and all(isinstance(a, LEAF) for a in args):
        return list(args), _Flat(len(args))
    return pytree.tree_flatten((args, kwargs))


def unflatten(leaves: list[Any], spec: Any) -> tuple[tuple, dict]:
    if isinstance(spec, _Flat):
        return tuple(leaves), {}
    return pytree.tree_unflatten(leaves, spec)


def signature(leaves: list[Any], spec: Any) -> tuple[Any, str | None]:
    """The key of one capture, or the reason these arguments cannot be captured."""
    parts: list[Any] = [torch.is_grad_enabled()]
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                return None, (f"tensor argument {i} requires grad: a replay would write its .grad "
                              "on a static copy; pass it with requires_grad=False and compute "
                              "gradients of inputs inside the step")
            parts.append((torch.Tensor, tuple(leaf.shape), leaf.dtype, leaf.device))
        elif isinstance(leaf, PLAIN):
            parts.append((type(leaf), leaf))
        else:
            return None, (f"argument {i} of type {type(leaf).__name__} is neither a tensor nor a "
                          "plain value (tensors inside it would be read at their capture-time "
                          "address): pass its tensors, or register the type as a pytree node "
                          "(torch.utils._pytree.register_pytree_node)")
    try:
        hash(spec)
        parts.append(spec)
    except TypeError:
        parts.append(repr(spec))
    return tuple(parts), None


def cuda_available() -> bool:
    """Whether CUDA can be used (a seam the CPU tests replace)."""
    return torch.cuda.is_available()


def on_cuda(tensor: torch.Tensor) -> bool:
    """Whether a tensor lives on a CUDA device (a seam the CPU tests replace)."""
    return tensor.is_cuda


def device_problem(leaves: list[Any], state: PythonState) -> str | None:
    """Why the step cannot be captured on the current CUDA device, if it cannot."""
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)] + state.tensors()
    cuda = [t for t in tensors if on_cuda(t)]
    if not cuda:
        return ("no tensor of the step (arguments, parameters, buffers, optimizer state) is on "
                "CUDA: it runs as written")
    devices = {t.device for t in cuda if t.device.type == "cuda"}
    if devices and devices != {torch.device("cuda", torch.cuda.current_device())}:
        names = ", ".join(sorted(str(d) for d in devices))
        return (f"the step's tensors are on {names} but the current device is "
                f"cuda:{torch.cuda.current_device()}: one device per step; call "
                "torch.cuda.set_device(...) before the step")
    return None
