"""Early gradients scaled in place by ``T / seed``, skipped on the device when that is 1.

`defer_grad_scaling` makes the backward return each early gradient unscaled
(it lives in the memory of a saved tensor of the forward) plus the scale
``T / seed`` as a 0-dim tensor. `ScaledBackward` wraps the compiled backward
and multiplies those gradients in place: on CUDA with one Triton kernel per
eight gradients that reads the scale on the device and does nothing else when
it is exactly 1 (a plain ``loss.backward()``), so the step pays no pass over
the early gradients' memory; with another scale (a loss scaler, a weighted
loss) it multiplies, in float32 like torch's ``mul``. On CPU the scale is read
on the host; without Triton ``torch._foreach_mul_`` does it unconditionally.

A gradient is scaled in place only when that cannot be seen by anyone: its
memory is shared with no other input of the backward but its own saved tensor
and with no other gradient, it is dense, and the backward does not keep its
graph (``retain_graph=True`` would read the saved tensor again). Otherwise it
is multiplied out of place, as the graph had it. Each gradient handed out is
a fresh alias (``detach()``), so autograd's AccumulateGrad adopts it as
``.grad`` without a copy.

The memory check reads every input's and gradient's storage at each call
(about 90 us a step on a four-block chain on the CPU, as much as the rest of
erase's driver), so it is made only for the gradients the compilation could
not prove private: a whole early gradient whose saved tensor owns its memory
(`erase_fx.early_grads.plan_early_grads`: made by an op that returns fresh
memory, read by nothing else, returned once) shares it with no other input or
gradient by construction; only its density is checked.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from erase_fx.emit.inner import Boxed
from erase_fx.passes.defer_grad_scaling import ScaledGrad

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton
    triton = None

#: Gradients one kernel launch scales (the kernel's pointer arguments).
GRADS_PER_LAUNCH = 8
_BLOCK = 2048
_MAX_PROGRAMS_PER_GRAD = 256
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ScaledBackward(Boxed):
    """A compiled backward whose early gradients come out unscaled; scales them.

    ``fn`` returns ``num_grads`` gradients then the scales; ``scaled`` says
    which gradient takes which scale; ``private``: the ``(grad_index,
    saved_index)`` of the entries whose saved tensor owns its memory (the
    compilation proved it: their memory is not checked at each call).
    """

    def __init__(self, fn: Callable[[list[Any]], Any], num_grads: int,
                 scaled: Sequence[ScaledGrad],
                 private: Collection[tuple[int, int]] = frozenset()):
        super().__init__()
        self.fn = fn
        self.num_grads = num_grads
        self.scaled = tuple(scaled)
        #: per entry of ``scaled``: whether its memory is checked at each call
        self.checked = tuple((e.grad_index, e.saved_index) not in private for e in self.scaled)
        self._any_checked = any(self.checked)

    def __call__(self, args: list[Any]) -> list[Any]:
        in_place = not backward_keeps_graph()
        check = in_place and self._any_checked
        # NB: before fn, which clears its (boxed) arguments
        arg_storages = _storage_ptrs(args) if check else []
        outputs = list(self.fn(args))
        grads, scales = outputs[: self.num_grads], outputs[self.num_grads:]
        memory = (_Memory(arg_storages, _storage_ptrs(grads)) if check else None)
        groups: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        for entry, checked in zip(self.scaled, self.checked):
            grad = grads[entry.grad_index]
            if grad is None:
                continue
            if in_place and (memory.private(grad, entry.saved_index) if checked
                             else is_dense(grad)):
                groups[entry.scale_index].append(grad)
                grads[entry.grad_index] = grad.detach()
            else:
                grads[entry.grad_index] = grad * scales[entry.scale_index]
        for scale_index, tensors in groups.items():
            scale_unless_one_(tensors, scales[scale_index])
        return grads


def backward_keeps_graph() -> bool:
    """Whether the running backward keeps its graph (``retain_graph=True``).

    NB: torch answers True outside a backward (no graph task), the safe side here.
    """
    return torch._C._autograd._get_current_graph_task_keep_graph()


def _storage_ptrs(values: Sequence[Any]) -> list[int | None]:
    return [v.untyped_storage().data_ptr() if isinstance(v, torch.Tensor) else None
            for v in values]


class _Memory:
    """The memory of one call's backward inputs and gradients (storage pointers)."""

    def __init__(self, arg_storages: list[int | None], grad_storages: list[int | None]):
        self.arg_storages = arg_storages
        self.arg_counts = collections.Counter(arg_storages)
        self.grad_counts = collections.Counter(grad_storages)

    def private(self, grad: torch.Tensor, saved_index: int) -> bool:
        """Whether scaling ``grad`` in place changes nothing anyone else can read: it is
        dense, and its memory is no other gradient's and no backward input's but its own
        saved tensor's (input ``saved_index``)."""
        ptr = grad.untyped_storage().data_ptr()
        if self.grad_counts[ptr] != 1 or not is_dense(grad):
            return False
        return self.arg_counts[ptr] == (1 if self.arg_storages[saved_index] == ptr else 0)


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements fill a span of memory exactly once (any dim order).

    NB: torch's own check (``torch._prims_common``) handles symbolic sizes and
    costs ~200 us a call; this runs once per early gradient per backward.
    """
    return tensor.is_contiguous() or is_dense_layout(tensor.shape, tensor.stride())


def is_dense_layout(size: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a layout puts the elements in one span without gaps or overlaps (any dim order)."""
    expected = 1
    for stride, length in sorted((st, sz) for st, sz in zip(strides, size) if sz != 1):
        if stride != expected:
            return False
        expected *= length
    return True


def scale_unless_one_(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """``t *= scale`` for each tensor, doing nothing when ``scale`` is exactly 1.

    The tensors must be dense and share no memory. On CUDA the test runs on
    the device (no synchronisation; safe under CUDA graph capture).
    """
    tensors = list(tensors)
    if not tensors:
        return
    if scale.device.type == "cpu":
        if scale.item() != 1:
            torch._foreach_mul_(tensors, scale)
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = collections.defaultdict(list)
    slow = []
    for t in tensors:
        if triton is not None and t.is_cuda and t.dtype in _TRITON_DTYPES:
            by_dtype[t.dtype].append(t)
        else:
            slow.append(t)
    if slow:
        torch._foreach_mul_(slow, scale)
    for group in by_dtype.values():
        for start in range(0, len(group), GRADS_PER_LAUNCH):
            _launch(group[start: start + GRADS_PER_LAUNCH], scale)


def _launch(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    # NB: the kernel walks each tensor's memory as a flat span from its
    # lowest address; a dense tensor's lowest address is its data_ptr().
    numels = [t.numel() for t in tensors]
    padded = tensors + [tensors[0]] * (GRADS_PER_LAUNCH - len(tensors))
    numels += [0] * (GRADS_PER_LAUNCH - len(tensors))
    parts = max(1, min(_MAX_PROGRAMS_PER_GRAD, triton.cdiv(max(numels), _BLOCK)))
    with torch.cuda.device(tensors[0].device):
        _scale_unless_one_kernel[(len(tensors), parts)](
            scale, *padded, *numels, BLOCK=_BLOCK, num_warps=8)


if triton is not None:

    @triton.jit
    def _scale_span(ptr, numel, s, part, parts, BLOCK: tl.constexpr):
        for start in range(part * BLOCK, numel, parts * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < numel
            x = tl.load(ptr + offsets, mask=mask)
            tl.store(ptr + offsets, (x.to(tl.float32) * s).to(x.dtype), mask=mask)

    @triton.jit
    def _scale_unless_one_kernel(scale_ptr, p0, p1, p2, p3, p4, p5, p6, p7,
                                 n0, n1, n2, n3, n4, n5, n6, n7, BLOCK: tl.constexpr):
        s = tl.load(scale_ptr).to(tl.float32)
        if s != 1.0:
            # NB: arguments cannot be indexed at run time: one branch per pointer.
            which = tl.program_id(0)
            part = tl.program_id(1)
            parts = tl.num_programs(1)
            if which == 0:
                _scale_span(p0, n0, s, part, parts, BLOCK)
            if which == 1:
                _scale_span(p1, n1, s, part, parts, BLOCK)
            if which == 2:
                _scale_span(p2, n2, s, part, parts, BLOCK)
            if which == 3:
                _scale_span(p3, n3, s, part, parts, BLOCK)
            if which == 4:
                _scale_span(p4, n4, s, part, parts, BLOCK)
            if which == 5:
                _scale_span(p5, n5, s, part, parts, BLOCK)
            if which == 6:
                _scale_span(p6, n6, s, part, parts, BLOCK)
            if which == 7:
                _scale_span(p7, n7, s, part, parts, BLOCK)
