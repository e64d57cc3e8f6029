"""Fusion that leaves Inductor its in-place writes, in side-stream segments.

A side-stream segment holds one early block's head, its local loss and its
backward, compiled as one Inductor graph. Under CUDA graph capture each side
stream keeps a memory pool of its own, which no other stream reuses, so the
pools of the streams add up and each one is as large as its segment's peak.

On a GPU a segment's peak is often one large value and a value of the same
size made from it: a block's logits and their gradient (H200, gpt:16:384:256:8:
two 64 MiB bf16 buffers on every side stream, `bench.memory_profile`). Inductor
writes such a gradient over its input when the input has no other reader left
(``Scheduler.decide_inplace_update``). It cannot here, because of a fusion:

- the softmax statistics (a reduction over the logits) and the gradient (a
  pointwise op over the logits, at the same index as its output) become one
  kernel, in which the logits are read at two different indices: Inductor
  does not write in place over a buffer its kernel reads twice;
- the loss *value* reads the logits too (at each row's target) and, needing
  the statistics, runs after that kernel, so the logits are still alive when
  the gradient is written;
- a loss value over soft targets (label smoothing: a sum over every class)
  reads the logits at the gradient's own index and fuses with it. Inductor
  counts a reader in the writer's own kernel as done only when the writer
  waits for it (an ancestor: the statistics), so the value, which needs
  nothing the gradient makes, keeps the logits alive in that kernel.

Left as two kernels (statistics and loss value first, then the gradient), the
gradient overwrites the logits, and the segment's peak holds one of the two
buffers, not both. The price is one more read of the buffer (the gradient
kernel reads it again from memory, where the fused kernel's second pass over a
row may find it in cache), on a stream that runs beside the forward. Measured
(H200, step API against stock ``inductor+step``, on against off): gpt:16:384:256:8
1.04x of stock's step memory at 0.91x of its time (off: 1.29x, 0.89x);
gpt-soft:16:384:256:8 1.00x at 0.99x (off: 1.24x, 0.87x), where the split costs
13% of the step for reasons not yet profiled.

`keep_inplace_writes` makes Inductor refuse exactly those fusions while it
compiles a segment: a fusion is refused when one of its nodes could write in
place over a buffer of at least ``min_bytes`` (Inductor's own ``can_inplace``:
same index and size as its write), its own kernel reads the buffer nowhere
else, the other side of the fusion reads it at another index, and no other
reader of the buffer needs the writer's result (so each can run first). It is
a heuristic in Inductor's own extension point (``InductorChoices``, through
``V.set_choices_handler``), not a correctness requirement: every kernel
computes what it did fused. Inductor's FX graph cache does not know the
handler, so the cache key is tagged while it is set
(``torch.compiler.config.cache_key_tag``): a segment compiled with and without
it is two cache entries.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

#: Smallest buffer whose in-place write is worth a kernel: a side stream's
#: peak is made of its largest values, and splitting a kernel costs a launch
#: and a read of the buffer.
MIN_INPLACE_BYTES = 8 << 20

#: What `keep_inplace_writes` adds to Inductor's cache key tag.
CACHE_KEY_TAG = "erase_fx.keep_inplace_writes"


@dataclasses.dataclass(frozen=True)
class RefusedFusion:
    """One fusion Inductor was told not to make: ``writer`` can then write in place over
    ``buffer`` (``nbytes`` bytes)."""

    buffer: str
    nbytes: int
    writer: str


class InplaceKeepingChoices:
    """Inductor's choices handler ``inner``, with fusions that would block a large in-place
    write refused (`fusion_blocks_inplace_write`); every other choice is ``inner``'s."""

    def __init__(self, inner: Any, min_bytes: int = MIN_INPLACE_BYTES):
        self._inner = inner
        self.min_bytes = min_bytes
        self.refused: list[RefusedFusion] = []

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # NB: copy and pickle look attributes up before __init__ ran
            raise AttributeError(name)
        return getattr(self._inner, name)

    def can_fuse(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        if not self._inner.can_fuse(scheduler, node1, node2, shared_data_score):
            return False
        refused = fusion_blocks_inplace_write(scheduler, node1, node2, self.min_bytes)
        if refused is None:
            return True
        if refused not in self.refused:
            self.refused.append(refused)
        return False


@contextlib.contextmanager
def keep_inplace_writes(min_bytes: int = MIN_INPLACE_BYTES) -> Iterator[InplaceKeepingChoices]:
    """While Inductor compiles inside, refuse fusions that would block in-place writes over
    buffers of ``min_bytes`` or more; yields the handler (its ``refused`` lists them)."""
    import torch.compiler.config as compiler_config
    from torch._inductor.virtualized import V

    handler = InplaceKeepingChoices(V.choices, min_bytes)
    if not hasattr(V, "set_choices_handler") or not hasattr(compiler_config, "cache_key_tag"):
        yield handler  # NB: a torch without the extension point: Inductor's own choices
        return
    tag = compiler_config.cache_key_tag
    tag = f"{tag}|{CACHE_KEY_TAG}:{min_bytes}" if tag else f"{CACHE_KEY_TAG}:{min_bytes}"
    with V.set_choices_handler(handler), compiler_config.patch(cache_key_tag=tag):
        yield handler


def fusion_blocks_inplace_write(scheduler: Any, node1: Any, node2: Any,
                                min_bytes: int) -> RefusedFusion | None:
    """The in-place write that fusing ``node1`` with ``node2`` would block, or None.

    Node ``w`` may write over buffer ``B`` when Inductor marks its read
    ``can_inplace`` (same index and size as its write) and, when ``w``'s kernel
    runs, ``B`` has no reader left but that kernel, which reads ``B`` at ``w``'s
    index only (`_inplace_possible`). Fusing blocks the write when it is possible
    with ``w``'s group as its kernel and not with the fused one: the other group
    reads ``B`` at another index, or a reader of ``B`` outside the pair needs the
    other group's results, so it would have to run after the fused kernel. A
    fusion with ``B``'s own maker is never counted (``B`` is no input there).
    """
    for group, other in ((node1, node2), (node2, node1)):
        for writer in group.get_nodes():
            for buffer, dep in _inplace_reads(scheduler, writer):
                nbytes = _nbytes(buffer)
                if (nbytes >= min_bytes and not _makes(other, buffer.get_name())
                        and _inplace_possible(buffer, dep, writer, (group,))
                        and not _inplace_possible(buffer, dep, writer, (node1, node2))):
                    return RefusedFusion(buffer.get_name(), nbytes, writer.get_name())
    return None


def _makes(group: Any, name: str) -> bool:
    """Whether ``group`` writes buffer ``name`` (fused with its maker, a buffer is no input)."""
    return any(dep.name == name for node in group.get_nodes() for dep in node.read_writes.writes)


def _inplace_possible(buffer: Any, dep: Any, writer: Any, kernel: tuple[Any, ...]) -> bool:
    """Whether ``writer``, in a kernel of the groups ``kernel``, can write over ``buffer`` at
    ``dep``: the kernel reads ``buffer`` at that index only, and every other reader is done
    when the write is decided. Inductor (``decide_inplace_update``) counts a reader done
    when it is an ancestor of the writer or ran in an earlier kernel; a reader in the same
    kernel that the writer does not wait for (a loss value summed over soft targets, beside
    the gradient) is not, so it must be left out of the kernel. A reader outside the kernel
    can run before it when it is no graph output and needs nothing the kernel makes."""
    names = {node.get_name() for group in kernel for node in group.get_nodes()}
    deps = {d for group in kernel for node in group.get_nodes()
            for d in node.read_writes.reads_and_writes() if d.name == buffer.get_name()}
    if deps != {dep}:
        return False
    done_before = set(getattr(writer, "ancestors", ())) | {writer.get_name()}
    for user in buffer.users:
        if user.get_name() in done_before:
            continue
        if user.get_name() in names:
            return False  # NB: in the writer's kernel, and not waited for: still to run
        ancestors = getattr(user.node, "ancestors", None)
        if ancestors is None or names & set(ancestors):  # the graph's output, or a later reader
            return False
    return True


def _inplace_reads(scheduler: Any, writer: Any) -> Iterator[tuple[Any, Any]]:
    """(buffer, read dep) for each buffer ``writer`` may overwrite, by Inductor's ``can_inplace``."""
    for dep in writer.read_writes.reads:
        buffer = scheduler.name_to_buf.get(dep.name)
        if buffer is None:  # a graph input: never reused
            continue
        if any(user.node is writer and user.can_inplace for user in buffer.users):
            yield buffer, dep


def _nbytes(buffer: Any) -> int:
    from torch._inductor.virtualized import V

    node = buffer.node
    sizevars = V.graph.sizevars
    # NB: torch 2.13 renamed SizeVarAllocator.size_hint to optimization_hint
    hint = getattr(sizevars, "optimization_hint", None) or sizevars.size_hint
    try:
        return int(hint(node.get_numel(), fallback=0)) * node.get_dtype().itemsize
    except Exception:  # NB: a layout without a size (a multi-output node): never counted
        return 0
