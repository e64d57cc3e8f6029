"""The settings of one erase_fx compilation.

`EraseConfig` is built from ``torch.compile(model, backend="erase", options={...})``.
Every field is documented here and in the README's options table; an unknown
option or a value of the wrong kind raises `EraseOptionError` listing what is
allowed and the default. Environment variables are read only for debugging
dumps (``ERASE_FX_DUMP``).
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from erase_fx.errors import EraseOptionError

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
PARTITIONERS = ("min_cut", "default")
ON_ERROR = ("fallback", "raise")


@dataclasses.dataclass(frozen=True)
class EraseConfig:
    """What erase_fx does with one compiled graph.

    Attributes:
        streams: number of side streams the early backward blocks are spread
            over, round-robin by block order (block ``i`` runs on side stream
            ``1 + i % streams``; stream 0 is the main stream, where the forward
            runs). On CPU the streams are virtual: segments run in program
            order. Measured on an H200 (``python -m bench.run``, ctr:4096, GPU
            bound): 2, 4 and 8 side streams 2-3% faster than none (every
            segment on the main stream), 1 side stream 0.4%; 4 keeps
            consecutive blocks of a chain on different streams at no
            measurable cost. ``0``: no side stream and no segments: each
            early block's backward runs on the main stream where the schedule
            places it, and the forward compiles as one graph, so Inductor
            fuses across where the segment boundaries would be. No overlap;
            each block's activations are freed as soon as its backward has
            run, under CUDA graph capture too (one stream reuses its own
            memory), but Inductor may fuse work of several blocks into one
            late kernel and hold their values to it (the blocks' loss values
            on the gpt chains: 0.73x of stock's step memory where
            ``overlap=False`` needs 0.37x). Under DDP it leaves the all-reduce of
            every gradient to DDP's buckets (``early_allreduce`` needs the
            side streams' program).
        inner: the compiler of each segment and of the backward:
            ``"inductor"`` (fused kernels; the graph is traced with Inductor's
            decompositions), ``"aot_eager"`` (each segment runs its FX code, as
            torch's ``aot_eager`` backend does), ``"eager"`` (each segment runs
            node by node through ``torch.fx.Interpreter``, for debugging).
        partitioner: the stock AOTAutograd partitioner used for everything that
            is not an early block: ``"min_cut"`` (recomputes cheap forward ops
            in the backward to save memory, as ``inductor`` and ``aot_eager``
            do) or ``"default"`` (saves what the backward reads).
        seed: the loss gradient the early backward is computed with. The
            backward returns ``T / seed * early_grad`` where ``T`` is the real
            loss gradient (1 for ``loss.backward()``, the scale for
            ``scaler.scale(loss).backward()``), multiplying in place, and skips
            that pass over the early grads (on the device) when ``T == seed``.
            Set it near a GradScaler's scale when the early grads are fp16, so
            small grads do not underflow.
        cudagraphs: replay the compiled forward (side streams included) and
            backward from CUDA graphs, so a step costs two launches instead
            of one per kernel. ``None`` (default): on for graphs on a CUDA
            device with static shapes; ``True``: the same (dynamic shapes
            still run without graphs, with a logged reason); ``False``: off.
            No effect on CPU. Inside a CUDA graph capture of the caller's
            (a whole training step captured by hand) the program runs as is,
            so that capture records it. See ``erase_fx/emit/cudagraphs.py``
            for what keeps replay exact.
        dump_dir: a folder to write each compiled graph's passes, segments,
            report, pass timings (``timings.json``) and schedule picture
            (``schedule.dot``) into (``graph_<n>/``; see `erase_fx.instruments`);
            ``ERASE_FX_DUMP`` sets it too. ``None`` writes nothing.
        overlap: run each early block on its side stream (``True``, default),
            or every segment on the main stream (``False``): the same
            segments and kernels in the same order, without overlap. What
            the overlap alone is worth, and the memory-first setting: each
            block's values are freed once its backward has run and the next
            block reuses the memory (H200, whole step captured: 0.37-0.45x of
            stock's step memory on the gpt chains and ctr:16384 at 0.99-1.03x
            of its time; `docs/performance.md`). No effect on CPU, where
            streams are virtual anyway.
        release_lag: under CUDA graph capture (erase's own graphs, or a whole
            training step captured by `erase_fx.compile_step` or by hand),
            when the forward's memory is freed. ``None``: nothing before the
            join at the end of the forward (the behaviour the 2,000-step race
            stress passed). An integer N: a tensor the main stream made and a
            block's early backward read (the block's activations) is released
            once the main stream has started N more segments and waited for
            that block's side stream; tensors read on one stream only are
            freed after their last reader. Smaller frees sooner, but a main
            segment that waits for a side stream still busy stalls: on an
            H200 ``release_lag=1`` passed the 2,000-step race stress, and ran
            1.04-1.07x of stock's step on the small chains where None runs
            0.80-0.86x, for little memory
            (``bench/results/step.md``, ``check_cuda.md``); ``release_lag=2`` took
            the DGL ViT from 1.34x to 0.88x of stock's step memory for 1% of
            time, and slowed DGL ResNet-18 by 12% for nothing
            (``bench/results/step.md``). ``"auto"``
            (default): `erase_fx.compile_step` chooses: it captures the step
            once per candidate (None, 2, 1), times a few replays of each
            (real training steps) and keeps the lag whose graph holds the
            least memory among those within 2% of the fastest
            (`erase_fx.capture_tuning`); elsewhere (erase's own graphs, a
            capture by hand) ``"auto"`` acts as None. Outside capture the
            caching allocator frees every tensor as soon as its last reader is
            done, whatever this says (see `erase_fx.emit.release`).
        side_cuda_streams: how many CUDA streams run the ``streams`` side
            streams: side stream ``s`` runs on CUDA stream
            ``1 + (s - 1) % side_cuda_streams``, in the same launch order and
            with the same events, so blocks that share a CUDA stream run one
            after the other (nothing is recompiled; folding only adds order).
            Under CUDA graph capture they then share the stream's memory
            and its cuBLAS workspace (33 MiB each): each CUDA stream keeps
            its own pool, and the pools add up. ``None``: one CUDA stream per
            side stream. ``"auto"`` (default): `erase_fx.compile_step` times
            2 against all (with ``release_lag="auto"``, every pair of
            candidates worth trying; `erase_fx.capture_tuning`), and
            elsewhere it is None. On an H200 it folded ctr:16384 and gpt:8 to
            2 (step memory 1.57x -> 0.97x and 1.04x -> 0.75x of stock's, at
            0.99x and 0.98x of its time) and kept all four on DGL ResNet-18,
            mlp:512 and gpt:16, where 2 was 3-6% slower
            (``bench/results/step.md``).
        stages_on_side: run each early block's own stage (the forward whose
            activations its early backward reads) on the block's side stream
            too, before its head, so those activations are made, read and
            freed on one stream: under CUDA graph capture they are freed as
            soon as the block's backward is done, with no wait on the main
            stream, and the side stream's next block reuses the memory; the
            next stage starts once this stage's output exists (an event).
            ``None`` (default): when there are more early blocks than side
            streams (a stream then runs several blocks); ``True``: always;
            ``False``: stages on the main stream, their activations live to
            the join at the end of the forward under capture. Needs
            ``streams >= 2`` (with one side stream a block's stage would
            queue behind the block before it); a block in pieces keeps its
            stage on the main stream. Measured on an H200 (step API,
            ``python -m bench.run``): gpt:16:384:256:8 (7 blocks) 1811 MiB
            of step memory instead of 2153, 1207 with ``streams=2``, at the
            same speed; DGL ResNet-18 (3 blocks on 4 streams) 5% slower with
            9% more memory when forced on (before BatchNorm's statistics
            updates stopped cutting stages into pieces; not re-measured).
        copy_input_values: each early block makes its own copy of a large
            value made from the graph's inputs alone that other blocks (or the
            forward) read too (``True``, default), instead of sharing one
            (`passes/copy_input_values_per_block.py`): merging common
            subexpressions makes, say, every block's soft targets made from the
            labels in the forward (batch x classes) one value, which then lives
            through every block under CUDA graph capture. The copies cost one elementwise
            pass each (fused into the block's kernels with Inductor).
            ``False``: share them, as the partitioner left them.
        recompute_boundary_values: each block's segment (its head, local
            loss and early backward) recomputes the cheap elementwise values
            it reads from the forward (a GELU's pieces, casts), fused into its
            own kernels, where that makes it read fewer bytes across its
            segment boundary (`passes/recompute_boundary_values.py`), as the
            stock partitioner recomputes such values in the backward. Without
            it a segment boundary passes every value that crosses it, written
            out and read back. ``True`` (default): measured on an H200 (step
            API against stock ``inductor+step``, ``python -m bench.run``,
            2026-12-02), on against off: gpt:8:768:1024:6 0.96x of stock
            (off: 1.04x) with 1.33x its step memory (off: 2.04x),
            gpt:16:384:256:8 0.90x (0.97x), 1.29x (1.67x); DGL ResNet-18
            equal time, 5% less memory; the small chains and ctr:16384
            within 1% of off; MobileNetV3 DGL 0.87x of stock against 0.85x
            off (2.6% slower) with 11% less memory. ``False``: read them
            across the boundary.
        keep_inplace_writes: each side-stream segment is compiled so that
            Inductor can write a large value (8 MiB or more) over the buffer
            it is made from, where one of Inductor's fusions would prevent it
            (`erase_fx.emit.inplace_fusion`): a local loss's logits and their
            gradient then share one buffer. Under capture each side stream
            keeps its own memory pool, as large as its segment's peak, so
            this is memory saved on every side stream; it costs one more read
            of each such buffer. ``True`` (default): measured on an H200
            (step API against stock ``inductor+step``, ``python -m bench.run``,
            2026-12-02, `bench/results/step.md`), on against
            off: gpt:16:384:256:8 step memory 1.04x of stock (off: 1.29x), time
            0.91x (0.89x), gpt:8:768:1024:6 1.09x (1.33x), 0.99x (0.97x);
            soft targets (label smoothing, gpt-soft:16:384:256:8, 2026-12-03,
            `bench/results/step.md`) 1.00x (1.24x), 0.99x
            (0.87x): there it costs 13% of the step, and ``False`` is faster
            at more memory than stock's; where
            such a buffer does not set a side stream's peak, memory and time
            are unchanged within 1% (ctr:16384, DGL ResNet-18, the DGL ViT);
            the small chains have none. ``False``: Inductor's own fusions.
        min_part_share: the cost check on gradient parts (an auxiliary head
            on a trunk it is not detached from, one tower of several over a
            shared front: `passes/split_at_sums.py`). Such a part runs early
            only if its estimated backward FLOPs are at least this share of
            the graph's whole backward; a smaller one stays in the backward
            (reason ``small_part`` in `erase_fx.explain`). Running a part early
            wins at most its own backward's time, while the segment boundary
            it cuts into the trunk's forward costs about the same whatever its
            size. Default 0.05: run early, GoogLeNet's two auxiliary heads
            (2.6% each) made the step 1.06x of stock's (H200, step API).
            ``0`` runs every part early. Whole blocks (a detached stage and
            its head) are not held to it, nor the pieces of a block that runs
            early in pieces (it launches whole or in pieces by readiness
            alone). A part kept back this way is listed on its own, so a
            part beside it that erase_fx cannot prove safe is reported (and
            raises under ``on_error="raise"``) as it is with the check off.
        early_allreduce: under DistributedDataParallel, all-reduce each early
            block's gradients during the forward, as soon as its early backward
            ends (one flat buffer per block, on a communication stream;
            divided by the world size as DDP does), instead of at
            ``.backward()`` through DDP's buckets; DDP's reducer then skips
            them (a communication hook; see `erase_fx.ddp`). ``False``: DDP
            reduces every gradient, as without erase_fx. No effect without DDP.
        on_error: what a failure inside erase_fx does: ``"fallback"`` logs a
            warning with the reason and compiles the graph on the stock path
            (no early block, gradients still exact); ``"raise"`` raises the
            `EraseError`. A block whose backward cannot be proven safe to run
            early (a mutation, an op not known to be linear in the loss
            gradient) stays in the backward under ``"fallback"`` and raises
            under ``"raise"``.
    """

    streams: int = 4
    inner: str = "inductor"
    partitioner: str = "min_cut"
    seed: float = 1.0
    cudagraphs: bool | None = None
    dump_dir: str | None = None
    overlap: bool = True
    release_lag: int | str | None = "auto"
    side_cuda_streams: int | str | None = "auto"
    stages_on_side: bool | None = None
    copy_input_values: bool = True
    recompute_boundary_values: bool = True
    min_part_share: float = 0.05
    keep_inplace_writes: bool = True
    early_allreduce: bool = True
    on_error: str = "fallback"

    def __post_init__(self) -> None:
        _check_type("streams", self.streams, int)
        if self.streams < 0:
            raise EraseOptionError("streams", self.streams,
                                   "an integer >= 0 (0: the forward in one graph, no side stream)")
        _check_choice("inner", self.inner, INNER_COMPILERS)
        _check_choice("partitioner", self.partitioner, PARTITIONERS)
        _check_choice("on_error", self.on_error, ON_ERROR)
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, float)):
            raise EraseOptionError("seed", self.seed, "a finite non-zero float")
        if not math.isfinite(self.seed) or self.seed == 0:
            raise EraseOptionError("seed", self.seed, "a finite non-zero float")
        if self.cudagraphs is not None:
            _check_type("cudagraphs", self.cudagraphs, bool)
        _check_type("overlap", self.overlap, bool)
        _check_type("early_allreduce", self.early_allreduce, bool)
        _check_type("copy_input_values", self.copy_input_values, bool)
        _check_type("recompute_boundary_values", self.recompute_boundary_values, bool)
        _check_type("keep_inplace_writes", self.keep_inplace_writes, bool)
        if (isinstance(self.min_part_share, bool)
                or not isinstance(self.min_part_share, (int, float))
                or not 0 <= self.min_part_share <= 1):
            raise EraseOptionError("min_part_share", self.min_part_share,
                                   "a share of the backward's FLOPs, from 0 to 1")
        if self.stages_on_side is not None:
            _check_type("stages_on_side", self.stages_on_side, bool)
        if self.release_lag is not None and self.release_lag != "auto":
            if (not isinstance(self.release_lag, int) or isinstance(self.release_lag, bool)
                    or self.release_lag < 1):
                raise EraseOptionError("release_lag", self.release_lag,
                                       "an integer >= 1, 'auto' or None")
        if self.side_cuda_streams is not None and self.side_cuda_streams != "auto":
            if (not isinstance(self.side_cuda_streams, int)
                    or isinstance(self.side_cuda_streams, bool) or self.side_cuda_streams < 1):
                raise EraseOptionError("side_cuda_streams", self.side_cuda_streams,
                                       "an integer >= 1, 'auto' or None")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise EraseOptionError("dump_dir", self.dump_dir, "a folder path or None")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> EraseConfig:
        """Build a config from ``torch.compile(..., options=...)``.

        ``ERASE_FX_DUMP`` fills ``dump_dir`` when the options leave it unset.
        """
        options = dict(options or {})
        allowed = {f.name: f.default for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise EraseOptionError.unknown(unknown, allowed)
        if options.get("dump_dir") is None and os.environ.get("ERASE_FX_DUMP"):
            options["dump_dir"] = os.environ["ERASE_FX_DUMP"]
        return cls(**options)

    def replace(self, **changes: Any) -> EraseConfig:
        return dataclasses.replace(self, **changes)


def _check_type(name: str, value: Any, kind: type) -> None:
    # NB: bool is an int subclass; streams=True is a mistake, not 1.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise EraseOptionError(name, value, f"a {kind.__name__}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise EraseOptionError(name, value, "one of " + ", ".join(repr(c) for c in choices))
